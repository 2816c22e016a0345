"""The first screen of ``status`` and ``doctor``: how many patches are in each state, each group
with its one reason and its patches named compactly (``transformers.* (35)``), and what needs
attention; every line fits :data:`WIDTH` columns. The full table is behind ``--all``."""

from __future__ import annotations

from collections.abc import Iterable

from verl_npu_autopatch._text import cut, printable
from verl_npu_autopatch.records import wrap

#: Columns every line of ``status`` and ``doctor`` fits in.
WIDTH = 120

#: The longest reason or item the first screen shows (``--all`` and ``--json`` show the whole record,
#: bounded at its creation by ``_text.REASON_CHARS``).
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
    """The compacted names, wrapped with a 4-space indent, at most :data:`NAME_LINES` lines."""
    lines = wrap(", ".join(compact(names, catalog)), WIDTH - 4)
    if len(lines) > NAME_LINES:
        lines = [*lines[:NAME_LINES], f"... ({len(names)} in all: {more})"]
    return ["    " + line for line in lines]


def groups(rows: Iterable[tuple[str, str, str]], catalog: list[str], more: str) -> list[str]:
    """``summary:`` and one block per (state, reason) of ``rows`` = (name, state, reason): the
    states in :data:`ORDER`; reasons shown once for :data:`SHARED_REASON` states."""
    rows = sorted(rows, key=lambda row: ORDER.index(row[1]) if row[1] in ORDER else len(ORDER))
    counts: dict[str, int] = {}
    for _, state, _ in rows:
        counts[state] = counts.get(state, 0) + 1
    head = f"summary: {len(rows)} patches: " + ", ".join(f"{n} {state}" for state, n in counts.items())
    lines = wrap(head, WIDTH) if rows else ["summary: no patches in the catalog"]
    blocks: dict[tuple[str, str], list[str]] = {}
    for name, state, reason in rows:
        blocks.setdefault((state, cut(reason, REASON_SHOWN) if state in SHARED_REASON else ""), []).append(name)
    for state in counts:
        for (s, reason), names in blocks.items():
            if s == state:
                lines += wrap(f"  {state} ({len(names)})" + (f": {reason}" if reason else ""), WIDTH, "    ")
                lines += _names(names, catalog, more)
    return lines


def attention(items: list[str]) -> list[str]:
    """``needs attention:`` and one wrapped line per item, or that nothing does."""
    if not items:
        return ["nothing needs attention"]
    lines = ["needs attention:"]
    for item in items:
        lines += wrap(f"  {cut(item, REASON_SHOWN)}", WIDTH, "    ")
    return lines


def short_target(target: str) -> str:
    """Targets (``" | "``-separated variants) without their package paths:
    ``modeling_qwen3:Qwen3RMSNorm.forward``."""
    shortened = []
    for one in target.split(" | "):
        module, colon, rest = one.partition(":")
        shortened.append(f"{module.rsplit('.', 1)[-1]}{colon}{rest}" if colon else one)
    return " | ".join(shortened)


def records_list(rows: list[tuple[str, str, str, str]]) -> list[str]:
    """Every record (name, state, target, reason): name, state and short target on one line, the
    reason wrapped below it."""
    name_w = max(len(r[0]) for r in rows)
    state_w = max(len(r[1]) for r in rows)
    lines = [f"{'patch'.ljust(name_w)}  {'state'.ljust(state_w)}  target (why below)"]
    for name, state, target, reason in rows:
        lines += wrap(f"{name.ljust(name_w)}  {state.ljust(state_w)}  {short_target(target)}", WIDTH, "    ")
        if reason:
            lines += wrap("    " + reason, WIDTH, "    ")
    return lines


def say(text: str, indent: str = "") -> None:
    """Print ``text`` wrapped to :data:`WIDTH` columns (continuations indented 4 more), escaped."""
    print("\n".join(wrap(indent + text, WIDTH, indent + "    ")))


def show(text: str = "", end: str = "\n") -> None:
    """Print ``text`` as it is laid out, each line's control characters escaped: the one way the
    ``status``, ``list`` and ``doctor`` screens print what they did not wrap themselves."""
    print("\n".join(printable(line) for line in text.split("\n")), end=end)
