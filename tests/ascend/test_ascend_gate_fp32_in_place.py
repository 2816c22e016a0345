"""``ascend.gate_fp32_in_place`` on the releases' real ``vllm_ascend/ops/linear.py``.

The module holds the release's own ``AscendUnquantizedLinearMethod.process_weights_after_loading``
(``upstream.load_subset``: the file's name and line numbers). Its ``super()`` call reaches a TEST
DOUBLE of vLLM's ``UnquantizedLinearMethod.process_weights_after_loading``, which does nothing off
a CPU platform (on NPU); ``maybe_trans_nz`` is the release's own (``vllm_ascend/utils.py``), with NZ
on, so it calls the ``torch_npu.npu_format_cast`` double bound to the real op schema.
A weight sync is the loader writing new values into ``layer.weight``, then the method running again.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_gate_fp32_in_place

NAME = ascend_gate_fp32_in_place.LINEAR
STATE = "ascend.gate_fp32_in_place"
REBINDING = ("0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1", "0.26.0rc1", "0.27.1rc1")
#: The releases whose files hold the method (older ones: ``unsupported`` in the table, no file to load).
RELEASES = ("0.23.0", "0.24.0rc1", "0.25.1rc1", "0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc2")
KEEP_ND = ("_should_keep_nd_for_310p_weight", "_should_keep_nd_for_compatibility_weight")


class VllmUnquantizedLinearMethod:
    """TEST DOUBLE of vLLM's ``UnquantizedLinearMethod``: its ``process_weights_after_loading``
    acts on CPU platforms only (nothing on NPU)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        doubles.EVENTS.append(("vllm.process_weights_after_loading", layer.prefix))


def load_linear(root) -> types.ModuleType:
    utils = upstream.load_subset(
        root / "vllm_ascend/utils.py",
        "vllm_ascend.utils",
        {},
        ("maybe_trans_nz",),
        # TEST DOUBLES: NZ on (an A2/A3 device), the format id of torch_npu's FRACTAL_NZ
        {"torch": torch, "torch_npu": sys.modules["torch_npu"], "_should_trans_nz": lambda w: True},
    )
    utils.ACL_FORMAT_FRACTAL_NZ = 29  # vllm_ascend.utils' constant (torch_npu's FRACTAL_NZ format id)
    namespace = {"torch": torch, "maybe_trans_nz": utils.maybe_trans_nz, **{n: lambda weight: False for n in KEEP_ND}}
    module = upstream.load_subset(
        root / "vllm_ascend/ops/linear.py",
        NAME,
        {"AscendUnquantizedLinearMethod": ("process_weights_after_loading",)},
        (),
        namespace,
    )
    subset = module.AscendUnquantizedLinearMethod  # its super() goes on to vLLM's method below
    module.Method = type("Method", (subset, VllmUnquantizedLinearMethod), {})
    return module


@release_loaders.loads(
    ascend_gate_fp32_in_place,
    "vllm-ascend",
    RELEASES,
    sites={label: {f"{NAME}:{ascend_gate_fp32_in_place.METHOD}"} for label in ("0.23.0", "0.27.1rc1")},
    param=True,
)
@pytest.fixture
def linear(request, releases, npu) -> Iterator[types.ModuleType]:
    module = load_linear(releases[request.param][0])
    with doubles.alone_in_package(module):
        yield module


def gate() -> torch.nn.Module:
    """DeepSeek-V4's router gate as vllm-ascend builds it: a bf16 weight marked for the fp32 copy."""
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.bfloat16), requires_grad=False)
    layer.precast_fp32_weight, layer.prefix = True, "model.layers.0.mlp.gate"
    return layer


def sync(module: types.ModuleType, layer: torch.nn.Module) -> torch.Tensor:
    """Load, capture (keep the fp32 gate a graph would read), sync new weights; the captured tensor."""
    method = module.Method()
    method.process_weights_after_loading(layer)
    captured = layer.weight_fp32
    layer.weight.data.copy_(torch.randn(4, 6, dtype=torch.bfloat16))
    method.process_weights_after_loading(layer)
    return captured


@pytest.mark.parametrize("linear", REBINDING, indirect=True)
def test_release_leaves_the_captured_gate_stale(linear):
    layer = gate()
    captured = sync(linear, layer)
    assert layer.weight_fp32 is not captured
    assert torch.equal(layer.weight_fp32, layer.weight.float())
    assert not torch.equal(captured, layer.weight.float())


@pytest.mark.parametrize("linear", REBINDING, indirect=True)
def test_patched_sync_updates_the_captured_gate(linear):
    engine = upstream.run_engine(ascend_gate_fp32_in_place.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert engine.report()[STATE].state == "applied", engine.report()[STATE].reason
    layer = gate()
    captured = sync(linear, layer)
    assert layer.weight_fp32 is captured
    assert torch.equal(captured, layer.weight.float())
    assert doubles.names().count("vllm.process_weights_after_loading") == 2  # the release's method ran
    assert doubles.names().count("torch_npu.npu_format_cast") == 4  # fp32 gate and weight, per load
    assert engine.revert() == [STATE]
    assert layer.weight_fp32 is not sync(linear, layer)


@pytest.mark.parametrize("linear", ["0.23.0"], indirect=True)
def test_a_gate_of_another_shape_is_taken_as_made(linear):
    upstream.run_engine(ascend_gate_fp32_in_place.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    layer = gate()
    method = linear.Method()
    method.process_weights_after_loading(layer)
    old = layer.weight_fp32
    layer.weight = torch.nn.Parameter(torch.randn(2, 6, dtype=torch.bfloat16), requires_grad=False)
    method.process_weights_after_loading(layer)
    assert layer.weight_fp32 is not old and layer.weight_fp32.shape == (2, 6)


@pytest.mark.parametrize("linear", ["0.28.0rc1", "0.30.0rc2"], indirect=True)
def test_fixed_upstream_where_the_release_copies(linear):
    original = linear.AscendUnquantizedLinearMethod.__dict__["process_weights_after_loading"]
    record = upstream.run_engine(ascend_gate_fp32_in_place.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4").report()[STATE]
    assert record.state == "fixed-upstream"
    assert "prefer_copy=True" in record.reason
    assert linear.AscendUnquantizedLinearMethod.__dict__["process_weights_after_loading"] is original


@pytest.mark.parametrize("linear", ["0.23.0"], indirect=True)
def test_opt_in_off_by_default(linear):
    assert upstream.run_engine(ascend_gate_fp32_in_place.PATCHES).report()[STATE].state == "disabled"
