"""``ascend.dispatcher_expert_ids_sleep`` on the releases' real ``token_dispatcher.py``, ``camem.py`` and
``worker.py``: a level-2 sleep and wake-up loses the All2AllV dispatcher's ``expert_ids_per_ep_rank``
(tokens go to the wrong local experts) without the patch, and keeps it with it.

Release code run: ``camem.py`` whole (``CaMemAllocator.sleep`` / ``wake_up``); ``NPUWorker.sleep`` and
``wake_up`` (``upstream.load_subset``, as the Mooncake re-registration test loads them); the
dispatcher's ``MoETokenDispatcher.__init__``, ``TokenDispatcherWithAll2AllV.__init__`` and
``_preprocess`` (the release's lines, its generic base named plainly).
TEST DOUBLES, for the device only: ``torch.npu`` (``current_device`` is the CPU), the compiled CaMem
calls (``unmap_and_release`` drops the mapping; ``create_and_map`` maps new physical memory at the
same address, whose contents are undefined: zeroed here), the EP group (rank 1 of 2, its HCCL name)
and ``gather_from_sequence_parallel_region`` (every EP rank routed as this one). What the pluggable
allocator would record while the model loads under the ``weights`` pool is put into
``pointer_to_data`` by hand: the dispatcher's tensor and a model buffer.
"""

from __future__ import annotations

import ast
import ctypes
import logging
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_dispatcher_expert_ids_sleep as family

STATE = "ascend.dispatcher_expert_ids_sleep"
GROUP = "sleep_level2"
WORKER = "vllm_ascend.worker.worker"
PACKAGES = ("vllm_ascend.device_allocator", "vllm_ascend.ops", "vllm_ascend.ops.fused_moe", "vllm_ascend.worker")
RELEASES = ("0.23.0.post1", "0.26.0rc1")
#: 8 experts over 2 EP ranks: rank 1 holds experts 4..7 (local 0..3).
EXPERTS, EP_SIZE, EP_RANK = 8, 2, 1
TOPK_IDS = torch.tensor([[4, 5], [6, 7], [1, 5]])
#: The local expert of every token rank 1 receives (from both ranks, in expert order).
RIGHT = [0, 1, 1, 2, 3] * EP_SIZE


def load_dispatcher(path: Path) -> types.ModuleType:
    """The release's ``MoETokenDispatcher.__init__`` and ``TokenDispatcherWithAll2AllV``'s
    ``__init__`` and ``_preprocess``, with the file's name and line numbers."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    keep = {"MoETokenDispatcher": ("__init__",), "TokenDispatcherWithAll2AllV": ("__init__", "_preprocess")}
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in keep:
            node.body = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in keep[node.name]]
            base = [ast.Name("MoETokenDispatcher", ast.Load())] if node.name != "MoETokenDispatcher" else []
            node.bases, node.keywords, node.decorator_list = base, [], []
            body.append(node)
    module = types.ModuleType(family.DISPATCHER)
    module.__file__ = str(path)
    module.__dict__.update(torch=_Torch(), gather_from_sequence_parallel_region=_gathered)
    exec(compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), str(path), "exec"), module.__dict__)
    module.MoETokenDispatcher.ep_rank, module.MoETokenDispatcher.ep_size = EP_RANK, EP_SIZE
    module.MoETokenDispatcher.ep_group = _EPGroup()
    return module


class _Torch:
    """The file's ``torch``: the real one, except two TEST DOUBLES: ``torch.device("npu")`` names the
    NPU (CPU torch knows no such device type), and ``histc`` counts integer ids as the NPU kernel does
    (CPU torch has no integer histogram)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def device(kind: str) -> Any:
        return "npu" if kind == "npu" else torch.device(kind)

    @staticmethod
    def histc(ids: torch.Tensor, bins: int, min: int, max: int) -> torch.Tensor:
        return torch.histc(ids.float(), bins=bins, min=min, max=max).to(ids.dtype)


class _EPGroup:
    """TEST DOUBLE: the EP device group (its HCCL backend names the communicator)."""

    def _get_backend(self, device: Any) -> Any:
        return types.SimpleNamespace(get_hccl_comm_name=lambda rank: f"hccl-ep-{rank}")


def _gathered(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """TEST DOUBLE of the EP all-gather: every rank routed its tokens as this one."""
    return torch.cat([counts] * EP_SIZE)


def load_worker(root: Path, allocator_class: type) -> types.ModuleType:
    config = types.SimpleNamespace(weight_nz_mode=0, enable_sleep_mode_extra_cleanup=False)
    namespace = {
        "Any": Any,
        "CaMemAllocator": allocator_class,
        "GiB_bytes": 1 << 30,
        "get_ascend_config": lambda: config,
        "logger": logging.getLogger("tests.worker"),
        "torch": types.SimpleNamespace(npu=types.SimpleNamespace(mem_get_info=lambda: (1 << 30, 1 << 31))),
    }
    return upstream.load_subset(
        root / "vllm_ascend/worker/worker.py", WORKER, {"NPUWorker": ("sleep", "wake_up")}, (), namespace
    )


@release_loaders.loads(
    family,
    "vllm-ascend",
    RELEASES,
    sites={
        label: {f"{family.DISPATCHER}:TokenDispatcherWithAll2AllV.__init__", f"{family.CAMEM}:CaMemAllocator.wake_up"}
        for label in RELEASES
    },
    param=True,
)
@pytest.fixture
def dispatching(request, releases, npu, monkeypatch) -> Iterator[types.SimpleNamespace]:
    root = releases[request.param][0]
    torch.npu.current_device = lambda: "cpu"  # the doubles' torch.npu: the CPU is the device
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: EP_RANK)
    camem = upstream.load_file(root / "vllm_ascend/device_allocator/camem.py", family.CAMEM)
    camem.python_unmap_and_release = lambda device, size, ptr, handle: None
    camem.python_create_and_map = lambda device, size, ptr, handle: ctypes.memset(ptr, 0, size)
    dispatcher = load_dispatcher(root / "vllm_ascend/ops/fused_moe/token_dispatcher.py")
    worker = load_worker(root, camem.CaMemAllocator)
    stubs = {
        name: doubles.stub_module(name, "TEST DOUBLE: a package holding the tested module only") for name in PACKAGES
    }
    for stub in stubs.values():
        stub.__path__ = []  # type: ignore[attr-defined]
    loaded = {family.CAMEM: camem, family.DISPATCHER: dispatcher, WORKER: worker}
    with doubles.modules({**stubs, **loaded}):
        yield types.SimpleNamespace(camem=camem, dispatcher=dispatcher, worker=worker)


