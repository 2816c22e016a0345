"""``verl.hccl_broadcast_thread`` on verl's real ``BroadcastOperation`` (0.8.0, 0.9.0, 0.9.1, run from
the release files; the module's heavy imports left out). The doubles stand in for the device only: a
zmq PUB/SUB pair over one queue, and an HCCL group whose ``broadcast`` needs the NPU device context
of the thread it runs on, as HCCL does (set here on the test's thread, as verl's worker sets it)."""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from collections import deque
from typing import Any

import pytest
import torch

from tests.support import release_loaders, upstream
from tests.verl.helpers import record, start, verl_files
from verl_npu_autopatch.patches import verl_hccl_broadcast_thread as family

(PATCH,) = family.PATCHES
RELEASES = ("0.8.0", "0.9.0", "0.9.1")
#: Thread-local NPU device context: set on the thread that set the device (``torch.npu.set_device``).
DEVICE = threading.local()


class Socket:
    """One end of a zmq PUB/SUB pair; both ends share ``wire``."""

    def __init__(self, wire: deque) -> None:
        self.wire = wire

    def send_string(self, text: str, flags: int = 0) -> None:
        self.wire.append(text)

    def send_pyobj(self, value: Any) -> None:
        self.wire.append(value)

    def recv_string(self) -> str:
        return self.wire.popleft()

    def recv_pyobj(self) -> Any:
        return self.wire.popleft()


class HcclGroup:
    """A broadcast over one shared buffer: rank 0 puts its bucket there, the others copy it out. It
    fails as HCCL does on a thread without the device context, and notes each calling thread."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.shared, self.threads = rank, shared, []

    def broadcast(self, bucket: torch.Tensor, src: int) -> None:
        self.threads.append(threading.get_ident())
        if getattr(DEVICE, "npu", None) is None:
            raise RuntimeError("HCCL error: no NPU device context on this thread")
        if self.rank == src:
            self.shared["bucket"] = bucket.clone()
        else:
            bucket.copy_(self.shared["bucket"])


@release_loaders.loads(family, "verl", RELEASES, sites={"0.9.0": {f"{family.MODULE}:{family.CLASS}.__init__"}})
@pytest.fixture
def broadcast_operations(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install a release's ``hccl_checkpoint_engine`` (only ``BroadcastOperation``) under its real name."""

    def install(version: str) -> types.ModuleType:
        path = verl_files(version) / "verl/checkpoint_engine/hccl_checkpoint_engine.py"
        zmq = types.SimpleNamespace(Socket=Socket, SNDMORE=2)
        namespace = {"asyncio": asyncio, "torch": torch, "zmq": zmq, "StatelessProcessGroup": HcclGroup}
        namespace["TensorMeta"] = dict
        methods = ("__init__", "_run", "wait_for_complete")
        module = upstream.load_subset(path, family.MODULE, {family.CLASS: methods}, namespace=namespace)
        monkeypatch.setitem(sys.modules, "verl", types.ModuleType("verl"))
        monkeypatch.setitem(sys.modules, family.MODULE, module)
        return module

    return install


@pytest.fixture
def device() -> Any:
    """The test's thread holds the NPU device context (as verl's worker thread does)."""
    DEVICE.npu = 0
    yield
    del DEVICE.npu


def _sync(module: types.ModuleType) -> tuple[dict, torch.Tensor, list[HcclGroup]]:
    """One bucket from rank 0 to rank 1 as verl's send and receive loops do: make the operation, then
    await ``wait_for_complete``. Returns what rank 1 received (metadata, bucket) and both groups."""
    shared: dict = {}
    wire: deque = deque()
    sender, receiver = HcclGroup(0, shared), HcclGroup(1, shared)
    sent = torch.arange(4.0)
    received = torch.zeros(4)
    metadata = {"bucket_meta": {"w": {"offset": 0}}, "is_last": True}

    async def both() -> dict:
        operation = module.BroadcastOperation(0, sender, sent, metadata, Socket(wire), "bucket_metadata")
        await operation.wait_for_complete()
        operation = module.BroadcastOperation(1, receiver, received, None, Socket(wire), "bucket_metadata")
        return await operation.wait_for_complete()

    return asyncio.run(both()), received, [sender, receiver]


def test_on_0_9_0_the_broadcast_runs_on_a_pool_thread_and_fails_there(broadcast_operations: Any, device: Any) -> None:
    module = broadcast_operations("0.9.0")
    with pytest.raises(RuntimeError, match="HCCL error"):
        _sync(module)


def test_with_the_patch_0_9_0_broadcasts_on_the_calling_thread(
    broadcast_operations: Any, device: Any, engines: list
) -> None:
    module = broadcast_operations("0.9.0")
    engine = start(engines, [PATCH])
    assert record(engine, PATCH.name) == ("applied", "fix installed")

    metadata, received, groups = _sync(module)
    assert metadata == {"bucket_meta": {"w": {"offset": 0}}, "is_last": True}
    assert torch.equal(received, torch.arange(4.0))
    assert [g.threads for g in groups] == [[threading.get_ident()]] * 2

    engine.revert()
    with pytest.raises(RuntimeError, match="HCCL error"):
        _sync(module)


@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_the_other_releases_broadcast_on_the_calling_thread_and_are_left_alone(
    broadcast_operations: Any, device: Any, engines: list, version: str
) -> None:
    module = broadcast_operations(version)
    original = module.BroadcastOperation.__init__
    engine = start(engines, [PATCH])
    state, reason = record(engine, PATCH.name)
    assert (state, reason) == ("fixed-upstream", "BroadcastOperation.__init__ runs self._run() on the calling thread")
    assert module.BroadcastOperation.__init__ is original
    metadata, received, _ = _sync(module)
    assert metadata["is_last"] and torch.equal(received, torch.arange(4.0))
