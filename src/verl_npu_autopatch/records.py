"""Records of what the engine decided, and the in-process report built from them."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Record", "Report", "table", "wrap"]


@dataclass
class Record:
    """One patch's fate in this process."""

    name: str
    groups: tuple[str, ...]
    target: str
    state: str = "pending"
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

    status: str  # "not-activated" | "inactive" | "active"
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

    def states(self) -> dict[str, str]:
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


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain fixed-width text table."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def wrap(text: str, width: int = 120, indent: str = "") -> list[str]:
    """``text`` as lines of at most ``width`` characters (continuations start with ``indent``)."""
    import textwrap

    return textwrap.wrap(text, width, subsequent_indent=indent, break_long_words=True, break_on_hyphens=False) or [""]
