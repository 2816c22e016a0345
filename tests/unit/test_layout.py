"""The package's layout: the start-up module is stdlib only and light, every import points down
(no package module imports the package root), and the public face is marked."""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import verl_npu_autopatch
from tests.support.children import ROOT

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "verl_npu_autopatch"
STARTUP = PACKAGE / "bootstrap" / "startup.py"


def imports(path: Path, with_type_checking: bool = True) -> list[tuple[str, tuple[str, ...]]]:
    """``(module, names)`` of every import statement in ``path`` (``names`` empty for ``import x``);
    without ``with_type_checking``, those in ``if TYPE_CHECKING:`` blocks (never run) are left out."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = set() if with_type_checking else {id(n) for n in _type_checking_nodes(tree)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, tuple(alias.name for alias in node.names)))
    return found


def test_no_package_module_imports_the_package_root() -> None:
    submodules = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, names in imports(path):
            if module == "verl_npu_autopatch" and (not names or set(names) - submodules):
                offenders.append(f"{path.relative_to(SRC)}: from verl_npu_autopatch import {', '.join(names) or '*'}")
    assert offenders == []
    face = [m for m, _ in imports(PACKAGE / "__init__.py", with_type_checking=False) if m != "__future__"]
    assert face == ["importlib"]  # the face imports lazily
    # a type checker sees the real names, imported only under TYPE_CHECKING (False at run time)
    typed = {
        name for m, names in imports(PACKAGE / "__init__.py") if m.startswith("verl_npu_autopatch") for name in names
    }
    assert set(verl_npu_autopatch.__all__) <= typed


def test_the_startup_module_imports_only_what_python_c_pass_has_loaded() -> None:
    loaded = set(
        json.loads(
            subprocess.run(
                [sys.executable, "-I", "-c", "import sys, json; print(json.dumps(sorted(sys.modules)))"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
    )
    tops = {module.partition(".")[0] for module, _ in imports(STARTUP, with_type_checking=False)}
    package_imports = {m for m in tops if m == "verl_npu_autopatch"}  # inside the loader, at the first watched import
    assert tops - package_imports <= loaded
    assert tops - package_imports == {"_thread", "os", "sys"}


def test_the_startup_module_imports_only_what_every_interpreter_has_loaded() -> None:
    # the placeholder imports it holding the global import lock: a module import there must not
    # import anything new (whose module lock another thread could hold)
    tree = ast.parse(STARTUP.read_text(encoding="utf-8"))
    imported = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert imported == {"_thread", "os", "sys"}


def test_the_public_face_resolves_every_name_it_lists() -> None:
    from verl_npu_autopatch.authoring import patching, spec
    from verl_npu_autopatch.engine import lifecycle as engine

    assert verl_npu_autopatch.activate is engine.activate
    assert verl_npu_autopatch.PatchError is engine.PatchError
    assert verl_npu_autopatch.Patch is spec.Patch and verl_npu_autopatch.APPLY is spec.APPLY
    assert verl_npu_autopatch.authoring.patching is patching
    for name in verl_npu_autopatch.__all__:
        assert getattr(verl_npu_autopatch, name) is not None
    assert set(verl_npu_autopatch.__all__) <= set(dir(verl_npu_autopatch))
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == {"__init__", "__main__", "_version", "spec", "patching", "handover"}  # at most 8 top-level modules
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == {"authoring", "bootstrap", "cli", "engine", "patches"}


def test_one_device_decision_and_one_on_off_parser() -> None:
    from verl_npu_autopatch.bootstrap import activation, startup
    from verl_npu_autopatch.engine import config, decision, environment

    chosen = config.read_config({"VERL_NPU_AUTOPATCH_DEVICE": "none"})
    assert environment.device_decision(chosen) == ("none", "VERL_NPU_AUTOPATCH_DEVICE=none")
    off = config.read_config({"VERL_NPU_AUTOPATCH": " Disabled "})
    assert (off.enabled, off.warnings) == (False, ())
    assert environment.device_decision(off)[1] == "switched off by VERL_NPU_AUTOPATCH"
    assert (startup.flag(" OFF "), startup.flag("Yes"), startup.flag("maybe")) == (False, True, None)

    assert activation.device_decision is environment.device_decision  # the inactive decision is the same one
    assert not hasattr(decision, "device_decision") and not hasattr(config, "FALSE")
    assert config.flag is startup.flag


def _map_rows() -> list[set[str]]:
    """The modules of each row of docs/internals.md's "Where things live" table, top row first, by
    path in the package (``cli/main``)."""
    text = (SRC.parent / "docs" / "internals.md").read_text(encoding="utf-8")
    table = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    rows: list[set[str]] = []
    for line in table.splitlines():
        if not line.startswith("| ") or line.startswith("| layer"):
            continue
        layer, modules = line.split("|")[1:3]
        if layer.strip():
            rows.append(set())
        rows[-1] |= {
            token.removesuffix(".py")
            for token in modules.split("`")[1::2]
            if token.endswith(".py") and "*" not in token
        }
    return rows


def _type_checking_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node inside an ``if TYPE_CHECKING:`` block of ``tree``."""
    return [
        n
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for n in ast.walk(node)
    ]


