"""``ascend.wake_expert_layout`` on the releases' real ``NPUWorker.wake_up``: a wake-up of the
weights that no reload follows flips the MoE expert weights out of the layout the grouped matmul
reads without the patch (its matmul fails), and leaves them as they were with it.

Release code run: ``NPUWorker.wake_up`` (``upstream.load_subset``: the file's name and line
numbers), on a real ``torch.nn.Module`` whose experts hold ``w13_weight`` / ``w2_weight`` in the
runtime layout the releases' unquantized MoE method leaves (``[E, H, 2I]`` / ``[E, I, H]``).
TEST DOUBLES, for the device only: ``CaMemAllocator`` (a level-1 wake-up copies the offloaded
weights back to the same addresses: nothing changes on a CPU), the Ascend config (no NZ, no extra
clean-up) and the grouped matmul (``x @ w13[e]``, SiLU-and-mul, ``@ w2[e]``, on each expert's slice
as ``npu_grouped_matmul`` reads ``[E, K, N]`` weights).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_wake_expert_layout as family

STATE = "ascend.wake_expert_layout"
GROUP = "sleep_no_reload"
#: Every release the table reads (each has ``NPUWorker.wake_up``): flips up to 0.25.1rc1.
FLIPPING = ("0.13.0", "0.18.0", "0.21.0rc1", "0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1")
FIXED = ("0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc2")
RELEASES = (*FLIPPING, *FIXED)
#: Experts, hidden size, intermediate size (``2I != H`` and ``I != H``: the layouts differ in shape).
E, H, INTER = 2, 8, 3


class Allocator:
    """TEST DOUBLE: CaMem; a level-1 wake-up maps the weights back with the bytes they had."""

    def __init__(self) -> None:
        self.woken: list[Any] = []

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.woken.append(tags)


def load_worker(root: Any, allocator: Allocator) -> types.ModuleType:
    config = types.SimpleNamespace(
        weight_nz_mode=0,
        enable_sleep_mode_extra_cleanup=False,
        rl_config=types.SimpleNamespace(enabled=False, sleep_mode_extra_cleanup=False),
    )
    namespace = {
        "Any": Any,
        "Optional": Any,
        "CaMemAllocator": types.SimpleNamespace(get_instance=lambda: allocator),
        "envs_ascend": types.SimpleNamespace(VLLM_ASCEND_ENABLE_NZ=0),
        "get_ascend_config": lambda: config,
        "torch": torch,
    }
    path = root / "vllm_ascend/worker/worker.py"
    return upstream.load_subset(path, family.WORKER, {"NPUWorker": ("wake_up",)}, (), namespace)


@release_loaders.loads(
    family,
    "vllm-ascend",
    RELEASES,
    sites={label: {f"{family.WORKER}:NPUWorker.wake_up"} for label in ("0.13.0", "0.25.1rc1")},
    param=True,
)
@pytest.fixture
def waking(request: pytest.FixtureRequest, releases: dict, npu: None) -> Iterator[types.SimpleNamespace]:
    """The release's worker module in ``sys.modules`` (under stand-in packages) and its allocator."""
    allocator = Allocator()
    worker = load_worker(releases[request.param][0], allocator)
    package = doubles.stub_module("vllm_ascend.worker", "TEST DOUBLE: a package holding the tested module only")
    package.__path__ = []  # type: ignore[attr-defined]
    with doubles.modules({"vllm_ascend.worker": package, family.WORKER: worker}):
        yield types.SimpleNamespace(worker=worker, allocator=allocator, release=request.param)


def moe_model() -> torch.nn.Module:
    """A model with one MoE layer whose experts hold their weights in the runtime layout."""
    generator = torch.Generator().manual_seed(0)
    experts = torch.nn.Module()
    w13 = torch.randn(E, 2 * INTER, H, generator=generator).transpose(1, 2).contiguous()
    w2 = torch.randn(E, H, INTER, generator=generator).transpose(1, 2).contiguous()
    experts.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
    experts.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].experts = experts
    return model


