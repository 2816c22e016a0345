"""``ascend.dsv4_rope_plain_swa`` on the releases' real ``vllm_ascend/ops/rope_dsv4.py``.

The module holds the release's own ``RopeGlobalState`` and ``ComplexExpRotaryEmbedding`` (its
``__init__`` and ``precompute_freqs_cis``; ``upstream.load_subset``), built on ``torch.nn.Module``;
TEST DOUBLES: vLLM's ``current_platform`` (device ``cpu``) and a ``VllmConfig`` with no speculative
decoding. The layers are built as DeepSeek-V4's model builds them: a compressed layer with the
groups ``["default", "c4"]`` and the compressed base, a sliding-window-only one with ``["default"]``.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator

import pytest
import torch

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_dsv4_rope_plain_swa as family

STATE = "ascend.dsv4_rope_plain_swa"
#: Every release with the file: 0.21.0rc1 to 0.28.0rc1 lack the keyword, 0.29.0rc1 and 0.30.0rc2 have it.
RELEASES = ("0.21.0rc1", "0.23.0", "0.24.0rc1", "0.26.0rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc2")
CONFIG = types.SimpleNamespace(
    speculative_config=None, scheduler_config=types.SimpleNamespace(max_num_batched_tokens=4)
)
DIM, WINDOW, FACTOR = 8, 16, 4


def load_rope(root) -> types.ModuleType:
    namespace = {
        "math": math,
        "torch": torch,
        "nn": torch.nn,
        "VllmConfig": object,
        "current_platform": types.SimpleNamespace(device_type="cpu"),  # TEST DOUBLE
    }
    module = upstream.load_subset(
        root / "vllm_ascend/ops/rope_dsv4.py",
        family.MODULE,
        {"RopeGlobalState": ("__init__",), "ComplexExpRotaryEmbedding": ("__init__", "precompute_freqs_cis")},
        (),
        namespace,
    )
    module.Rope = type("Rope", (module.ComplexExpRotaryEmbedding, torch.nn.Module), {})
    return module


@release_loaders.loads(
    family,
    "vllm-ascend",
    RELEASES,
    sites={label: {f"{family.MODULE}:{family.METHOD}"} for label in ("0.23.0", "0.30.0rc2")},
    param=True,
)
@pytest.fixture
def rope(request, releases, npu) -> Iterator[types.ModuleType]:
    module = load_rope(releases[request.param][0])
    with doubles.alone_in_package(module):
        yield module


def tables(module: types.ModuleType, **window: object) -> dict[str, torch.Tensor]:
    """Build DeepSeek-V4's two kinds of layer in a fresh RoPE state (``window``: more keywords of
    the sliding-window layer's call); layer -> its cos table."""
    state = module._ROPE_STATE = module.RopeGlobalState()
    # the compressed layer positionally (a caller may), the window one by keywords as DeepSeek-V4 does
    module.Rope(CONFIG, "compressed", DIM, DIM, WINDOW, 160000, FACTOR, ["default", "c4"], beta_fast=32, beta_slow=1)
    module.Rope(
        vllm_config=CONFIG,
        layername="window",
        head_size=DIM,
        rotary_dim=DIM,
        max_position_embeddings=WINDOW,
        base=10000,
        scaling_factor=FACTOR,
        rope_groups=["default"],
        beta_fast=32,
        beta_slow=1,
        **window,
    )
    cache = getattr(state, "full_rope_cache", None) or state.static_cache  # 0.21.0rc1's name
    return {layer: cache[key][0].flatten(1) for layer, (key, _) in state.layer_info.items()}


def plain(base: float) -> torch.Tensor:
    """The reference's unscaled RoPE cos table (interleaved pairs), written here from its definition."""
    frequencies = base ** (-torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)
    angles = torch.outer(torch.arange(WINDOW * FACTOR, dtype=torch.float32), frequencies)
    return angles.cos().repeat_interleave(2, dim=-1)


@pytest.mark.parametrize("rope", RELEASES, indirect=True)
def test_the_release_scales_the_window_layers_and_the_fix_does_not(rope: types.ModuleType) -> None:
    before = tables(rope)
    assert not torch.allclose(before["window"], plain(10000))  # YaRN-interpolated frequencies

    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert engine.report()[STATE].state == "applied", engine.report()[STATE].reason
    after = tables(rope)
    assert torch.allclose(after["window"], plain(10000), atol=1e-6)
    own_switch = rope.__file__.split("vllm-ascend-")[-1].startswith(("0.29", "0.30"))  # the release's keyword
    assert ("apply_yarnFalse" in rope._ROPE_STATE.layer_info["window"][0]) == own_switch
    assert torch.equal(after["compressed"], before["compressed"])  # the compressed layers keep YaRN
    assert "precompute_freqs_cis" not in vars(rope.Rope)

    assert engine.revert() == [STATE]
    assert torch.equal(tables(rope)["window"], before["window"])


@pytest.mark.parametrize("rope", ["0.23.0", "0.30.0rc2"], indirect=True)
def test_a_caller_naming_the_scaling_is_left_alone(rope: types.ModuleType) -> None:
    keyword = {"apply_yarn_scaling": True} if "0.30.0rc2" in rope.__file__ else {"original_seq_len": WINDOW}
    before = tables(rope, **keyword)
    upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert torch.equal(tables(rope, **keyword)["window"], before["window"])


@pytest.mark.parametrize("rope", ["0.23.0"], indirect=True)
def test_opt_in_off_by_default(rope: types.ModuleType) -> None:
    assert upstream.run_engine(family.PATCHES).report()[STATE].state == "disabled"
