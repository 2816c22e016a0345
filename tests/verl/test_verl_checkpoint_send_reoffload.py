"""``verl.checkpoint_send_reoffload`` on verl's real ``ActorRolloutRefWorker.update_weights``
(0.8.0 and 0.9.1, run from the release files; the worker's other methods and its Ray ``register``
decorator are left out). The worker's collaborators are recorders: the checkpoint engine, the
actor's training engine and ``aggressive_empty_cache``."""

from __future__ import annotations

import asyncio
import sys
import types
from typing import Any

import pytest

from tests.support import release_loaders, upstream
from tests.verl.helpers import record, start, verl_files
from verl_npu_autopatch.patches import verl_checkpoint_send_reoffload as reoffload

NAME = "verl.checkpoint_send_reoffload"


class TrainingEngine:
    def __init__(self, offload: bool, calls: list) -> None:
        self.is_param_offload_enabled, self.calls = offload, calls

    def get_per_tensor_param(self) -> tuple[Any, None]:
        self.calls.append("load and list the parameters")
        return iter([("w", 1)]), None

    def to(self, device: str, **what: bool) -> None:
        self.calls.append(("to", device, what))


class CheckpointEngine:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    async def send_weights(self, params: Any, global_steps: Any = None) -> dict:
        self.calls.append(("send", list(params), global_steps))
        return {"sent": 1}


def _worker(module: types.ModuleType, backend: str, offload: bool = True) -> tuple[Any, list]:
    calls: list = []
    worker = module.ActorRolloutRefWorker()
    rollout = types.SimpleNamespace(checkpoint_engine=types.SimpleNamespace(backend=backend))
    worker.config = types.SimpleNamespace(rollout=rollout)
    worker.actor = types.SimpleNamespace(engine=TrainingEngine(offload, calls))
    worker.checkpoint_engine = CheckpointEngine(calls)
    module.aggressive_empty_cache = lambda force_sync=False: calls.append(("empty cache", force_sync))
    return worker, calls


@release_loaders.loads(
    reoffload,
    "verl",
    ("0.8.0", "0.9.0", "0.9.1"),
    sites={"0.9.1": {f"{reoffload.MODULE}:ActorRolloutRefWorker.update_weights"}},
)
@pytest.fixture
def verl_workers(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install a release's ``engine_workers`` (only ``update_weights``) under its real name."""

    def install(version: str) -> types.ModuleType:
        path = verl_files(version) / "verl/workers/engine_workers.py"
        module = upstream.load_subset(path, reoffload.MODULE, {"ActorRolloutRefWorker": ("update_weights",)})
        monkeypatch.setitem(sys.modules, "verl", types.ModuleType("verl"))
        monkeypatch.setitem(sys.modules, reoffload.MODULE, module)
        return module

    return install


OFFLOADED = [("to", "cpu", {"model": True, "optimizer": False, "grad": False}), ("empty cache", True)]


@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_the_real_method_leaves_the_actor_on_the_device(verl_workers: Any, version: str) -> None:
    worker, calls = _worker(verl_workers(version), "nccl")
    asyncio.run(worker.update_weights(global_steps=3))
    assert calls == ["load and list the parameters", ("send", [("w", 1)], 3)]


@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_with_the_patch_the_actor_is_offloaded_after_the_send(verl_workers: Any, engines: list, version: str) -> None:
    module = verl_workers(version)
    engine = start(engines, reoffload.PATCHES)
    assert record(engine, NAME) == ("applied", "fix installed")

    worker, calls = _worker(module, "nccl")
    result = asyncio.run(worker.update_weights(global_steps=3))
    assert calls == ["load and list the parameters", ("send", [("w", 1)], 3), *OFFLOADED]
    assert result == ({"sent": 1} if version == "0.9.1" else None), "the original's result"

    explicit, calls = _worker(module, "naive")  # mode given: the checkpoint-engine path all the same
    asyncio.run(explicit.update_weights(global_steps=4, mode="hccl"))
    assert calls[-2:] == OFFLOADED

    resident, calls = _worker(module, "nccl", offload=False)
    asyncio.run(resident.update_weights(global_steps=5))
    assert calls == ["load and list the parameters", ("send", [("w", 1)], 5)], "no offload configured: untouched"

    engine.revert()
    worker, calls = _worker(module, "nccl")
    asyncio.run(worker.update_weights(global_steps=6))
    assert calls[-1] == ("send", [("w", 1)], 6)
