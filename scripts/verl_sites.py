"""verl's NPU runtime patch sites, read from a release's source with ``ast`` (nothing runs).

A *site* is an assignment to another package's attribute under an NPU guard, the pattern of every
runtime fix verl carries for Ascend (``docs/verl.md``, "Parity with verl"):

- the receiver is another package's name (an import that is not ``verl``), or a local / parameter
  (``ascend_rms_norm.forward_oot = patched``) when the value is a function verl defines (or a
  ``staticmethod`` / ``classmethod`` of one); ``self`` and ``cls`` never are;
- ``setattr(receiver, "name", value)`` counts like ``receiver.name = value``;
- the guard is an ``if`` / ``while`` test, an enclosing function's name or the file's name with
  ``npu`` as a word part (``is_npu_available``, ``torch.npu``, ``apply_npu_patches``,
  ``npu_patch.py``; not ``input_ids``).

:func:`unlisted` compares the sites with the parity table: a site is listed only when a row of its
file names its target exactly: a backticked name in the row's target cell (``module:Class.attr``
read as ``module.Class.attr``), alone or after a module the same cell names in backticks
(``transformers.models.qwen3.modeling_qwen3`` … ``apply_rotary_pos_emb``). A row naming only the
attribute does not list a new site of the same name (a Qwen3-Omni ``apply_rotary_pos_emb``, another
``NPUWorker.wake_up`` assignment).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

WRAPPERS = ("staticmethod", "classmethod")


@dataclass(frozen=True)
class Site:
    """One assignment: ``file`` (``verl/...py``), ``target`` (resolved dotted name where the
    receiver is an import, else the receiver's text), ``attribute``, ``line``, ``guard``."""

    file: str
    target: str
    attribute: str
    line: int
    guard: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.target} (under {self.guard})"


def npu_word(text: str) -> bool:
    """Whether ``text`` has ``npu`` as one of its word parts (split at non-letters, ``_``, ``.``)."""
    return "npu" in re.split(r"[^a-z0-9]+", text.lower())


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name → the dotted name it was imported as, for every import in the file."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _defined(tree: ast.Module) -> set[str]:
    """Names of every function the file defines (at any depth)."""
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def file_sites(source: str, file: str) -> list[Site]:
    """The patch sites of one verl file."""
    tree = ast.parse(source)
    imports, functions = _imports(tree), _defined(tree)
    found: list[Site] = []

    def receiver(expr: ast.expr, value: ast.expr) -> str | None:
        text = ast.unparse(expr)
        head = text.split(".")[0]
        if head in ("self", "cls"):
            return None
        if head in imports:
            dotted = imports[head]
            return None if dotted.split(".")[0] == "verl" else dotted + text[len(head) :]
        if isinstance(value, ast.Call) and ast.unparse(value.func) in WRAPPERS and value.args:
            value = value.args[0]
        return text if isinstance(value, ast.Name) and value.id in functions else None

    def record(node: ast.stmt, expr: ast.expr, attribute: str, value: ast.expr, guard: tuple[str, ...]) -> None:
        target = receiver(expr, value)
        if target and guard:
            found.append(Site(file, f"{target}.{attribute}", attribute, node.lineno, guard[-1]))

    def walk(body: list[ast.stmt], guard: tuple[str, ...]) -> None:
        for node in body:
            if isinstance(node, (ast.If, ast.While)):
                test = ast.unparse(node.test)
                walk(node.body, (*guard, test) if npu_word(test) else guard)
                walk(node.orelse, guard)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(node.body, (*guard, f"def {node.name}") if npu_word(node.name) else guard)
            elif isinstance(node, ast.Try):
                for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    walk(part, guard)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)):
                walk(node.body, guard)
                walk(getattr(node, "orelse", []), guard)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute):
                        record(node, target.value, target.attr, node.value, guard)
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                call = node.value
                name = call.args[1] if len(call.args) == 3 else None
                if (
                    ast.unparse(call.func) == "setattr"
                    and isinstance(name, ast.Constant)
                    and isinstance(name.value, str)
                ):
                    record(node, call.args[0], name.value, call.args[2], guard)

    walk(tree.body, (f"file {Path(file).name}",) if npu_word(Path(file).name) else ())
    return found


def sites(root: Path) -> list[Site]:
    """Every patch site under ``root/verl`` (an extracted release), by file and line."""
    found = []
    for path in sorted((root / "verl").rglob("*.py")):
        found += file_sites(path.read_text(encoding="utf-8"), path.relative_to(root).as_posix())
    return found


def parity_rows(markdown: str, heading: str) -> list[tuple[list[str], str]]:
    """``[(verl files, target cell)]`` of the numbered rows under ``heading`` in ``docs/verl.md``."""
    section = markdown.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if re.match(r"\| \d+ \|", line):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows.append((re.findall(r"`(verl/[^`]+\.py)`", cells[1]), cells[2]))
    return rows


_MODULE = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+")


def named(cell: str) -> set[str]:
    """The exact dotted names a parity row's target cell names: each backticked name (``:`` read as
    ``.``), and each one after every backticked module of the cell."""
    items = [item.replace(":", ".") for item in re.findall(r"`([^`]+)`", cell)]
    modules = [item for item in items if _MODULE.fullmatch(item)]
    return set(items) | {f"{module}.{item}" for module in modules for item in items if item != module}


def row_of(site: Site, rows: list[tuple[list[str], str]]) -> int | None:
    """The number (from 1) of the parity row of ``site``'s file that names its target exactly
    (:func:`named`), or ``None``."""
    for number, (files, target) in enumerate(rows, 1):
        if site.file in files and site.target in named(target):
            return number
    return None


def listed(site: Site, rows: list[tuple[list[str], str]]) -> bool:
    """Whether a parity row names ``site`` (:func:`row_of`)."""
    return row_of(site, rows) is not None


def unlisted(found: list[Site], rows: list[tuple[list[str], str]]) -> list[Site]:
    """The sites no parity row names."""
    return [s for s in found if not listed(s, rows)]
