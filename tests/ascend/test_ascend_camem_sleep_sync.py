"""``ascend.camem_sleep_sync`` on the real ``vllm_ascend/device_allocator/camem.py``.

The release file runs unchanged as ``vllm_ascend.device_allocator.camem``: ``acl.rt`` and
``torch.npu`` are CPU test doubles, the compiled ``vllm_ascend_C`` is absent (the file's own
``except ImportError`` path), and the test sets the module's ``python_unmap_and_release`` (the C
function the file would have imported) to a recorder.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_camem_sleep_sync

NAME = "vllm_ascend.device_allocator.camem"


def load_camem(root) -> Iterator[ModuleType]:
    module = upstream.load_file(root / "vllm_ascend/device_allocator/camem.py", NAME)
    assert module.camem_available is False  # no compiled extension on this host
    module.python_unmap_and_release = lambda *handle: doubles.EVENTS.append(("unmap_and_release", handle))
    with doubles.modules({NAME: module}):
        yield module


@release_loaders.loads(
    ascend_camem_sleep_sync,
    "vllm-ascend",
    ("0.23.0", "0.30.0rc2"),
    sites={"0.23.0": {f"{NAME}:CaMemAllocator.sleep"}},
    param=True,
)
@pytest.fixture
def camem(request, releases, npu) -> Iterator[ModuleType]:
    yield from load_camem(releases[request.param][0])


def sleep_events(module: ModuleType) -> list[str]:
    allocator = module.CaMemAllocator()
    for ptr in (0x1000, 0x2000):  # two KV-cache allocations: discarded (not offloaded) by sleep
        allocator.pointer_to_data[ptr] = module.AllocationData((0, 512, ptr, ptr + 1), "kv_cache")
    doubles.EVENTS.clear()
    allocator.sleep(offload_tags=("weights",))
    return doubles.names()


@pytest.mark.parametrize("camem", ["0.23.0"], indirect=True)
def test_release_0_23_releases_memory_without_synchronizing_first(camem):
    assert sleep_events(camem)[:2] == ["unmap_and_release", "unmap_and_release"]
    assert "torch.npu.synchronize" not in sleep_events(camem)


@pytest.mark.parametrize("camem", ["0.23.0"], indirect=True)
def test_patched_sleep_synchronizes_before_unmapping(camem):
    engine = upstream.run_engine(ascend_camem_sleep_sync.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert engine.report()["ascend.camem_sleep_sync"].state == "applied"
    events = sleep_events(camem)
    assert events[0] == "torch.npu.synchronize"
    assert events.count("unmap_and_release") == 2  # the release's own sleep still ran in full
    assert events[-1] == "torch.npu.empty_cache"
    assert engine.revert() == ["ascend.camem_sleep_sync"]
    assert "torch.npu.synchronize" not in sleep_events(camem)


@pytest.mark.parametrize("camem", ["0.30.0rc2"], indirect=True)
def test_release_0_30_is_fixed_upstream(camem):
    original = camem.CaMemAllocator.__dict__["sleep"]
    engine = upstream.run_engine(ascend_camem_sleep_sync.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    record = engine.report()["ascend.camem_sleep_sync"]
    assert record.state == "fixed-upstream"
    assert "synchronize" in record.reason
    assert camem.CaMemAllocator.__dict__["sleep"] is original
    events = sleep_events(camem)
    assert events.index("torch.npu.synchronize") < events.index("unmap_and_release")


@pytest.mark.parametrize("camem", ["0.23.0"], indirect=True)
def test_opt_in_off_by_default(camem):
    engine = upstream.run_engine(ascend_camem_sleep_sync.PATCHES)
    assert engine.report()["ascend.camem_sleep_sync"].state == "disabled"
    assert "torch.npu.synchronize" not in sleep_events(camem)
