"""``ascend.dsv4_dummy_tid2eid`` on the releases' real ``DeepseekV4MoE.__init__``.

The module holds the release's own ``DeepseekV4MoE.__init__`` (``upstream.load_subset``: the file's
name and line numbers), run with TEST DOUBLES for what it builds around the table (process groups,
the gate linear, the shared-expert MLP, the fused MoE layer): none of them touches ``tid2eid``.
The dummy loader is vLLM's rule (fill floating-point tensors only), and the start-up profile run is
a TEST DOUBLE of MC2's dispatch, which rejects a token routed twice to one expert.
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import torch

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_dsv4_dummy_tid2eid as family

STATE = "ascend.dsv4_dummy_tid2eid"
#: Label → the module holding ``DeepseekV4MoE`` there.
RELEASES = {
    "0.23.0.post1": family.FLAT,
    "0.26.0rc1": family.FLAT,
    "0.27.1rc1": family.MODEL,
    "0.28.0rc1": family.MODEL,
}
ZEROS = ("0.23.0.post1", "0.26.0rc1", "0.27.1rc1")
VOCAB, TOP_K, EXPERTS = 32, 4, 8


class Anything:
    """TEST DOUBLE for the layers and groups ``__init__`` builds: takes any call, any attribute."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.kwargs = kwargs

    def __call__(self, *args: object, **kwargs: object) -> Anything:
        return Anything(*args, **kwargs)

    def __getattr__(self, name: str) -> Anything:
        return Anything()

    def __bool__(self) -> bool:
        return False


def load_moe(path, name: str) -> types.ModuleType:
    double = Anything()
    # TEST DOUBLES: one rank, one expert-parallel group of size 1
    ep = types.SimpleNamespace(device_group=types.SimpleNamespace(size=lambda: 1), rank_in_group=0)
    namespace = {
        "torch": torch,
        "nn": torch.nn,
        "get_tensor_model_parallel_world_size": lambda: 1,
        "get_tensor_model_parallel_rank": lambda: 0,
        "get_ep_group": lambda: ep,
        **dict.fromkeys(("rocm_aiter_ops", "get_ascend_config", "envs", "current_platform"), double),
        **dict.fromkeys(("ReplicatedLinear", "DeepseekV2MLP", "FusedMoE", "FusedMoEFactory"), Anything),
    }
    return upstream.load_subset(path, name, {"DeepseekV4MoE": ("__init__",)}, (), namespace)


@release_loaders.loads(
    family,
    "vllm-ascend",
    tuple(RELEASES),
    sites={label: {f"{RELEASES[label]}:{family.METHOD}"} for label in ("0.23.0.post1", "0.27.1rc1")},
    param=True,
)
@pytest.fixture
def dsv4_moe(request, releases, npu) -> Iterator[types.ModuleType]:
    name = RELEASES[request.param]
    root = releases[request.param][0]
    module = load_moe(root / family.module_file(name), name)
    with doubles.alone_in_package(module):
        yield module


def config() -> types.SimpleNamespace:
    """DeepSeek-V4's config, small: the first layer hash-routed."""
    return types.SimpleNamespace(
        vocab_size=VOCAB,
        num_experts_per_tok=TOP_K,
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        num_hash_layers=1,
        hidden_size=16,
        moe_intermediate_size=8,
        hidden_act="silu",
        norm_topk_prob=True,
        scoring_func="sqrtsoftplus",
        vision_n_layers=0,
    )


def parallel() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        use_sequence_parallel_moe=False,
        enable_eplb=False,
        eplb_config=types.SimpleNamespace(num_redundant_experts=0),
    )


def dummy_load(layer: object) -> None:
    """vLLM's dummy loader: random values in floating-point tensors, the rest left as made."""
    table = layer.gate.tid2eid  # type: ignore[attr-defined]
    if table.is_floating_point():
        table.data.uniform_(-1e-3, 1e-3)


def mc2_dispatch(token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """TEST DOUBLE of MC2's dispatch on hash routing: each token's experts must be distinct."""
    experts = table[token_ids]
    for row in experts.tolist():
        if len(set(row)) != len(row):
            raise RuntimeError(f"MC2 dispatch: a token routed twice to one expert {row}")
    return experts


def start(module: types.ModuleType) -> torch.Tensor:
    """Build the first MoE layer, load it dummy, run the profile run's dispatch over every token."""
    layer = module.DeepseekV4MoE(config(), parallel(), None, "model.layers.0.mlp")
    dummy_load(layer)
    return mc2_dispatch(torch.arange(VOCAB), layer.gate.tid2eid)


@pytest.mark.parametrize("dsv4_moe", ZEROS, indirect=True)
def test_release_start_up_fails_under_dummy_load(dsv4_moe):
    with pytest.raises(RuntimeError, match="routed twice"):
        start(dsv4_moe)


@pytest.mark.parametrize("dsv4_moe", ZEROS, indirect=True)
def test_patched_start_up_dispatches_distinct_experts(dsv4_moe):
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert engine.report()[STATE].state == "applied", engine.report()[STATE].reason
    experts = start(dsv4_moe)
    assert experts.dtype == torch.int32 and experts.shape == (VOCAB, TOP_K)
    assert experts.min() >= 0 and experts.max() < EXPERTS
    assert engine.revert() == [STATE]
    with pytest.raises(RuntimeError, match="routed twice"):
        start(dsv4_moe)


@pytest.mark.parametrize("dsv4_moe", ["0.27.1rc1"], indirect=True)
def test_a_real_load_still_overwrites_the_table(dsv4_moe):
    upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    layer = dsv4_moe.DeepseekV4MoE(config(), parallel(), None, "model.layers.0.mlp")
    loaded = torch.randint(0, EXPERTS, (VOCAB, TOP_K), dtype=torch.int32)
    layer.gate.tid2eid.data.copy_(loaded)  # the checkpoint's table, as the weight loader copies it
    assert torch.equal(layer.gate.tid2eid, loaded)


@pytest.mark.parametrize("dsv4_moe", ["0.27.1rc1"], indirect=True)
def test_layers_past_the_hash_ones_have_no_table(dsv4_moe):
    upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    layer = dsv4_moe.DeepseekV4MoE(config(), parallel(), None, "model.layers.1.mlp")
    assert layer.gate.tid2eid is None


@pytest.mark.parametrize("dsv4_moe", ["0.28.0rc1"], indirect=True)
def test_fixed_release_starts_as_it_is(dsv4_moe):
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert engine.report()[STATE].state == "fixed-upstream"
    assert start(dsv4_moe).shape == (VOCAB, TOP_K)
