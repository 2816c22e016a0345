"""``ascend.mooncake_sleep_reregister`` on the releases' real ``worker.py`` and
``mooncake_transfer_engine.py``.

The transfer-engine module is the release's whole file (``upstream.load_file``: ``GlobalTE`` and its
``global_te``); the worker module holds the release's own ``NPUWorker.sleep`` and ``wake_up``
(``upstream.load_subset``: the file's name and line numbers).
TEST DOUBLES: the NPU worker is the release's class made without its ``__init__`` (a device, a
model runner), holding the fields the two methods read, its model without parameters or buffers;
``CaMemAllocator`` is a pool whose addresses stay while its backing changes at each KV-cache wake-up
(as CaMem maps new physical memory at the same virtual addresses), ``torch.npu.mem_get_info`` a
constant; Mooncake's ``TransferEngine`` keeps, per registered address, the backing it was
registered with, and refuses to register unmapped memory. A registration of an older backing than
the pool's is one the KV cache no longer holds.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from typing import Any

import pytest

from tests.ascend import doubles
from tests.ascend.test_ascend_mooncake_hybrid_send_counts import RELEASES as HYBRID_RELEASES
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_mooncake_sleep_reregister as family

STATE = "ascend.mooncake_sleep_reregister"
WORKER_PATH = "vllm_ascend/worker/worker.py"
ENGINE_PATH = "vllm_ascend/distributed/kv_transfer/utils/mooncake_transfer_engine.py"
#: Every release read with the shared transfer engine (0.18.0 to 0.30.0rc2): 0.18.0, then those with hybrid transfers.
RELEASES = ("0.18.0", *HYBRID_RELEASES)
PACKAGES = (
    "vllm_ascend.worker",
    "vllm_ascend.distributed",
    "vllm_ascend.distributed.kv_transfer",
    "vllm_ascend.distributed.kv_transfer.utils",
)
BUFFERS = ([0x1000, 0x2000], [128, 256])


class Pool:
    """TEST DOUBLE: CaMem's KV-cache pool; ``backing`` counts the physical memory mapped so far."""

    def __init__(self) -> None:
        self.backing, self.mapped = 0, True

    def sleep(self, offload_tags: tuple[str, ...] = ()) -> None:
        self.mapped = False  # the KV cache is never offloaded: released at every level

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is None or "kv_cache" in tags:
            self.backing, self.mapped = self.backing + 1, True


class Mooncake:
    """TEST DOUBLE: Mooncake's ``TransferEngine`` registration table (address → size, backing)."""

    def __init__(self, pool: Pool, refuse: int | None = None) -> None:
        self.pool, self.refuse, self.registered = pool, refuse, {}

    def register_memory(self, ptr: int, size: int) -> int:
        if not self.pool.mapped:
            return -1
        self.registered[ptr] = (size, self.pool.backing)
        return 0

    def unregister_memory(self, ptr: int) -> int:
        if ptr == self.refuse:
            return -1
        return 0 if self.registered.pop(ptr, None) else -1


def load_worker(root, pool: Pool) -> types.ModuleType:
    config = types.SimpleNamespace(
        weight_nz_mode=0,
        enable_sleep_mode_extra_cleanup=False,
        rl_config=types.SimpleNamespace(enabled=False, sleep_mode_extra_cleanup=False),
    )
    namespace = {
        "Any": Any,
        "CaMemAllocator": types.SimpleNamespace(get_instance=lambda: pool),
        "GiB_bytes": 1 << 30,
        "_allowed_names": set(),
        "envs_ascend": types.SimpleNamespace(VLLM_ASCEND_ENABLE_NZ=0),
        "get_ascend_config": lambda: config,
        "logger": logging.getLogger("tests.worker"),
        "torch": types.SimpleNamespace(npu=types.SimpleNamespace(mem_get_info=lambda: (1 << 30, 1 << 31))),
        "vllm_version_is": lambda version: False,
    }
    return upstream.load_subset(root / WORKER_PATH, family.WORKER, {"NPUWorker": ("sleep", "wake_up")}, (), namespace)


