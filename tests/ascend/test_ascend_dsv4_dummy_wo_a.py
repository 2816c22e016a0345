"""``ascend.dsv4_dummy_wo_a`` on the releases' real ``linear.py`` and vLLM's real dummy loader.

Release code run (``upstream.load_subset``: the files' names and line numbers): vllm-ascend's
``AscendColumnParallelLinear.weight_loader`` and ``AscendUnquantizedLinearMethod.
process_weights_after_loading`` with the module-level helpers they call, and the paired vLLM's
``DummyModelLoader.load_weights``. The load is vLLM's order: ``load_weights``, then every layer's
``process_weights_after_loading``. TEST DOUBLES: the vLLM bases the release's ``super()`` calls reach
(``ColumnParallelLinear.weight_loader`` narrows the checkpoint to the TP shard and copies it; the
unquantized method's own step does nothing on the device), vLLM's dummy fill (floating-point
tensors get seeded uniform values), vllm-ascend's hardware queries and ``maybe_trans_nz`` (ND
weights stay ND), and the attention's ``npu_transpose_batchmatmul`` (``doubles``: 3-D operands only).
"""

from __future__ import annotations

import ast
import enum
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_dsv4_dummy_wo_a as family

STATE = "ascend.dsv4_dummy_wo_a"
#: Releases reading: the A5 condition (0.23.0.post1), the fusion one (0.27.1rc1), fixed (0.28.0rc1).
BROKEN = ("0.23.0.post1", "0.27.1rc1")
#: Every release whose files hold the targets (older ones: ``unsupported`` in the table, no ``wo_a``).
RELEASES = ("0.21.0rc1", "0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1", "0.26.0rc1", "0.27.1rc1")
RELEASES += ("0.28.0rc1", "0.29.0rc1", "0.30.0rc2")
GROUPS, RANK, HIDDEN, TOKENS = 2, 4, 6, 3
PREFIX = "model.layers.0.attn.wo_a"


class Capability(enum.Enum):
    """TEST DOUBLE of vllm-ascend's ``HardwareCapability`` (the member the release reads)."""

    DYNAMIC_MX_QUANT_FUSION = "dynamic_mx_quant_fusion"


class Layout(enum.Enum):
    """TEST DOUBLE of ``WeightLayoutPolicy``: this card keeps weights ND."""

    FORCE_NZ = "force_nz"
    ND = "nd"


class Device(enum.Enum):
    """TEST DOUBLE of ``AscendDeviceType``."""

    A3 = "a3"
    A5 = "a5"


#: The card the doubles describe (a test may change it).
CARD = {"fusion": False, "device": Device.A3}


def _profile() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        supports=lambda capability: CARD["fusion"] and capability is Capability.DYNAMIC_MX_QUANT_FUSION,
        weight_layout_policy=Layout.ND,
    )


class _VllmColumn:
    """TEST DOUBLE of vLLM's ``ColumnParallelLinear.weight_loader`` (output dim 0): this TP rank's shard, copied."""

    def weight_loader(self, param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * shard, shard))


class _VllmUnquantized:
    """TEST DOUBLE of vLLM's ``UnquantizedLinearMethod.process_weights_after_loading``: nothing on the device."""

    def process_weights_after_loading(self, layer: Any) -> None:
        return None


def _helpers(path: Path) -> tuple[str, ...]:
    """The release's module-level ``_should_*`` helpers (the post-load step calls them)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return tuple(n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_should_"))


def load_linear(root: Path) -> types.ModuleType:
    path = root / family.module_file(family.LINEAR)
    namespace = {
        "torch": torch,
        "Parameter": torch.nn.Parameter,
        "get_current_hardware_profile": _profile,
        "HardwareCapability": Capability,
        "WeightLayoutPolicy": Layout,
        "get_ascend_device_type": lambda: CARD["device"],
        "AscendDeviceType": Device,
        "is_310p": lambda: False,
        "maybe_trans_nz": lambda weight: weight,
    }
    classes = {
        "AscendColumnParallelLinear": ("weight_loader",),
        "AscendUnquantizedLinearMethod": ("process_weights_after_loading",),
    }
    return upstream.load_subset(path, family.LINEAR, classes, _helpers(path), namespace)


class _Info:
    """TEST DOUBLE of vLLM's layer-wise reload info: no online quantization here."""

    def can_load(self) -> bool:
        return False


