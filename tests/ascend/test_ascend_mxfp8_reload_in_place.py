"""``ascend.mxfp8_reload_in_place`` on the releases' real ``w8a8_mxfp8.py``: an RL reload moves the
MXFP8 weight scale to new memory without the patch (the captured graph keeps reading the first
load's values), and leaves both tensors where the graph captured them with it.

Release code run: ``AscendW8A8MXFP8DynamicLinearMethod.process_weights_after_loading`` and
``restore_weights_for_rl_loading`` (``upstream.load_subset``: the file's name and line numbers), the
RL reload cycle the release documents (restore, load, process again).
TEST DOUBLES, for the device only: the ACL graph (it keeps the tensors it captured at the first load
and reads them at every replay; the real one keeps their addresses) and the weight loader's copy of
a checkpoint tensor into the parameter (vLLM's default loader: ``param.data.copy_``). The weight is
float8 e4m3, the scale uint8, as the release's ``get_weight`` / ``get_pergroup_param`` make them.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_mxfp8_reload_in_place as family

STATE = "ascend.mxfp8_reload_in_place"
GROUP = "mxfp8"
CLASS = "AscendW8A8MXFP8DynamicLinearMethod"
#: The releases holding the method, by module; up to 0.26.0rc1 in the first, then in the moved one.
FIRST = ("0.18.0", "0.21.0rc1", "0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1", "0.26.0rc1")
MOVED = ("0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc2")
RELEASES = (*FIRST, *MOVED)
AFFECTED = ("0.23.0", "0.24.0rc1", "0.25.1rc1")
#: Output size, input size, scale groups (input / 32).
N, K, G = 4, 128, 4


@release_loaders.loads(
    family,
    "vllm-ascend",
    RELEASES,
    sites={label: {f"{family.MXFP8}:{family.METHOD}"} for label in ("0.23.0", "0.25.1rc1")},
    param=True,
)
@pytest.fixture
def mxfp8(request: pytest.FixtureRequest, releases: dict, npu: None) -> Iterator[types.SimpleNamespace]:
    """The release's MXFP8 linear method in ``sys.modules`` (under stand-in packages)."""
    label = request.param
    name = family.MXFP8 if label in FIRST else family.MOVED
    path = releases[label][0] / f"{name.replace('.', '/')}.py"
    namespace = {"torch": torch, "F": torch.nn.functional, "logger": None, "RowParallelLinear": type(None)}
    module = upstream.load_subset(
        path, name, {CLASS: ("process_weights_after_loading", "restore_weights_for_rl_loading")}, (), namespace
    )
    parents = name.split(".")[:-1]
    stubs = {}
    for depth in range(2, len(parents) + 1):
        package = doubles.stub_module(
            ".".join(parents[:depth]), "TEST DOUBLE: a package holding the tested module only"
        )
        package.__path__ = []  # type: ignore[attr-defined]
        stubs[package.__name__] = package
    with doubles.modules({**stubs, name: module}):
        yield types.SimpleNamespace(module=module, method=getattr(module, CLASS)(), label=label)


def checkpoint(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's weight ``[N, K]`` (float8) and scale ``[N, G]`` (uint8 exponents)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(N, K, generator=generator).to(torch.float8_e4m3fn)
    scale = torch.randint(100, 140, (N, G), generator=generator, dtype=torch.uint8)
    return weight, scale


def loaded_layer(method: Any) -> torch.nn.Module:
    """A linear layer after the first load and the release's transformation."""
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.empty(N, K, dtype=torch.float8_e4m3fn), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.empty(N, G, dtype=torch.uint8), requires_grad=False)
    load(layer, *checkpoint(0))
    method.process_weights_after_loading(layer)
    return layer


def load(layer: torch.nn.Module, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """TEST DOUBLE of vLLM's default weight loader: the checkpoint tensor copied into the parameter."""
    layer.weight.data.copy_(weight)
    layer.weight_scale.data.copy_(scale)


def reload(method: Any, layer: torch.nn.Module, seed: int) -> None:
    """The release's RL reload: restore the checkpoint layout, load, transform again."""
    method.restore_weights_for_rl_loading(layer)
    load(layer, *checkpoint(seed))
    method.process_weights_after_loading(layer)


def expected(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the MXFP8 matmul reads for a checkpoint: ``weight.T`` and the scale paired, ``[G/2, N, 2]``."""
    weight, scale = checkpoint(seed)
    return weight.T.view(torch.uint8), scale.reshape(N, G // 2, 2).transpose(0, 1)


def captured(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """TEST DOUBLE of an ACL graph's capture: the tensors the layer holds now, read at every replay."""
    return layer.weight.data, layer.weight_scale.data


def replay(graph: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return graph[0].view(torch.uint8), graph[1]


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mxfp8", AFFECTED, indirect=True)
def test_release_moves_the_scale_at_every_reload(mxfp8: types.SimpleNamespace) -> None:
    layer = loaded_layer(mxfp8.method)
    graph = captured(layer)
    assert same(replay(graph), expected(0))
    reload(mxfp8.method, layer, seed=1)
    assert same(replay(captured(layer)), expected(1)), "the layer holds the new weights"
    assert layer.weight_scale.data_ptr() != graph[1].data_ptr(), "at another address"
    assert same(replay(graph), (expected(1)[0], expected(0)[1])), "the graph replays the first load's scale"


@pytest.mark.parametrize("mxfp8", AFFECTED, indirect=True)
def test_with_the_patch_the_graph_replays_every_reload(mxfp8: types.SimpleNamespace) -> None:
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE=GROUP)
    record = engine.report()[STATE]
    assert (record.state, record.reason) == ("applied", "fix installed")
    layer = loaded_layer(mxfp8.method)
    graph = captured(layer)
    for seed in (1, 2, 3):
        reload(mxfp8.method, layer, seed)
        assert same(replay(graph), expected(seed))
        assert [t.data_ptr() for t in captured(layer)] == [t.data_ptr() for t in graph]
    mxfp8.method.process_weights_after_loading(layer)  # transformed already: the release returns at once
    assert same(replay(graph), expected(3))
    assert engine.revert() == [STATE]
    reload(mxfp8.method, layer, seed=4)
    assert not same(replay(graph), expected(4)), "the release's behaviour is back"


@pytest.mark.parametrize("mxfp8", ["0.23.0.post1", "0.26.0rc1", "0.30.0rc2"], indirect=True)
def test_releases_with_buffers_made_once_are_fixed_upstream(mxfp8: types.SimpleNamespace) -> None:
    owner = getattr(mxfp8.module, CLASS)
    method = owner.__dict__["process_weights_after_loading"]
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE=GROUP)
    assert engine.report()[STATE].state == "fixed-upstream"
    assert owner.__dict__["process_weights_after_loading"] is method
    if mxfp8.label != "0.30.0rc2":  # 0.30.0rc2 reads the TP padding of a real linear layer
        layer = loaded_layer(mxfp8.method)
        graph = captured(layer)
        reload(mxfp8.method, layer, seed=1)
        assert same(replay(graph), expected(1)), "the release's own buffers"


@pytest.mark.parametrize("mxfp8", ["0.25.1rc1"], indirect=True)
def test_opt_in_off_by_default(mxfp8: types.SimpleNamespace) -> None:
    assert upstream.run_engine(family.PATCHES).report()[STATE].state == "disabled"
