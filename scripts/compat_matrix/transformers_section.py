"""The transformers section: each kernel patch's live ``check`` on the classes of a release's
modeling module, compiled from its source without running any of it.
"""

from __future__ import annotations

import ast
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compat_matrix.fetch import Artifact, extract
from compat_matrix.table import STATE_TEXT, Cell, Rows, Section

# ----------------------------------------------------------------------------- section: transformers
TRANSFORMERS_VERSIONS = ("4.57.6", "5.9.0", "5.24.0", "5.25.0")


def _transformers_files() -> tuple[str, ...]:
    from verl_npu_autopatch.patches import transformers_npu

    return tuple(f"transformers/models/{f}/modeling_{f}.py" for f in transformers_npu.MODELS)


def _definitions_only(
    path: Path, name: str, sibling: Callable[[str], types.ModuleType | None] = lambda family: None
) -> types.ModuleType:
    """Module ``name`` holding the classes (methods only) and functions of the file at ``path``,
    compiled with the file's name and line numbers so ``inspect`` reads the real release text.
    Nothing of the release runs: decorators, bases, annotations and defaults are dropped (the live
    probes read parameter names and source only), except what a decorator changes about what runs:
    a function decorated with ``@use_kernel_forward_from_hub("<layer>")`` (transformers 5.25's
    ``apply_rotary_pos_emb``) is, at run time, a ``kernels`` hub layer instance calling it, so it
    becomes :func:`hub_layer` of it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hub_layers = {
        node.name: layer for node in tree.body if isinstance(node, ast.FunctionDef) and (layer := _hub_layer_name(node))
    }

    def strip(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.stmt:
        keep: list[ast.expr] = [
            d for d in fn.decorator_list if isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod")
        ]
        fn.decorator_list, fn.returns = keep, None
        args = fn.args
        for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
            if a is not None:
                a.annotation = None
        args.defaults = [ast.Constant(None) for _ in args.defaults]
        args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
        return fn

    body: list[ast.stmt] = []
    imported: dict[str, tuple[str, str]] = {}  # name -> (family, name there), ``from ..x.modeling_x import``
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module and node.module.count(".") == 1:
            family, leaf = node.module.split(".")
            if leaf == f"modeling_{family}":
                imported.update({a.asname or a.name: (family, a.name) for a in node.names})
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body.append(strip(node))
        elif isinstance(node, ast.ClassDef):
            methods = [strip(n) for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            node.body = methods or [ast.Pass(lineno=node.lineno, col_offset=0)]
            node.bases, node.keywords, node.decorator_list = [], [], []
            body.append(node)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module  # inspect finds a class's file through sys.modules
    code = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    exec(compile(code, str(path), "exec"), module.__dict__)
    for function, layer in hub_layers.items():
        module.__dict__[function] = hub_layer(module.__dict__[function], layer)
    for local, (family, there) in imported.items():  # e.g. qwen2_5_vl (4.57) uses qwen2's RMSNorm
        source = sibling(family)
        if source is not None and hasattr(source, there) and local not in module.__dict__:
            setattr(module, local, getattr(source, there))
    return module


def _hub_layer_name(fn: ast.FunctionDef) -> str | None:
    """``<layer>`` of a ``@use_kernel_forward_from_hub("<layer>")`` decorator on ``fn``, else ``None``."""
    for decorator in fn.decorator_list:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "use_kernel_forward_from_hub":
            first = decorator.args[0] if decorator.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                return first.value
    return None


def hub_layer(func: Callable[..., Any], layer: str) -> Any:
    """A stand-in for the ``kernels`` hub layer ``@use_kernel_forward_from_hub(layer)`` makes of
    ``func``: an instance with ``forward(*args, **kwargs)`` calling ``func`` (the probes unwrap
    it as they unwrap the real one), its class naming ``kernel_layer_name``."""

    class HubFunctionLayer:
        kernel_layer_name = layer

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return func(*args, **kwargs)

        __call__ = forward

    return HubFunctionLayer()


def transformers_cell(patch: Any, module: types.ModuleType | None, versions: dict[str, str]) -> Cell:
    """The live ``check`` of ``patch`` on the release's classes; variants in order, the first that
    applies wins (the engine's variant fallback), else the first found decides."""
    import inspect

    from verl_npu_autopatch.authoring.spec import Site

    if module is None:
        return "absent", f"no {patch.targets[0].module} in this release"
    first: Cell | None = None
    for target in patch.targets:
        owner: Any = module
        *path, attribute = target.qualname.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        value = inspect.getattr_static(owner, attribute, None) if owner is not None else None
        if value is None:
            continue
        verdict = patch.check(Site(patch, target, module, owner, attribute, value, dict(versions)))
        layer = getattr(type(value), "kernel_layer_name", None)
        hub = f" (a kernels hub layer {layer!r} where `kernels` is installed)" if layer else ""
        where = target.qualname + hub
        cell = ("applies", f"on {where}") if verdict.action == "apply" else (verdict.action, verdict.reason)
        if cell[0] == "applies":
            return cell
        first = first or cell
    if first is None:
        return "unsupported", "expected " + " or ".join(t.qualname for t in patch.targets) + "; found none"
    return first


def _transformers_tree(artifact: Artifact, cache: Path) -> dict[str, Any]:
    root = extract(artifact, _transformers_files(), cache)
    return {"root": root, "version": artifact.version}


def _transformers_rows(trees: dict[str, Any]) -> Rows:
    from verl_npu_autopatch.patches import transformers_deepstack, transformers_npu

    rows: Rows = []
    loaded: dict[tuple[str, str], types.ModuleType | None] = {}

    def load(label: str, family: str) -> types.ModuleType | None:
        key = (label, family)
        if key not in loaded:
            loaded[key] = None
            path = trees[label]["root"] / f"transformers/models/{family}/modeling_{family}.py"
            name = f"_compat_transformers_{label.replace('.', '_')}_{family}"
            if path.is_file():
                loaded[key] = _definitions_only(path, name, lambda other: load(label, other))
        return loaded[key]

    for patch in [*transformers_npu.PATCHES, *transformers_deepstack.PATCHES]:
        family = patch.name.split(".")[1]
        cells = {}
        for label, tree in trees.items():
            cells[label] = transformers_cell(patch, load(label, family), {"transformers": tree["version"]})
        rows.append((patch.name, "", cells))
    for name in [n for n in sys.modules if n.startswith("_compat_transformers_")]:
        del sys.modules[name]
    return rows


def _transformers_artifact(version: str) -> Artifact:
    return Artifact("transformers", version, f"transformers-{version}-py3-none-any.whl")


TRANSFORMERS = Section(
    title="transformers",
    project="transformers",
    intro=(
        "Each (family x kernel) patch's own live `check` (`transformers_npu.probe`; for the Qwen3-VL",
        "`deepstack_clone` rows, `transformers_deepstack.deepstack_rule`), run on the classes",
        "and functions of the real modeling module of each release: the wheel's source is compiled with",
        "its own file name and line numbers, without decorators, bases, annotations or defaults, so",
        "nothing of it runs. Variants are tried in order; the first that applies wins. Proven by running:",
        "`tests/hf` on the `hf`, `hf-5.9`, `hf-4.57` and `hf-5.25` envs (transformers 5.24.0, 5.9.0, 4.57.6,",
        "5.25.0: every release of the table), where `test_table_matches_live_checks.py` asserts that the",
        "live checks and every record of a live engine on the imported modules equal the installed",
        "release's column. A decorator that changes what runs is read: `@use_kernel_forward_from_hub` on",
        "a function (5.25.0's `apply_rotary_pos_emb`) makes it a kernels hub layer, which the probes unwrap.",
    ),
    columns=tuple(_transformers_artifact(v) for v in TRANSFORMERS_VERSIONS),
    tree=_transformers_tree,
    rows_of=_transformers_rows,
    states=STATE_TEXT,
    prefer=("py3-none-any.whl",),
)