def _dummy_fill(layer: torch.nn.Module, model_config: Any = None, low: float = -1e-3, high: float = 1e-3) -> None:
    """TEST DOUBLE of vLLM's ``initialize_dummy_weights``: seeded uniform values in every
    floating-point tensor (no ``weight_loader`` runs)."""
    generator = torch.Generator().manual_seed(1234)
    for tensor in layer.state_dict().values():
        if torch.is_floating_point(tensor):
            tensor.uniform_(low, high, generator=generator)


def load_loader(root: Path) -> types.ModuleType:
    namespace = {"get_layerwise_info": lambda layer: _Info(), "initialize_dummy_weights": _dummy_fill}
    path = root / family.module_file(family.LOADER)
    return upstream.load_subset(path, family.LOADER, {"DummyModelLoader": ("load_weights",)}, (), namespace)


@release_loaders.loads(
    family,
    "vllm-ascend",
    RELEASES,
    # only vLLM's dummy loader changes; vllm-ascend's linear.py (read beside it) stays as shipped
    sites={label: {f"{family.LOADER}:{family.METHOD}"} for label in ("0.23.0.post1", "0.27.1rc1")},
    param=True,
)
@pytest.fixture
def loading(request, releases, npu) -> Iterator[types.SimpleNamespace]:
    ascend_root, vllm_root = releases[request.param]
    linear, loader = load_linear(ascend_root), load_loader(vllm_root)
    CARD.update(fusion=False, device=Device.A3)
    with doubles.modules({family.LINEAR: linear, family.LOADER: loader}):
        yield types.SimpleNamespace(linear=linear, loader=loader)


