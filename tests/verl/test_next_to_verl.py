"""The runtime-fix patches next to verl 0.9.1's own copies in ``verl/__init__.py`` (run at
``import verl`` on NPU hosts): each target has one owner and the record names it, in both orders.

verl's statements are the real ones, taken from the released wheel's ``verl/__init__.py`` and run
with ``__name__ == "verl"`` (the whole module imports Ray, Hydra and more, which this env lacks).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest
import tensordict.base
import torch

from tests.support import upstream
from tests.verl.helpers import record, start
from tests.verl.test_torch_npu_nested_tensor_intercept import _jagged, standin  # noqa: F401  (fixture)
from verl_npu_autopatch.patches import tensordict_npu_sync, torch_npu_nested_tensor_intercept

SYNC = "tensordict.npu_sync"


def verl_init() -> tuple[Path, ast.Module]:
    """The path and parsed source of verl 0.9.1's ``verl/__init__.py`` (downloaded once, cached)."""
    script = upstream.matrix_script()
    wheel = script.Artifact("verl", "0.9.1", "verl-0.9.1-py3-none-any.whl")
    try:
        path = script.extract(wheel, ("verl/__init__.py",)) / "verl" / "__init__.py"
    except OSError as exc:  # only when PyPI truly cannot be reached
        pytest.skip(f"cannot download {wheel.filename} from PyPI: {exc}")
    return path, ast.parse(path.read_text(encoding="utf-8"))


def run_verl(node: ast.stmt, path: Path, **names: Any) -> dict[str, Any]:
    """Execute one of verl's statements as module ``verl`` would, with ``names`` bound."""
    namespace: dict[str, Any] = {"__name__": "verl", **names}
    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    return namespace


def verl_sync_all() -> Any:
    """verl's real ``_sync_all_patch``, defined in module ``verl``."""
    path, tree = verl_init()
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_sync_all_patch"]
    return run_verl(node, path)["_sync_all_patch"]


def verl_nested_restore() -> None:
    """Run verl's real statement that restores ``__wrapped__`` of ``torch.nested``'s functions."""
    path, tree = verl_init()
    (node,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Try) and "torch.nested.nested_tensor.__wrapped__" in ast.unparse(n)
    ]
    run_verl(node, path, torch=torch)


@pytest.fixture
def sync_all() -> Any:
    saved = tensordict.base.TensorDictBase.__dict__["_sync_all"]
    yield
    tensordict.base.TensorDictBase._sync_all = saved


def test_verl_after_us_takes_sync_all_and_the_record_says_so(sync_all: None, engines: list) -> None:
    engine = start(engines, tensordict_npu_sync.PATCHES)
    assert record(engine, SYNC) == ("applied", "fix installed")
    ours = tensordict.base.TensorDictBase._sync_all
    verl = verl_sync_all()
    tensordict.base.TensorDictBase._sync_all = verl  # what `import verl` does on tensordict < 0.10
    assert record(engine, SYNC) == ("yielded", "target owned by verl (verl._sync_all_patch)")
    assert engine.revert() == []  # nothing of ours is live: verl's stays
    assert tensordict.base.TensorDictBase._sync_all is verl
    tensordict.base.TensorDictBase._sync_all = ours  # ours back: the record follows the live attribute
    assert record(engine, SYNC) == ("applied", "fix installed")


def test_verl_before_us_keeps_sync_all(sync_all: None, engines: list) -> None:
    verl = verl_sync_all()
    tensordict.base.TensorDictBase._sync_all = verl
    engine = start(engines, tensordict_npu_sync.PATCHES)
    assert record(engine, SYNC) == ("yielded", "target owned by verl (verl._sync_all_patch)")
    assert tensordict.base.TensorDictBase._sync_all is verl


def test_verl_restore_leaves_our_nested_passthrough_in_place(standin: None, engines: list) -> None:  # noqa: F811
    engine = start(engines, torch_npu_nested_tensor_intercept.PATCHES)
    import torch_npu  # noqa: F401  (ours replaces the stand-in intercept)

    ours = torch.nested.nested_tensor
    assert torch_npu_nested_tensor_intercept.kind(ours) == "ours"
    verl_nested_restore()  # verl unwraps anything with __wrapped__; ours has none
    assert torch.nested.nested_tensor is ours
    assert record(engine, torch_npu_nested_tensor_intercept.NAME) == ("applied", "fix installed")
    assert _jagged().is_nested
    assert "torch_npu" in sys.modules
