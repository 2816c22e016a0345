"""The core's size, as issue 38 measures it: ``src`` without ``patches/`` and ``cli/``, counted with
``wc -l`` (the start-up module once: the wheel's root copy is a symlink to ``bootstrap/startup.py``).

    python3 scripts/core_size.py                    # per module: lines, docstrings, comments, blanks, code
    python3 scripts/core_size.py --at 26b9a2a       # the same cut at a git revision (a flat layout too)
    python3 scripts/core_size.py --spans engine/ownership.py:rebind engine/slots.py:Slots.note

``--spans`` sums the lines of the named definitions (decorators included, plus the blank lines the
formatter puts after them); ``PATH`` alone counts the whole file.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize
from pathlib import Path

PACKAGE = "src/verl_npu_autopatch"
#: What the cut leaves out (the issue's 3,909 left ``__main__`` out too).
OUTSIDE = ("patches", "cli", "__main__.py")
#: Modules outside the cut in the flat layout before the packages (the CLI, doctor and fleet).
FLAT_CLI = {"cli", "doctor", "verify", "fleet", "ray_doctor", "_summary", "_fleet_view", "_fleet_ray", "_doctor_child"}


def core_files(at: str | None) -> dict[str, str]:
    """``{path under the package: text}`` of the cut, from the work tree or revision ``at``."""
    if at is None:
        paths = sorted(str(p.relative_to(PACKAGE)) for p in Path(PACKAGE).rglob("*.py"))
    else:
        listed = _git("ls-tree", "-r", "--name-only", at, PACKAGE).split()
        paths = [p.removeprefix(PACKAGE + "/") for p in listed if p.endswith(".py")]
    kept = [p for p in paths if p.split("/")[0] not in OUTSIDE and p.removesuffix(".py") not in FLAT_CLI]
    if at is None:
        return {path: Path(PACKAGE, path).read_text(encoding="utf-8") for path in kept}
    return {path: _git("show", f"{at}:{PACKAGE}/{path}") for path in kept}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def kinds(text: str) -> dict[str, int]:
    """The file's lines split into docstring, comment, blank and code lines."""
    lines = text.splitlines()
    docs: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    comments = {
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type == tokenize.COMMENT and lines[token.start[0] - 1].lstrip().startswith("#")
    } - docs
    blank = {number for number, line in enumerate(lines, 1) if not line.strip()} - docs
    return {"lines": len(lines), "doc": len(docs), "comment": len(comments), "blank": len(blank),
            "code": len(lines) - len(docs) - len(comments) - len(blank)}  # fmt: skip


def span(text: str, name: str) -> int:
    """Lines of definition ``name`` (``Class.method`` too) in ``text``, with the blank lines after it."""
    body: list[ast.stmt] = ast.parse(text).body
    *owners, last = name.split(".")
    for owner in owners:
        body = next(n.body for n in body if isinstance(n, ast.ClassDef) and n.name == owner)
    for node in body:
        names = [getattr(node, "name", None)]
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [getattr(n, "id", None) for t in targets for n in (t.elts if isinstance(t, ast.Tuple) else [t])]
        if last in names:
            start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            after = 2 if not owners and isinstance(node, (ast.FunctionDef, ast.ClassDef)) else 1
            return (node.end_lineno or node.lineno) - start + 1 + after
    raise LookupError(f"no definition {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--at", help="a git revision (default: the work tree)")
    parser.add_argument("--spans", nargs="+", metavar="PATH[:NAME]", help="sum these definitions' lines")
    args = parser.parse_args()
    files = core_files(args.at)
    if args.spans:
        total = 0
        for item in args.spans:
            path, _, name = item.partition(":")
            total += span(files[path], name) if name else files[path].count("\n")
        print(total)
        return
    totals = dict.fromkeys(("lines", "doc", "comment", "blank", "code"), 0)
    for path, text in files.items():
        found = kinds(text)
        totals = {key: totals[key] + found[key] for key in totals}
        print(f"{path:40} " + " ".join(f"{key} {value:5,}" for key, value in found.items()))
    print(f"{f'{len(files)} modules':40} " + " ".join(f"{key} {value:5,}" for key, value in totals.items()))


if __name__ == "__main__":
    main()