def _package_imports(path: Path) -> set[str]:
    """The package's own modules ``path`` imports (as ``cli/main``), TYPE_CHECKING blocks left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(n) for n in _type_checking_nodes(tree)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        if node.module.startswith("verl_npu_autopatch."):
            module = node.module.removeprefix("verl_npu_autopatch.").replace(".", "/")
            found |= {module, *(f"{module}/{alias.name}" for alias in node.names)}
    return found


def _mapped_modules() -> set[str]:
    """Every module of the package outside ``patches/`` but the package files, as ``cli/main``."""
    found = {str(p.relative_to(PACKAGE).with_suffix("")) for p in PACKAGE.rglob("*.py")}
    return {m for m in found if not m.startswith("patches/") and m.rpartition("/")[2] not in ("__init__", "__main__")}


def test_the_where_things_live_map_names_every_module_and_imports_point_down_it() -> None:
    rows = _map_rows()
    listed = set().union(*rows)
    modules = _mapped_modules() - {"_version"}
    assert modules - listed == set(), "docs/internals.md 'Where things live' misses modules"
    assert listed - modules == set(), "docs/internals.md 'Where things live' names modules that are gone"
    row_of = {name: i for i, row in enumerate(rows) for name in row}
    upward = [
        f"{module} -> {imported}"
        for module in sorted(modules)
        for imported in sorted(_package_imports(PACKAGE / f"{module}.py") & set(row_of))
        if row_of[imported] < row_of[module]
    ]
    assert upward == []


def test_the_map_names_every_patches_helper() -> None:
    text = (SRC.parent / "docs" / "internals.md").read_text(encoding="utf-8").split("## Where things live", 1)[1]
    helpers = {p.stem for p in (PACKAGE / "patches").glob("_*.py")} - {"__init__"}
    helpers |= {p.stem for p in (PACKAGE / "patches").glob("*/*.py")} - {"__init__"}  # a subpackage family's modules
    assert {"_verl", "rules", "kernels", "verify_cases"} <= helpers
    assert {h for h in helpers if f"`{h}`" not in text and f"`{h}.py`" not in text} == set()


def test_a_plainly_inactive_host_is_inactive_by_the_one_device_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    # the start-up module's loader decides "inactive" alone only where the configuration could not
    # say otherwise; every such environment is inactive by activation.inactive_here as well
    from verl_npu_autopatch.bootstrap import activation, startup
    from verl_npu_autopatch.engine import config

    assert {*startup.DECIDING, *startup.SWITCHES} == set(config.VARIABLES) - {
        "VERL_NPU_AUTOPATCH_ENABLE",
        "VERL_NPU_AUTOPATCH_DISABLE",
        # where an active engine writes its report, and the files' mode: no say in the decision; they
        # warn (a relative path, a mode not understood) only where an engine could write, never here
        "VERL_NPU_AUTOPATCH_REPORT_DIR",
        "VERL_NPU_AUTOPATCH_REPORT_MODE",
    }  # a new variable must be placed: does it change the decision, or warn?
    values = {
        "VERL_NPU_AUTOPATCH": (None, " ", "1", "Off", "maybe"),
        "VERL_NPU_AUTOPATCH_DEVICE": (None, "auto", "npu", "none", "gpu"),
        "VERL_NPU_AUTOPATCH_LOG": (None, "INFO", "loud"),
        "VERL_NPU_AUTOPATCH_STRICT": (None, "yes", "maybe"),
        "VERL_VLLM_ASCEND_GLM52_PATCH": (None, "1", "maybe"),
        "VERL_NPU_AUTOPATCH_ENABLE": (None, "glm5"),
    }
    plain = 0
    for installed in (False, True):
        monkeypatch.setattr(startup, "findable", lambda name, installed=installed: installed)
        for chosen in itertools.product(*values.values()):
            env = {name: value for name, value in zip(values, chosen, strict=True) if value is not None}
            monkeypatch.setattr(os, "environ", env)
            if startup.plainly_inactive():
                plain += 1
                assert activation.inactive_here(), env
    # without torch_npu: the master switch unset, blank, on or off, STRICT and the legacy switch
    # unset or understood, ENABLE anything, DEVICE and LOG unset; never with torch_npu
    assert plain == 4 * 2 * 2 * 2


# --------------------------------------------------------------------------- the import graph (issue 24)
FAMILIES_DIR = PACKAGE / "patches"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports: every import statement is an
    edge, at module level, in a function or under ``TYPE_CHECKING`` (``from a.b import c`` imports
    ``a.b``, and ``a.b.c`` when that is a module). One exception: the package root's
    ``TYPE_CHECKING`` block, which names the public API's real types for type checkers; it never
    runs, and every module's import runs the root first anyway (each module "imports" it). The
    same holds for every package's ``__init__``: its names resolve lazily (``import_module``)."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = {id(n) for n in _type_checking_nodes(tree)} if path.name == "__init__.py" else set()
        for node in (n for n in ast.walk(tree) if id(n) not in skipped):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0 and node.module, f"{name}: a relative import"
                edges |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        graph[name] = {edge for edge in edges if edge in paths and edge != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: each holds an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = set()
            while not component or module not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle() -> None:
    assert _cycles(_import_graph()) == []


def test_the_start_up_module_names_the_work_it_hands_over_to() -> None:
    # the one call up from the bottom layer goes by name (no import statement, no edge above):
    # the name must be the module that holds the activating loader's work
    from verl_npu_autopatch.bootstrap import activation, startup

    assert activation.__name__ == startup.ACTIVATION
    assert all(callable(getattr(activation, name)) for name in ("create_module", "exec_module", "waits_for_activation"))
    assert callable(activation.after_fork_in_child)
    assert "verl_npu_autopatch.bootstrap.activation" not in _import_graph()["verl_npu_autopatch.bootstrap.startup"]


def test_no_family_module_imports_another_and_helpers_import_no_family() -> None:
    # shared pieces live in ``patches/_*.py`` helpers, which import nothing above them
    graph = _import_graph()
    tops = [*FAMILIES_DIR.glob("*.py"), *FAMILIES_DIR.glob("*/__init__.py")]  # a family: a module or a subpackage
    families = {_module_name(p) for p in tops if not _module_name(p).rpartition(".")[2].startswith("_")}
    families.discard(catalog_package())
    modules = {_module_name(path) for path in FAMILIES_DIR.rglob("*.py")}
    assert len(families) > 10
    offenders = [f"{m} -> {i}" for m in sorted(modules) for i in sorted(graph[m] & families) if i != m]
    assert offenders == []


def catalog_package() -> str:
    return _module_name(FAMILIES_DIR / "__init__.py")


def test_doctor_and_ray_helpers_never_import_the_command_line() -> None:
    """Imports point down: ``cli`` uses ``doctor`` and ``ray_doctor``, never the other way round
    (the Ray node probe is told which status function to run)."""
    import ast

    package = ROOT / "src" / "verl_npu_autopatch" / "cli"
    for name in ("doctor", "doctor_child", "ray_doctor"):
        imported = set()
        for node in ast.walk(ast.parse((package / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module or ""}
        assert not {m for m in imported if m.startswith("verl_npu_autopatch.cli.main")}, name
