"""House rules over the package's source: no module past 500 lines (a prompt to check it is one
concept, never a reason to cut a concept in two), and no exception swallowed without a word on why."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "verl_npu_autopatch"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 500
#: Statement kinds a handler that only falls back to a default is made of.
FALLBACKS = (ast.Pass, ast.Continue, ast.Break, ast.Return, ast.Assign, ast.AnnAssign)


def test_no_module_is_over_500_lines() -> None:
    lengths = {str(p.relative_to(PACKAGE)): len(p.read_text(encoding="utf-8").splitlines()) for p in MODULES}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
    assert "patches/ascend_glm52/__init__.py" in lengths and "engine/lifecycle.py" in lengths  # patches/ is walked too


def _default(node: ast.AST | None) -> bool:
    """Whether ``node`` is a fallback value: nothing, a constant, a name or an empty literal."""
    if node is None or isinstance(node, (ast.Constant, ast.Name)):
        return True
    return isinstance(node, (ast.Dict, ast.List, ast.Tuple, ast.Set)) and not any(ast.iter_child_nodes(node))


def _falls_back(handler: ast.ExceptHandler) -> bool:
    """Whether ``handler`` only swallows: ``pass``, ``continue``, ``return None`` / a default,
    ``x = None`` / a default; nothing that reads the exception, logs, raises or does work."""
    return all(isinstance(s, FALLBACKS) and _default(getattr(s, "value", None)) for s in handler.body)


def swallowed(path: Path, root: Path = PACKAGE) -> list[str]:
    """``path:line`` (relative to ``root``) of every ``except`` that only falls back to a default,
    and every ``suppress(...)``, whose line carries no comment saying why."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text)):
        silent = isinstance(node, ast.ExceptHandler) and _falls_back(node)
        silent |= isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "suppress"
        if silent and "#" not in lines[node.lineno - 1]:
            found.append(node.lineno)
    return [f"{path.relative_to(root)}:{line}" for line in sorted(found)]


def test_every_swallowed_exception_says_why() -> None:
    assert [site for path in MODULES for site in swallowed(path)] == []


def test_the_check_finds_each_silent_kind_and_passes_the_explained(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "try:\n    f()\nexcept Exception:\n    pass\n"
        "try:\n    f()\nexcept Exception:  # why\n    pass\n"
        "try:\n    f()\nexcept Exception as exc:\n    record(exc)\n"
        "with contextlib.suppress(OSError):\n    f()\n"
        "try:\n    f()\nexcept KeyError:\n    x = {}\n",
        encoding="utf-8",
    )
    assert swallowed(module, tmp_path) == ["m.py:3", "m.py:13", "m.py:17"]
