"""Records of what the engine decided, and the in-process report built from them."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["EngineStatus", "Record", "RecordState", "Report"]

#: A record's state: the engine's decision about one patch in this process (see
#: docs/troubleshooting.md). The strings are what ``report()``, the JSON output and the docs show.
RecordState = Literal[
    "pending",
    "applied",
    "disabled",
    "gated",
    "fixed-upstream",
    "unsupported",
    "yielded",
    "superseded",
    "failed",
    "reverted",
]

#: The engine's status in this process (``Report.status``).
EngineStatus = Literal["not-activated", "activating", "inactive", "active", "failed"]


@dataclass
class Record:
    """One patch's fate in this process."""

    name: str
    groups: tuple[str, ...]
    target: str
    state: RecordState = "pending"
    reason: str = ""
    versions: dict[str, str | None] = field(default_factory=dict)
    pid: int = field(default_factory=os.getpid)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["groups"] = list(self.groups)
        return data


@dataclass
class Report:
    """The engine's state in this process: whether it is active, why, and every record."""

    status: EngineStatus
    reason: str = ""
    trigger: str = ""
    device: str = ""
    records: list[Record] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    pid: int = field(default_factory=os.getpid)

    def __getitem__(self, name: str) -> Record:
        for record in self.records:
            if record.name == name:
                return record
        raise KeyError(name)

    def states(self) -> dict[str, RecordState]:
        """``{patch name: state}``."""
        return {record.name: record.state for record in self.records}

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "reason": self.reason,
            "trigger": self.trigger,
            "device": self.device,
            "pid": self.pid,
            "warnings": list(self.warnings),
            "records": [record.to_dict() for record in self.records],
        }