def forward(model: torch.nn.Module) -> torch.Tensor:
    """TEST DOUBLE of the grouped-matmul MLP: every token through every expert, ``[E, K, N]`` weights."""
    experts = model.layers[0].experts
    x = torch.arange(4 * H, dtype=torch.float32).reshape(4, H) / (4 * H)
    outputs = []
    for e in range(E):
        gate, up = (x @ experts.w13_weight[e]).chunk(2, dim=-1)
        outputs.append((torch.nn.functional.silu(gate) * up) @ experts.w2_weight[e])
    return torch.stack(outputs)


def worker_for(setup: types.SimpleNamespace, model: torch.nn.Module) -> Any:
    made = object.__new__(setup.worker.NPUWorker)
    made.model_runner = types.SimpleNamespace(model=model, post_kv_cache_wake_up=lambda: None)
    made.vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(hidden_size=H)), quant_config=None
    )
    made._sleep_saved_buffers = {}
    return made


def held(model: torch.nn.Module) -> tuple[Any, Any]:
    experts = model.layers[0].experts
    return experts.w13_weight, experts.w2_weight


@pytest.mark.parametrize("waking", FLIPPING, indirect=True)
def test_release_flips_the_experts_at_a_wake_without_reload(waking: types.SimpleNamespace) -> None:
    model = moe_model()
    worker = worker_for(waking, model)
    forward(model)  # the runtime layout serves
    worker.wake_up(["weights"])
    worker.wake_up(["kv_cache"])
    w13, w2 = held(model)
    assert (tuple(w13.shape), tuple(w2.shape)) == ((E, 2 * INTER, H), (E, H, INTER)), "the checkpoint layout"
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        forward(model)


@pytest.mark.parametrize("waking", FLIPPING, indirect=True)
def test_with_the_patch_the_experts_keep_their_runtime_layout(waking: types.SimpleNamespace) -> None:
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE=GROUP)
    record = engine.report()[STATE]
    assert (record.state, record.reason) == ("applied", "fix installed")
    model = moe_model()
    worker = worker_for(waking, model)
    before, expected = held(model), forward(model)
    for _ in range(2):  # every wake-up: each one flipped them again
        worker.wake_up(["weights"])
        worker.wake_up(["kv_cache"])
        worker.wake_up()
    assert all(now is kept for now, kept in zip(held(model), before, strict=True)), "the very Parameters"
    assert torch.equal(forward(model), expected)
    assert waking.allocator.woken[:3] == [["weights"], ["kv_cache"], None], "the release's wake-up ran"
    assert engine.revert() == [STATE]
    worker.wake_up(["weights"])
    assert tuple(held(model)[0].shape) == (E, 2 * INTER, H), "the release's behaviour is back"


@pytest.mark.parametrize("waking", ["0.25.1rc1"], indirect=True)
def test_what_the_release_does_not_flip_is_left_alone(waking: types.SimpleNamespace) -> None:
    """A quantized model (0.21.0rc1 on: no flip) and a wake of the KV cache only keep their Parameters."""
    upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE=GROUP)
    model = moe_model()
    worker = worker_for(waking, model)
    before = held(model)
    worker.vllm_config.quant_config = object()
    worker.wake_up(["weights"])
    worker.vllm_config.quant_config = None
    worker.wake_up(["kv_cache"])
    assert all(now is kept for now, kept in zip(held(model), before, strict=True))


@pytest.mark.parametrize("waking", ["0.26.0rc1", "0.30.0rc2"], indirect=True)
def test_from_0_26_the_release_keeps_the_layout_itself(waking: types.SimpleNamespace) -> None:
    wake_up = waking.worker.NPUWorker.__dict__["wake_up"]
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE=GROUP)
    record = engine.report()[STATE]
    assert record.state == "fixed-upstream" and "no transpose" in record.reason
    assert waking.worker.NPUWorker.__dict__["wake_up"] is wake_up
    model = moe_model()
    expected = forward(model)
    worker_for(waking, model).wake_up(["weights"])
    assert torch.equal(forward(model), expected)


@pytest.mark.parametrize("waking", ["0.25.1rc1"], indirect=True)
def test_opt_in_off_by_default(waking: types.SimpleNamespace) -> None:
    assert upstream.run_engine(family.PATCHES).report()[STATE].state == "disabled"
