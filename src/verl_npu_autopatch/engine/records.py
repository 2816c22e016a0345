"""Records of what the engine decided, and the in-process report built from them."""

from __future__ import annotations

import os
from typing import Any, Literal

__all__ = ["EngineStatus", "Record", "RecordState", "Report"]

#: The engine's decision about one patch in this process, as ``report()``, ``--json`` and
#: docs/troubleshooting.md show it.
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


class Record:
    """One patch's fate in this process (not a dataclass: compiling its methods costs activation 0.4 ms each)."""

    def __init__(
        self,
        name: str,
        groups: tuple[str, ...],
        target: str,
        state: RecordState = "pending",
        reason: str = "",
        versions: dict[str, str | None] | None = None,
        pid: int | None = None,
    ) -> None:
        self.name, self.groups, self.target, self.state, self.reason = name, groups, target, state, reason
        self.versions: dict[str, str | None] = {} if versions is None else versions
        self.pid = os.getpid() if pid is None else pid

    def copy(self) -> Record:
        """An independent copy (its own ``versions``)."""
        return Record(self.name, self.groups, self.target, self.state, self.reason, dict(self.versions), self.pid)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "groups": list(self.groups),
            "target": self.target,
            "state": self.state,
            "reason": self.reason,
            "versions": dict(self.versions),
            "pid": self.pid,
        }

    def __repr__(self) -> str:
        return f"Record({self.name!r}, {self.state!r}, {self.reason!r})"


class Report:
    """The engine's state in this process: whether it is active, why, and every record."""

    def __init__(
        self,
        status: EngineStatus,
        reason: str = "",
        trigger: str = "",
        device: str = "",
        records: list[Record] | None = None,
        warnings: list[str] | None = None,
        pid: int | None = None,
    ) -> None:
        self.status, self.reason, self.trigger, self.device = status, reason, trigger, device
        self.records: list[Record] = [] if records is None else records
        self.warnings: list[str] = [] if warnings is None else warnings
        self.pid = os.getpid() if pid is None else pid

    def __getitem__(self, name: str) -> Record:
        for record in self.records:
            if record.name == name:
                return record
        raise KeyError(name)

    def states(self) -> dict[str, RecordState]:
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