@release_loaders.loads(
    family,
    "vllm-ascend",
    RELEASES,
    sites={
        label: {
            f"{family.WORKER}:NPUWorker.sleep",
            f"{family.WORKER}:NPUWorker.wake_up",
            f"{family.ENGINE}:GlobalTE.register_buffer",
        }
        for label in ("0.18.0", "0.30.0rc2")
    },
    param=True,
)
@pytest.fixture
def sleeping(request, releases, npu) -> Iterator[types.SimpleNamespace]:
    """The release's worker and transfer-engine modules in ``sys.modules``, with the pool they share."""
    root, pool = releases[request.param][0], Pool()
    stubs = {
        name: doubles.stub_module(name, "TEST DOUBLE: a package holding the tested module only") for name in PACKAGES
    }
    for stub in stubs.values():
        stub.__path__ = []  # type: ignore[attr-defined]
    worker = load_worker(root, pool)
    engine = upstream.load_file(root / ENGINE_PATH, family.ENGINE)
    with doubles.modules({**stubs, family.WORKER: worker, family.ENGINE: engine}):
        yield types.SimpleNamespace(worker=worker, engine=engine, pool=pool)


def registered(setup: types.SimpleNamespace, refuse: int | None = None) -> tuple[Any, Mooncake]:
    """``(worker, mooncake)``: a decode worker whose connector registered its KV cache."""
    mooncake = Mooncake(setup.pool, refuse)
    setup.engine.global_te.transfer_engine = mooncake
    setup.engine.global_te.register_buffer(*BUFFERS)
    made = object.__new__(setup.worker.NPUWorker)
    model = types.SimpleNamespace(named_buffers=lambda: [], named_parameters=lambda: [])
    made.model_runner = types.SimpleNamespace(model=model, post_kv_cache_wake_up=lambda: None)
    made.vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(hidden_size=8)), quant_config=None
    )
    made._sleep_saved_buffers = {}
    return made, mooncake


def rollout_cycle(made: Any) -> None:
    """Sleep, then verl's staged wake-up: the weights first, the KV cache after the sync."""
    made.sleep(1)
    made.wake_up(["weights"])
    made.wake_up(["kv_cache"])


@pytest.mark.parametrize("sleeping", RELEASES, indirect=True)
def test_release_keeps_the_registration_of_the_memory_sleep_released(sleeping: types.SimpleNamespace) -> None:
    made, mooncake = registered(sleeping)
    rollout_cycle(made)
    sleeping.engine.global_te.register_buffer(*BUFFERS)  # a second registration returns at once
    assert sleeping.pool.backing == 1
    assert mooncake.registered == {0x1000: (128, 0), 0x2000: (256, 0)}, "the memory released at sleep"


@pytest.mark.parametrize("sleeping", RELEASES, indirect=True)
def test_with_the_patch_the_awake_kv_cache_is_what_mooncake_has_registered(sleeping: types.SimpleNamespace) -> None:
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="pd_disaggregation")
    record = engine.report()[STATE]
    assert (record.state, record.reason) == ("applied", "fix installed")

    made, mooncake = registered(sleeping)
    made.sleep(1)
    assert mooncake.registered == {} and not sleeping.engine.global_te.is_register_buffer
    made.wake_up(["weights"])
    assert mooncake.registered == {}, "the KV cache is still released"
    made.wake_up(["kv_cache"])
    assert mooncake.registered == {0x1000: (128, 1), 0x2000: (256, 1)}
    assert sleeping.engine.global_te.is_register_buffer

    assert engine.revert() == [STATE]
    rollout_cycle(made)
    assert mooncake.registered == {0x1000: (128, 1), 0x2000: (256, 1)}, "the release's behaviour is back"


@pytest.mark.parametrize("sleeping", ["0.23.0", "0.30.0rc2"], indirect=True)
def test_a_refused_unregistration_puts_the_others_back_and_raises(sleeping: types.SimpleNamespace) -> None:
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="pd_disaggregation")
    made, mooncake = registered(sleeping, refuse=0x2000)
    with pytest.raises(RuntimeError, match="unregistration failed for ptr=0x2000"):
        made.sleep(1)
    assert mooncake.registered == {0x1000: (128, 0), 0x2000: (256, 0)}
    assert sleeping.engine.global_te.is_register_buffer and sleeping.pool.mapped
    engine.revert()


@pytest.mark.parametrize("sleeping", ["0.23.0"], indirect=True)
def test_buffers_registered_before_the_patch_are_left_as_the_release_leaves_them(
    sleeping: types.SimpleNamespace,
) -> None:
    made, mooncake = registered(sleeping)  # before the patch: nothing recorded
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="pd_disaggregation")
    rollout_cycle(made)
    assert mooncake.registered == {0x1000: (128, 0), 0x2000: (256, 0)}
    engine.revert()
