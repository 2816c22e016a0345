"""Text the commands print: tables and wrapped lines (:func:`table`, :func:`wrap`), and the first
screen of ``status`` and ``doctor``: how many patches are in each state, each group
with its one reason and its patches named compactly (``transformers.* (35)``), and what needs
attention; every line fits the terminal (:func:`width`). The full table is behind ``--all``."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from typing import IO, Any

from verl_npu_autopatch.engine.text import cut, printable

#: Columns the screens fit in when the terminal's width is unknown (output to a pipe or a file,
#: ``COLUMNS`` unset).
WIDTH = 120
#: The narrowest width the screens are laid out for (a smaller ``COLUMNS`` counts as this).
MIN_WIDTH = 40


def width() -> int:
    """Columns every line of the screens fits in: ``COLUMNS`` (a positive number), else the
    terminal's width (stdout's), else :data:`WIDTH`; never less than :data:`MIN_WIDTH`."""
    raw = os.environ.get("COLUMNS", "").strip()
    if raw.isascii() and raw.isdigit() and int(raw) > 0:
        return max(MIN_WIDTH, int(raw))
    return max(MIN_WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)


def count(n: int, noun: str, plural: str = "") -> str:
    """``"1 patch"``, ``"2 patches"``: ``n`` and ``noun`` in the number it takes."""
    if n == 1:
        return f"1 {noun}"
    return f"{n:,} {plural or (noun + 'es' if noun.endswith(('s', 'sh', 'ch', 'x')) else noun + 's')}"


#: The longest reason or item the first screen shows (``--all`` and ``--json`` show the whole record,
#: bounded at its creation by ``text.REASON_CHARS``).
REASON_SHOWN = 300

#: States whose records share one reason worth showing once per group (the rest: per patch).
SHARED_REASON = ("gated", "disabled", "inactive", "pending")

#: Lines of patch names shown per group before "... (N in all)".
NAME_LINES = 2

#: The order of the states in the summary (any other state after these).
ORDER = (
    "applied",
    "would apply",
    "fixed-upstream",
    "yielded",
    "pending",
    "unsupported",
    "superseded",
    "failed",
    "reverted",
    "gated",
    "disabled",
    "inactive",
)


def compact(names: list[str], catalog: list[str]) -> list[str]:
    """``names`` with every family wholly among them written once: ``transformers.* (35)`` when
    each patch of the catalog under ``transformers.`` is in ``names`` (first level, then second)."""
    chosen = set(names)
    items: list[str] = []
    covered: set[str] = set()
    for depth in (1, 2):
        for name in names:
            parts = name.split(".")
            if name in covered or len(parts) <= depth:
                continue
            prefix = ".".join(parts[:depth]) + "."
            family = [n for n in catalog if n.startswith(prefix)]
            if len(family) > 1 and set(family) <= chosen and not covered & set(family):
                items.append(f"{prefix}* ({len(family)})")
                covered |= set(family)
    return items + [n for n in names if n not in covered]


def _names(names: list[str], catalog: list[str], more: str) -> list[str]:
    """The compacted names, wrapped with a 4-space indent, at most :data:`NAME_LINES` lines (all of
    them without ``more``: the full list follows)."""
    lines = wrap(", ".join(compact(names, catalog)), width() - 4)
    if more and len(lines) > NAME_LINES:
        lines = [*lines[:NAME_LINES], f"... ({len(names)} in all: {more})"]
    return ["    " + line for line in lines]


def groups(rows: Iterable[tuple[str, str, str]], catalog: list[str], more: str) -> list[str]:
    """``summary:`` and one block per (state, reason) of ``rows`` = (name, state, reason): the
    states in :data:`ORDER`; reasons shown once for :data:`SHARED_REASON` states. ``more`` is the
    command that lists every name ("": every name is shown)."""
    rows = sorted(rows, key=lambda row: ORDER.index(row[1]) if row[1] in ORDER else len(ORDER))
    counts: dict[str, int] = {}
    for _, state, _ in rows:
        counts[state] = counts.get(state, 0) + 1
    head = f"summary: {count(len(rows), 'patch')}: " + ", ".join(f"{n} {state}" for state, n in counts.items())
    lines = wrap(head, width(), "    ") if rows else ["summary: no patches in the catalog"]
    blocks: dict[tuple[str, str], list[str]] = {}
    for name, state, reason in rows:
        blocks.setdefault((state, cut(reason, REASON_SHOWN) if state in SHARED_REASON else ""), []).append(name)
    for state in counts:
        for (s, reason), names in blocks.items():
            if s == state:
                lines += wrap(f"  {state} ({len(names)})" + (f": {reason}" if reason else ""), width(), "    ")
                lines += _names(names, catalog, more)
    return lines


def attention(items: list[str]) -> list[str]:
    """``needs attention:`` and one wrapped line per item, or that nothing does."""
    if not items:
        return ["nothing needs attention"]
    lines = ["needs attention:"]
    for item in items:
        lines += wrap(f"  {cut(item, REASON_SHOWN)}", width(), "    ")
    return lines


#: The qualname of a trigger: a module whose import runs a patch that changes other places.
TRIGGER = "__file__"


def short_target(target: str) -> str:
    """Targets (``" | "``-separated variants) without their package paths:
    ``modeling_qwen3:Qwen3RMSNorm.forward``; a trigger as its whole module and what it is:
    ``vllm_ascend.patch.worker (import trigger)``."""
    shortened = []
    for one in target.split(" | "):
        module, colon, rest = one.partition(":")
        if rest == TRIGGER:
            shortened.append(f"{module} (import trigger)")
        else:
            shortened.append(f"{module.rsplit('.', 1)[-1]}{colon}{rest}" if colon else one)
    return " | ".join(shortened)


def site(line: str) -> str:
    """A line of what a patch touches as a screen shows it: ``triggered by the import of
    vllm_ascend.patch.worker`` for ``triggered by vllm_ascend.patch.worker:__file__``."""
    head, found, rest = line.partition(":" + TRIGGER)
    if found and head.startswith("triggered by ") and not rest.startswith(("_", ".")):
        return "triggered by the import of " + head.removeprefix("triggered by ") + rest
    return line


def records_list(rows: list[tuple[str, str, str, str]]) -> list[str]:
    """Every record (name, state, target, reason): name, state and short target on one line, the
    reason wrapped below it."""
    name_w = max(len(r[0]) for r in rows)
    state_w = max(len(r[1]) for r in rows)
    lines = [f"{'patch'.ljust(name_w)}  {'state'.ljust(state_w)}  target (why below)"]
    for name, state, target, reason in rows:
        lines += wrap(f"{name.ljust(name_w)}  {state.ljust(state_w)}  {short_target(target)}", width(), "    ")
        if reason:
            lines += wrap("    " + reason, width(), "    ")
    return lines


def indented(text: str, indent: str, columns: int, more: str = "    ") -> list[str]:
    """``text`` escaped and wrapped to ``columns``, every line after ``indent`` (continuations ``more`` further)."""
    return [indent + line for line in wrap(text, max(1, columns - len(indent)), more)]


def say(text: str, indent: str = "") -> None:
    """Print ``text`` wrapped to :func:`width` columns (continuations indented 4 more), escaped."""
    print("\n".join(indented(text, indent, width())))


def show(text: str = "", end: str = "\n") -> None:
    """Print ``text`` as it is laid out, each line's control characters escaped: the one way the
    ``status``, ``list`` and ``doctor`` screens print what they did not wrap themselves."""
    print("\n".join(printable(line) for line in text.split("\n")), end=end)


#: The narrowest summary column ``list`` lays out as a table (narrower: one patch per two lines).
SUMMARY_MIN = 30


def catalog_lines(entries: list[dict[str, Any]], full: bool) -> list[str]:
    """``list``: a table of the patches (name, default, device, the summary cut to fit), or on a
    terminal too narrow for it each patch on two lines; with ``full`` each patch with its groups,
    its whole summary and what it touches, wrapped."""
    columns = width()
    if full:
        lines = []
        for e in entries:
            head = f"{e['name']} ({e['default']}; device {e['device']}; groups {', '.join(e['groups']) or '-'})"
            lines += wrap(head, columns, "    ")
            lines += indented(e["summary"], "    ", columns)
            for line in e["touches"]:
                lines += indented(site(line), "    ", columns, "  ")
        return lines
    rows = [[e["name"], e["default"], e["device"]] for e in entries]
    header = ["patch", "default", "device"]
    room = columns - sum(max(len(printable(row[i])) for row in [header, *rows]) + 2 for i in range(3))
    if room >= SUMMARY_MIN:
        rows = [[*row, one_line(e["summary"], room)] for row, e in zip(rows, entries, strict=True)]
        return table(rows, [*header, "summary"]).split("\n")
    lines = []
    for row, e in zip(rows, entries, strict=True):
        lines += wrap("  ".join(row), columns, "    ")
        lines.append("    " + one_line(e["summary"], columns - 4))
    return lines


def one_line(text: str, columns: int) -> str:
    """``text`` escaped, on one line of at most ``columns`` characters (cut with "...")."""
    shown = " ".join(printable(text).split())
    return shown if len(shown) <= columns else shown[: max(0, columns - 3)].rstrip() + "..."


def fold(line: str, columns: int) -> list[str]:
    """``line`` (escaped already) in pieces of at most ``columns`` characters, nothing dropped: a
    log or table line that wrapping at spaces would change."""
    return [line[i : i + columns] for i in range(0, len(line), columns)] or [""]


#: How long the work runs before a progress line shows: quick runs print none.
PROGRESS_AFTER_S = 1.5


class StatusLine:
    """One line on ``stream``, rewritten in place once the work has run ``delay`` seconds
    (:data:`PROGRESS_AFTER_S` by default), erased by :meth:`clear`: the progress lines of
    ``doctor`` and of ``--ray``."""

    def __init__(self, stream: IO[str], delay: float | None = None) -> None:
        self.stream, self.start, self.shown = stream, time.monotonic(), 0
        self.delay = PROGRESS_AFTER_S if delay is None else delay

    def due(self) -> float | None:
        """How long the work has run, once the line is due; ``None`` before."""
        elapsed = time.monotonic() - self.start
        return elapsed if elapsed >= self.delay else None

    def write(self, line: str) -> None:
        """``line`` in place of the one shown (padded over what is left of it)."""
        self.stream.write("\r" + line.ljust(self.shown))
        self.stream.flush()
        self.shown = len(line)

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * self.shown + "\r")
            self.stream.flush()
            self.shown = 0


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
    control characters escaped first (``engine.text.printable``: what a terminal shows is the text)."""
    import textwrap

    shown = printable(text)
    return textwrap.wrap(shown, width, subsequent_indent=indent, break_long_words=True, break_on_hyphens=False) or [""]
