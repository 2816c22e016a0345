"""``torch_npu.nested_tensor_intercept`` with a stand-in torch_npu (``standin/``, a test double
shaped like torch_npu's ``utils/npu_intercept.py``) and the real ``torch.nested`` of torch 2.13."""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.support import release_loaders
from tests.verl.helpers import record, start
from verl_npu_autopatch.patches import torch_npu_nested_tensor_intercept

NAME = torch_npu_nested_tensor_intercept.NAME
STANDIN = Path(__file__).resolve().parent / "standin"


def _standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], ModuleType]]:
    """Make the stand-in ``torch_npu`` importable and yield its loader; restore ``torch.nested`` and
    ``sys.modules`` after."""
    saved = {name: getattr(torch.nested, name) for name in torch_npu_nested_tensor_intercept.FUNCTIONS}
    monkeypatch.syspath_prepend(str(STANDIN))
    yield lambda release: importlib.import_module("torch_npu")
    for name, fn in saved.items():
        setattr(torch.nested, name, fn)
    for module in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        del sys.modules[module]


@release_loaders.loads(
    torch_npu_nested_tensor_intercept,
    None,
    ("stand-in",),
    sites={"stand-in": {f"torch_npu:torch.nested.{name}" for name in torch_npu_nested_tensor_intercept.FUNCTIONS}},
)
@pytest.fixture
def torch_npu_standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], ModuleType]]:
    """A loader of the stand-in ``torch_npu`` (torch_npu's intercept over ``torch.nested``; its one
    release is ``"stand-in"``)."""
    yield from _standin(monkeypatch)


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The stand-in ``torch_npu`` is importable; ``torch.nested`` and ``sys.modules`` are restored."""
    for _ in _standin(monkeypatch):
        yield


def _jagged() -> Any:
    return torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)], layout=torch.jagged)


def _as_jagged() -> Any:
    return torch.nested.as_nested_tensor([torch.ones(2), torch.ones(4)], layout=torch.jagged)


def _foreign(fn: Any, calls: list[str]) -> Any:
    """Someone else's wrapper (e.g. a profiler), defined in this test module."""

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        calls.append(fn.__name__)
        return fn(*args, **kwargs)

    return traced


def test_the_standin_intercept_raises_without_the_patch(standin: None) -> None:
    import torch_npu  # noqa: F401

    assert torch_npu_nested_tensor_intercept.is_intercept(torch.nested.nested_tensor)
    with pytest.raises(RuntimeError, match="not supported in npu"):
        _jagged()


def test_intercept_is_removed_and_jagged_nested_tensors_build(standin: None, engines: list) -> None:
    engine = start(engines, torch_npu_nested_tensor_intercept.PATCHES)
    assert record(engine, NAME)[0] == "pending"
    import torch_npu  # noqa: F401  (the post-import hook applies the patch once torch_npu has loaded)

    assert record(engine, NAME) == ("applied", "fix installed")
    nested = _jagged()
    assert nested.is_nested and nested.size(0) == 2
    assert [t.tolist() for t in nested.unbind()] == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0]]
    assert _as_jagged().is_nested
    assert not torch_npu_nested_tensor_intercept.is_intercept(torch.nested.nested_tensor)

    engine.revert()
    assert torch_npu_nested_tensor_intercept.is_intercept(torch.nested.nested_tensor), (
        "undo puts torch_npu's wrapper back"
    )
    with pytest.raises(RuntimeError, match="not supported in npu"):
        _jagged()


def test_torch_npu_imported_before_activation(standin: None, engines: list) -> None:
    import torch_npu  # noqa: F401

    engine = start(engines, torch_npu_nested_tensor_intercept.PATCHES)
    assert record(engine, NAME)[0] == "applied"
    assert _jagged().is_nested


def test_another_modules_wrapper_is_left_in_place_and_recorded(
    standin: None, engines: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_TORCH_NPU_INTERCEPT", "0")  # a torch_npu that intercepts nothing
    calls: list[str] = []
    foreign = _foreign(torch.nested.nested_tensor, calls)
    torch.nested.nested_tensor = foreign
    engine = start(engines, torch_npu_nested_tensor_intercept.PATCHES)
    import torch_npu  # noqa: F401

    state, reason = record(engine, NAME)
    assert state == "yielded"
    assert f"nested_tensor by {__name__}._foreign.<locals>.traced" in reason
    assert torch.nested.nested_tensor is foreign
    _jagged()
    assert calls == ["nested_tensor"]


def test_only_torch_npus_layer_is_removed_over_another_wrapper(standin: None, engines: list) -> None:
    calls: list[str] = []
    foreign = _foreign(torch.nested.nested_tensor, calls)
    torch.nested.nested_tensor = foreign  # installed first; torch_npu wraps it on import
    engine = start(engines, torch_npu_nested_tensor_intercept.PATCHES)
    import torch_npu  # noqa: F401

    assert record(engine, NAME)[0] == "applied"
    assert torch_npu_nested_tensor_intercept.kind(torch.nested.nested_tensor) == "ours"
    assert _jagged().is_nested
    assert calls == ["nested_tensor"], "the other wrapper still runs"


def test_no_intercept_is_fixed_upstream(standin: None, engines: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_TORCH_NPU_INTERCEPT", "0")
    engine = start(engines, torch_npu_nested_tensor_intercept.PATCHES)
    import torch_npu  # noqa: F401

    state, reason = record(engine, NAME)
    assert state == "fixed-upstream", reason
    assert torch.nested.nested_tensor.__module__ == "torch.nested"
    assert not hasattr(torch.nested.nested_tensor, "__verl_npu_autopatch__")


def test_a_wrapper_elsewhere_named_like_torch_npus_is_not_taken_for_it() -> None:
    def wrapper(*args: Any, **kwargs: Any) -> None:
        return None

    wrapper.__wrapped__ = torch.nested.nested_tensor  # type: ignore[attr-defined]
    wrapper.__module__ = torch_npu_nested_tensor_intercept.INTERCEPT
    assert not torch_npu_nested_tensor_intercept.is_intercept(wrapper)
    assert torch_npu_nested_tensor_intercept.kind(wrapper) == "foreign"
