"""Records of what the engine decided, and the in-process report built from them."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from verl_npu_autopatch.engine.text import printable

__all__ = ["EngineStatus", "Record", "RecordState", "Report", "table", "wrap"]

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


def table(rows: list[list[str]], header: list[str], width: int | None = None) -> str:
    """A plain fixed-width text table, control characters escaped in every cell. With ``width``,
    columns are narrowed until a line fits in ``width`` characters (the last one first, down to
    40, then the widest), and their cells wrap onto continuation lines."""
    header, rows = [printable(str(cell)) for cell in header], [[printable(str(cell)) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    if width is not None:
        while sum(widths) + 2 * (len(widths) - 1) > width and max(widths) > _NARROWEST:
            column = len(widths) - 1 if widths[-1] > 40 else widths.index(max(widths))
            widths[column] -= 1
    lines = _table_row(header, widths)
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines += _table_row(row, widths)
    return "\n".join(lines)


#: The narrowest a column of :func:`table` is made to fit a width.
_NARROWEST = 12


def _table_row(cells: list[str], widths: list[int]) -> list[str]:
    """One row, cells wider than their column wrapped onto continuation lines."""
    parts = [wrap(str(cell), w) if len(str(cell)) > w else [str(cell)] for cell, w in zip(cells, widths, strict=True)]
    depth = max(len(p) for p in parts)
    return [
        "  ".join((p[i] if i < len(p) else "").ljust(w) for p, w in zip(parts, widths, strict=True)).rstrip()
        for i in range(depth)
    ]


def wrap(text: str, width: int = 120, indent: str = "") -> list[str]:
    """``text`` as lines of at most ``width`` characters (continuations start with ``indent``), its
    control characters escaped first (``_text.printable``: what a terminal shows is the text)."""
    import textwrap

    shown = printable(text)
    return textwrap.wrap(shown, width, subsequent_indent=indent, break_long_words=True, break_on_hyphens=False) or [""]