def make_model(setup: types.SimpleNamespace, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A model holding DeepSeek-V4's unquantized ``wo_a`` as the release creates it: 2-D."""

    class WoA(setup.linear.AscendColumnParallelLinear, _VllmColumn, torch.nn.Module):
        pass

    class Method(setup.linear.AscendUnquantizedLinearMethod, _VllmUnquantized):
        pass

    layer = WoA()
    torch.nn.Module.__init__(layer)
    layer.weight = torch.nn.Parameter(torch.empty(GROUPS * RANK, HIDDEN, dtype=dtype), requires_grad=False)
    layer.prefix, layer.quant_config, layer.quant_method = PREFIX, None, Method()
    layer.n_local_groups, layer.o_lora_rank, layer.tp_rank = GROUPS, RANK, 0
    model = torch.nn.Module()
    model.wo_a = layer
    return model


def dummy_load(setup: types.SimpleNamespace, model: torch.nn.Module) -> None:
    """vLLM's load under ``load_format=dummy``: ``load_weights``, then the post-load steps."""
    setup.loader.DummyModelLoader.load_weights(object.__new__(setup.loader.DummyModelLoader), model, None)
    for layer in model.modules():
        if hasattr(layer, "quant_method"):
            layer.quant_method.process_weights_after_loading(layer)


def o_proj(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The DSA attention's ``wo_a`` call (``_forward_o_proj``'s plain branch)."""
    return doubles.npu_transpose_batchmatmul(
        x, weight, bias=None, scale=None, perm_x1=[1, 0, 2], perm_x2=[0, 1, 2], perm_y=[1, 0, 2], batch_split_factor=1
    )


def real_load(setup: types.SimpleNamespace, checkpoint: torch.Tensor) -> torch.nn.Module:
    """The release's real load of ``checkpoint`` (its ``weight_loader``, then the post-load step)."""
    model = make_model(setup, checkpoint.dtype)
    model.wo_a.weight_loader(model.wo_a.weight, checkpoint)
    model.wo_a.quant_method.process_weights_after_loading(model.wo_a)
    return model


@pytest.mark.parametrize("loading", BROKEN, indirect=True)
def test_release_start_up_fails_under_dummy_load(loading):
    model = make_model(loading)
    dummy_load(loading, model)
    assert model.wo_a.weight.shape == (GROUPS * RANK, HIDDEN)
    with pytest.raises(RuntimeError, match="must be 3-D"):
        o_proj(model.wo_a.weight, torch.randn(TOKENS, GROUPS, HIDDEN, dtype=torch.bfloat16))


@pytest.mark.parametrize("loading", BROKEN, indirect=True)
def test_patched_dummy_load_gives_the_layout_of_a_real_load(loading):
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert engine.report()[STATE].state == "applied", engine.report()[STATE].reason
    model = make_model(loading)
    dummy_load(loading, model)
    flat = torch.empty(GROUPS * RANK, HIDDEN, dtype=torch.bfloat16)
    _dummy_fill(torch.nn.ParameterList([torch.nn.Parameter(flat, requires_grad=False)]))
    assert torch.equal(model.wo_a.weight, real_load(loading, flat).wo_a.weight)
    assert model.wo_a.weight.shape == (GROUPS, HIDDEN, RANK)
    x = torch.randn(TOKENS, GROUPS, HIDDEN, dtype=torch.bfloat16)
    expected = torch.einsum("tgd,grd->tgr", x.float(), flat.float().view(GROUPS, RANK, HIDDEN))
    torch.testing.assert_close(o_proj(model.wo_a.weight, x).float(), expected, rtol=2e-2, atol=1e-6)
    assert engine.revert() == [STATE]
    reverted = make_model(loading)
    dummy_load(loading, reverted)
    assert reverted.wo_a.weight.dim() == 2


@pytest.mark.parametrize("loading", ["0.27.1rc1"], indirect=True)
def test_the_next_weight_sync_copies_in_place(loading):
    upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    model = make_model(loading)
    dummy_load(loading, model)
    address = model.wo_a.weight.data_ptr()
    checkpoint = torch.randn(GROUPS * RANK, HIDDEN, dtype=torch.bfloat16)
    model.wo_a.weight_loader(model.wo_a.weight, checkpoint)  # the release's RL-update branch
    assert model.wo_a.weight.data_ptr() == address, "captured graphs keep reading the synced weight"
    assert torch.equal(model.wo_a.weight, real_load(loading, checkpoint).wo_a.weight)


@pytest.mark.parametrize(
    ("fusion", "dtype", "three_d"),
    [(True, torch.bfloat16, True), (True, torch.float16, False), (False, torch.float16, True)],
)
@pytest.mark.parametrize("loading", ["0.27.1rc1"], indirect=True)
def test_the_release_condition_decides_the_layout(loading, fusion, dtype, three_d):
    """On a card with dynamic MX quant fusion only a bf16 load is reshaped, as the release's loader does."""
    upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    CARD["fusion"] = fusion
    model = make_model(loading, dtype)
    dummy_load(loading, model)
    assert model.wo_a.weight.dim() == (3 if three_d else 2)
    assert (
        real_load(loading, torch.zeros(GROUPS * RANK, HIDDEN, dtype=dtype)).wo_a.weight.dim() == model.wo_a.weight.dim()
    )


@pytest.mark.parametrize("loading", ["0.23.0.post1"], indirect=True)
def test_an_a5_card_keeps_the_2d_layout_on_the_older_releases(loading):
    upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    CARD["device"] = Device.A5
    model = make_model(loading)
    dummy_load(loading, model)
    assert model.wo_a.weight.dim() == 2


@pytest.mark.parametrize("loading", ["0.28.0rc1"], indirect=True)
def test_fixed_release_reshapes_dummy_loads_itself(loading):
    original = loading.loader.DummyModelLoader.__dict__["load_weights"]
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert engine.report()[STATE].state == "fixed-upstream"
    assert loading.loader.DummyModelLoader.__dict__["load_weights"] is original
    model = make_model(loading)
    dummy_load(loading, model)
    assert model.wo_a.weight.shape == (GROUPS, HIDDEN, RANK)


@pytest.mark.parametrize("loading", ["0.27.1rc1"], indirect=True)
def test_opt_in_off_by_default(loading):
    engine = upstream.run_engine(family.PATCHES)
    assert engine.report()[STATE].state == "disabled"
