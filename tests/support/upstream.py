"""Load real upstream code from the downloaded releases (``scripts/compat-matrix`` cache).

Three ways, all executing the release's own code:

- :func:`load_file` runs a whole upstream file as its real module name, after the test put
  doubles for its imports into ``sys.modules`` (used for ``layernorm.py`` and ``camem.py``);
- :func:`load_imports` runs only a file's ``from ... import`` statements of chosen modules (the
  copies a vLLM model module takes);
- :func:`load_subset` runs only chosen classes (and in them only chosen methods) and top-level
  functions of a file whose imports are far too heavy for a CPU host (``sfa_v1.py``, vLLM's
  ``core.py``). The code keeps the release's file name and line numbers, so ``inspect.getsource``
  (and with it every patch's fingerprint check) reads the real release file.
"""

from __future__ import annotations

import ast
import importlib.util
import types
from pathlib import Path
from typing import Any

from tests.support.matrix import matrix_script  # noqa: F401  (re-exported: the suites share one loader)


def load_file(path: Path, name: str) -> types.ModuleType:
    """Execute the upstream file ``path`` as module ``name`` (not added to ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Function definitions a subset keeps (``async def`` methods too).
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _builtin_decorator(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("staticmethod", "classmethod")


def load_subset(
    path: Path,
    name: str,
    classes: dict[str, tuple[str, ...]],
    functions: tuple[str, ...] = (),
    namespace: dict[str, Any] | None = None,
) -> types.ModuleType:
    """Module ``name`` holding only ``classes`` (class → kept methods; bases kept when they are
    classes of this subset, else dropped; decorators dropped) and top-level ``functions`` of
    ``path``, executed with ``namespace`` as the globals the file would have imported."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            node.decorator_list = []
            body.append(node)
        elif isinstance(node, ast.ClassDef) and node.name in classes:
            keep = classes[node.name]
            node.body = [item for item in node.body if isinstance(item, DEFS) and item.name in keep] or [
                ast.Pass(lineno=node.lineno, col_offset=0)
            ]
            for item in node.body:
                if isinstance(item, DEFS):  # keep @staticmethod / @classmethod only
                    item.decorator_list = [d for d in item.decorator_list if _builtin_decorator(d)]
            node.bases = [b for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
            node.keywords, node.decorator_list = [], []
            body.append(node)
    missing = set(classes) | set(functions)
    missing -= {n.name for n in body}
    if missing:
        raise LookupError(f"{path} defines none of {sorted(missing)}")
    module = types.ModuleType(name)
    module.__file__ = str(path)
    module.__dict__.update(namespace or {})
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec")
    exec(code, module.__dict__)
    return module


def load_imports(path: Path, name: str, sources: tuple[str, ...]) -> types.ModuleType:
    """Module ``name`` (not added to ``sys.modules``) that ran only the top-level ``from M import ...``
    statements of ``path`` for ``M`` in ``sources``: the release's own copies of those names, taken
    from whatever ``sys.modules`` holds under ``M`` (a model module of vLLM, its heavy rest left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module in sources and not n.level]
    if not body:
        raise LookupError(f"{path} has no top-level import from {sources}")
    module = types.ModuleType(name)
    module.__file__ = str(path)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), module.__dict__)
    return module


def run_engine(patches: list[Any], **env: str) -> Any:
    """A fresh, activated ``Engine`` over ``patches`` with the device forced to NPU and the
    configuration read from ``env`` (variable name → value) by the real config parser."""
    from verl_npu_autopatch.engine.config import read_config
    from verl_npu_autopatch.engine.lifecycle import Engine

    engine = Engine(list(patches), read_config({"VERL_NPU_AUTOPATCH_DEVICE": "npu", **env}))
    engine.activate()
    return engine
