"""What every section shares: the files the static rules read, a patch's cell on one release
(gates, then its static rule), a :class:`Section` (one upstream's columns, rows and text), and the
drift of a newer release against a section's newest column.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compat_matrix import fetch
from compat_matrix.fetch import CACHE, Artifact

#: Release files the tests read from the same extracted trees, besides those the rules read
#: (``tests/ascend/test_sfa.py`` loads ``utils.py`` and ``indexer_kpool.py``).
TEST_FILES = (
    "vllm_ascend/utils.py",
    "vllm_ascend/attention/indexer_kpool.py",
    "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py",
)


def read_files(top: str) -> tuple[str, ...]:
    """Every upstream file under package ``top`` a built-in patch's static rules declare they read
    (``StaticRule.reads``, its ``also`` rules' included), plus the :data:`TEST_FILES` there, in
    catalog order."""
    from verl_npu_autopatch.engine import catalog

    declared = [f for p in catalog.builtin() if p.static for rule in p.static.rules() for f in rule.reads]
    return tuple(dict.fromkeys(f for f in (*declared, *TEST_FILES) if f.split("/")[0] == top))


Cell = tuple[str, str]  # (state, reason)
Rows = list[tuple[str, str, dict[str, Cell]]]  # [(row name, groups, {column label: cell})]


def static_patches(prefixes: tuple[str, ...] = ("",)) -> list[Any]:
    """Built-in patches with a static rule (``Patch.static``) whose family module's name starts
    with ``prefixes``, in catalog order."""
    from verl_npu_autopatch.engine import catalog

    families = [m for m in catalog.families() if m.__name__.rpartition(".")[2].startswith(prefixes)]
    return [p for m in families for p in m.PATCHES if p.static is not None]


def gate(patch: Any, versions: dict[str, str]) -> str | None:
    """Why ``patch`` is gated for a release with these distribution versions, or ``None``: the
    engine's own gate rule (``decision.first_failure``), fed the release's versions."""
    from verl_npu_autopatch.engine.decision import first_failure

    def version_of(name: str) -> str | None:
        return versions.get(name.lower().replace("_", "-"))

    reason = first_failure(patch.requires, {}, version_of)
    if reason:
        return reason
    reasons = [first_failure(target.requires, {}, version_of) for target in patch.hooks]
    return None if any(not r for r in reasons) else "; ".join(r for r in reasons if r)


def decide(patch: Any, tree: Any, rule: Any = None) -> Cell:
    """``(state, reason)`` of one patch on one release: gates first, then its static rule (``rule``,
    by default ``patch.static``); the rule's ``note`` adds what a user needs to know about the
    release whatever the state."""
    rule = rule or patch.static
    reason = gate(patch, tree.versions)
    if reason:
        state = "gated"
    else:
        verdict = rule.decide(tree)
        state, reason = ("applies" if verdict.action == "apply" else verdict.action), verdict.reason
    extra = rule.note(tree) if rule.note else None
    return state, "; ".join(r for r in (reason, extra) if r)


def static_rows(patches: list[Any], trees: dict[str, Any], rule_of: Callable[[Any], Any] | None = None) -> Rows:
    """Rows of ``patches`` (each with a static rule) over ``trees`` (label → tree); ``rule_of(patch)``
    picks which of its rules decides (default: ``patch.static``)."""
    rows = []
    for patch in patches:
        rule = rule_of(patch) if rule_of else None
        cells = {label: decide(patch, tree, rule) for label, tree in trees.items()}
        rows.append((patch.name, ", ".join(patch.groups), cells))
    return rows


@dataclass
class Section:
    """One upstream's part of the document: its columns (releases), how to compute them, its text.

    ``project`` is the PyPI name ``--latest`` asks about; ``artifact(version)`` names the file of a
    release not in ``columns``; ``column(artifact)`` computes one column's cells (row → cell)."""

    title: str
    project: str
    intro: tuple[str, ...]
    columns: tuple[Artifact, ...]
    tree: Callable[[Artifact, Path], Any]
    rows_of: Callable[[dict[str, Any]], Rows]
    states: tuple[str, ...]
    prefer: tuple[str, ...] = ()
    label_of: Callable[[Artifact], str] = lambda a: a.version
    describe: Callable[[Artifact], str] = lambda a: "sdist" if a.sdist else "wheel"

    def compute(self, cache: Path = CACHE, columns: tuple[Artifact, ...] | None = None) -> Rows:
        trees = {self.label_of(a): self.tree(a, cache) for a in columns or self.columns}
        return self.rows_of(trees)

    def artifact(self, version: str) -> Artifact:
        return fetch.index_artifact(self.project, version, self.prefer)

    def drift(self, version: str, cache: Path = CACHE) -> list[str]:
        """Cells of release ``version`` that differ from the newest column (:func:`drift`)."""
        return drift(self, version, cache)

    def render(self, rows: Rows) -> list[str]:
        labels = [self.label_of(a) for a in self.columns]
        lines = [f"## {self.title}", "", *self.intro, ""]
        lines += [
            "| patch | " + " | ".join(labels) + " |",
            "|---|" + "---|" * len(labels),
            "| artifact | " + " | ".join(self.describe(a) for a in self.columns) + " |",
        ]
        for name, _groups, cells in rows:
            lines.append(f"| `{name}` | " + " | ".join(cells[label][0] for label in labels) + " |")
        lines += ["", *self.states, "", f"### Reasons ({self.title})", ""]
        for name, groups, cells in rows:
            lines.append(f"#### `{name}`" + (f" (groups: {groups})" if groups else ""))
            lines.append("")
            for label in labels:
                state, reason = cells[label]
                lines.append(f"- {label}: {state}" + (f" — {reason}" if reason else ""))
            lines.append("")
        return lines


STATE_TEXT = (
    "States: **applies** (the check passes; the fix would be installed), **fixed-upstream** (the",
    "release already has the fix), **unsupported** (the code differs from what the fix was written",
    "for; recorded, and raised in strict mode), **gated** (the patch's version requirement excludes",
    "the release), **absent** (the release has no such module: the patch stays pending, costs nothing).",
)


def drift(section: Section, version: str, cache: Path = CACHE) -> list[str]:
    """Readable differences between ``version``'s column and ``section``'s newest column (empty
    when they agree; a cell whose state changed, or a row that appeared)."""
    newest = section.columns[-1]
    if version == newest.version:
        return []
    candidate = section.artifact(version)
    label = section.label_of(candidate)
    before = {name: cells[section.label_of(newest)] for name, _, cells in section.compute(cache, (newest,))}
    after = {name: cells[label] for name, _, cells in section.compute(cache, (candidate,))}
    lines = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name, ("(none)", "")), after.get(name, ("(none)", ""))
        if old[0] != new[0]:
            lines.append(
                f"{section.title} {section.label_of(newest)} -> {label}: `{name}`: {old[0]} -> {new[0]}"
                + (f" ({new[1]})" if new[1] else "")
            )
    return lines