def loaded_model(setup: types.SimpleNamespace) -> tuple[Any, Any, Any]:
    """``(worker, dispatcher, model)`` after the model loaded under CaMem's ``weights`` pool."""
    dispatcher = setup.dispatcher.TokenDispatcherWithAll2AllV(
        top_k=2, num_experts=EXPERTS, num_local_experts=EXPERTS // EP_SIZE
    )
    model = torch.nn.Module()
    model.register_buffer("bias", torch.arange(4, dtype=torch.float32))
    allocator = setup.camem.CaMemAllocator.get_instance()
    allocator.pointer_to_data.clear()
    for tensor in (dispatcher.expert_ids_per_ep_rank, model.bias):
        ptr, size = tensor.data_ptr(), tensor.untyped_storage().nbytes()
        allocator.pointer_to_data[ptr] = setup.camem.AllocationData((0, size, ptr, ptr), "weights")
    worker = object.__new__(setup.worker.NPUWorker)
    worker.model_runner = types.SimpleNamespace(model=model, post_kv_cache_wake_up=lambda: None)
    worker.vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(hidden_size=8)), quant_config=None
    )
    worker._sleep_saved_buffers = {}
    return worker, dispatcher, model


def routed(dispatcher: Any) -> list[int]:
    """The local expert of every token this rank receives (the release's ``_preprocess``)."""
    return dispatcher._preprocess(TOPK_IDS)[3].tolist()


def level_2_cycle(worker: Any) -> None:
    """verl's rollout cycle at level 2: sleep, then wake the weights (reloaded), then the KV cache."""
    worker.sleep(2)
    worker.wake_up(["weights"])
    worker.wake_up(["kv_cache"])


@pytest.mark.parametrize("dispatching", RELEASES, indirect=True)
def test_release_loses_the_dispatcher_state_at_level_2(dispatching: types.SimpleNamespace) -> None:
    worker, dispatcher, model = loaded_model(dispatching)
    assert routed(dispatcher) == RIGHT
    level_2_cycle(worker)
    assert model.bias.tolist() == [0.0, 1.0, 2.0, 3.0], "the release restores the model's buffers"
    assert dispatcher.expert_ids_per_ep_rank.tolist() == [0] * EXPERTS
    assert routed(dispatcher) == [0] * len(RIGHT), "every token goes to local expert 0"


@pytest.mark.parametrize("dispatching", RELEASES, indirect=True)
def test_with_the_patch_tokens_reach_the_right_local_experts(dispatching: types.SimpleNamespace) -> None:
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE=GROUP)
    record = engine.report()[STATE]
    assert (record.state, record.reason) == ("applied", "fix installed")
    worker, dispatcher, _ = loaded_model(dispatching)
    address = dispatcher.expert_ids_per_ep_rank.data_ptr()
    worker.sleep(2)
    worker.wake_up(["kv_cache"])
    worker.wake_up(["weights"])
    assert routed(dispatcher) == RIGHT
    assert dispatcher.expert_ids_per_ep_rank.data_ptr() == address, "restored in place (graphs keep the address)"
    assert engine.revert() == [STATE]
    level_2_cycle(worker)
    assert routed(dispatcher) == [0] * len(RIGHT), "the release's behaviour is back"


@pytest.mark.parametrize("dispatching", ["0.27.1rc1"], indirect=True)
def test_release_0_27_is_fixed_upstream(dispatching: types.SimpleNamespace, releases) -> None:
    path = releases["0.27.1rc1"][0] / "vllm_ascend/ops/fused_moe/fused_moe.py"
    runner = doubles.stub_module(family.FUSED_MOE, "TEST DOUBLE: names the release's file only")
    runner.__file__ = str(path)
    init = dispatching.dispatcher.TokenDispatcherWithAll2AllV.__dict__["__init__"]
    with doubles.modules({family.FUSED_MOE: runner}):
        engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE=GROUP)
        record = engine.report()[STATE]
    assert record.state == "fixed-upstream" and "register_buffer" in record.reason
    assert dispatching.dispatcher.TokenDispatcherWithAll2AllV.__dict__["__init__"] is init


@pytest.mark.parametrize("dispatching", ["0.26.0rc1"], indirect=True)
def test_opt_in_off_by_default(dispatching: types.SimpleNamespace) -> None:
    engine = upstream.run_engine(family.PATCHES)
    assert engine.report()[STATE].state == "disabled"
