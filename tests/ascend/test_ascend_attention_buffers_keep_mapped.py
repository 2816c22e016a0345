"""``ascend.attention_buffers_keep_mapped`` on the releases' real ``camem.py``, ``attention/utils.py``
and ``worker.py``: DeepSeek-V4's Hadamard matrix, made inside the KV-cache pool, cannot be restored
by verl's staged wake-up without the patch (ACL error 507899), and is with it.

Release code run: ``camem.py`` whole (``CaMemAllocator``), ``get_or_register_attention_buffer``
and ``NPUWorker.sleep`` / ``wake_up`` (``upstream.load_subset``: the files' names and line numbers),
with the worker's own ``_allowed_names`` read from its file. TEST DOUBLES, for the device only
(``doubles``): the compiled CaMem calls (``unmap_and_release`` / ``create_and_map`` keep the set of
unmapped ranges) and device tensors (``DeviceTensor``: an op on an unmapped address raises 507899).
What the caching allocator does inside ``use_memory_pool(tag="kv_cache")`` is played by hand: one
64 KiB segment the pluggable allocator recorded with the ``kv_cache`` tag, from which the builder's
earlier metadata and then the Hadamard matrix are carved (a small tensor shares the segment).
"""

from __future__ import annotations

import ast
import logging
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_attention_buffers_keep_mapped as family

STATE = "ascend.attention_buffers_keep_mapped"
#: Every release whose files hold the function (older ones: ``unsupported`` in the table).
RELEASES = ("0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc2")
SEGMENT, DIM = 64 << 10, 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
PACKAGES = ("vllm_ascend.attention", "vllm_ascend.device_allocator", "vllm_ascend.worker")
COPIER = family.COPIERS[0]


def _allowed_names(path: Path) -> Any:
    """The worker file's own ``_allowed_names`` (the buffers level 1 saves)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_allowed_names"]:
            return ast.literal_eval(node.value)
    return ()


def load_worker(root: Path, allocator_class: type) -> types.ModuleType:
    path = root / family.module_file(family.WORKER)
    config = types.SimpleNamespace(
        weight_nz_mode=0, rl_config=types.SimpleNamespace(enabled=False, sleep_mode_extra_cleanup=False)
    )
    namespace = {
        "Any": Any,
        "CaMemAllocator": allocator_class,
        "GiB_bytes": 1 << 30,
        "_allowed_names": _allowed_names(path),
        "get_ascend_config": lambda: config,
        "logger": logging.getLogger("tests.worker"),
        "torch": types.SimpleNamespace(npu=types.SimpleNamespace(mem_get_info=lambda: (1 << 30, 1 << 31))),
    }
    worker = upstream.load_subset(path, family.WORKER, {"NPUWorker": ("sleep", "wake_up")}, (), namespace)
    worker.__file__ = str(path)  # the patch reads initialize_from_config from the worker's file
    return worker


def load_utils(root: Path) -> types.ModuleType:
    namespace = {"torch": torch, "Callable": Callable, "VllmConfig": Any}
    return upstream.load_subset(
        root / family.module_file(family.UTILS), family.UTILS, {}, (family.FUNCTION,), namespace
    )


@release_loaders.loads(
    family,
    "vllm-ascend",
    RELEASES,
    # the function and the DSA module's ``from ... import`` copy of it (Reach.copies_in)
    sites={"0.27.1rc1": {f"{module}:{family.FUNCTION}" for module in (family.UTILS, family.COPIERS[0])}},
    param=True,
)
@pytest.fixture
def camem_buffers(request, releases, npu) -> Iterator[types.SimpleNamespace]:
    root = releases[request.param][0]
    camem = upstream.load_file(root / family.module_file(family.CAMEM), family.CAMEM)
    camem.python_unmap_and_release = doubles.unmap_and_release
    camem.python_create_and_map = doubles.create_and_map
    camem.CaMemAllocator.instance = None
    utils, worker = load_utils(root), load_worker(root, camem.CaMemAllocator)
    stubs = {name: doubles.stub_module(name, "TEST DOUBLE: holds the tested module only") for name in PACKAGES}
    for stub in stubs.values():
        stub.__path__ = []  # type: ignore[attr-defined]
    # TEST DOUBLE of the DSA module as imported before the patch: only its ``from ... import`` copy
    dsa = doubles.stub_module(COPIER, "TEST DOUBLE: holds the function as its from-import copied it")
    dsa.get_or_register_attention_buffer = utils.get_or_register_attention_buffer
    loaded = {family.CAMEM: camem, family.UTILS: utils, family.WORKER: worker, COPIER: dsa}
    with doubles.modules({**stubs, **loaded}):
        yield types.SimpleNamespace(camem=camem, utils=utils, worker=worker, dsa=dsa)


def hadamard(n: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order ``n`` (a power of two), as the builders make it."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < n:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix.to(torch.bfloat16)


def start_up(setup: types.SimpleNamespace) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``(worker, matrix, metadata)`` after ``initialize_kv_cache`` built the DSA metadata builder
    in the ``kv_cache`` pool: the builder's metadata first, then the Hadamard matrix, from one segment."""
    allocator = setup.camem.CaMemAllocator.get_instance()
    segment = torch.zeros(SEGMENT, dtype=torch.uint8)
    start = segment.data_ptr()
    allocator.pointer_to_data[start] = setup.camem.AllocationData((0, SEGMENT, start, start), "kv_cache")
    metadata = segment[:1024].view(torch.int32).as_subclass(doubles.DeviceTensor)
    metadata.copy_(torch.arange(256, dtype=torch.int32))

    def factory() -> torch.Tensor:
        matrix = segment[4096 : 4096 + DIM * DIM * 2].view(torch.bfloat16).view(DIM, DIM)
        return matrix.copy_(hadamard(DIM)).as_subclass(doubles.DeviceTensor)

    model = torch.nn.Module()
    attention = {name: torch.nn.Module() for name in LAYERS}
    model.layers = torch.nn.ModuleList(attention.values())
    vllm_config = types.SimpleNamespace(compilation_config=types.SimpleNamespace(static_forward_context=attention))
    matrix = setup.utils.get_or_register_attention_buffer(vllm_config, list(LAYERS), "_dsa_hadamard", factory)
    worker = object.__new__(setup.worker.NPUWorker)
    worker.model_runner = types.SimpleNamespace(model=model, post_kv_cache_wake_up=lambda: None)
    worker._sleep_saved_buffers = {}
    worker._keep = segment  # the segment lives as long as the worker (the pool keeps it in the release)
    return worker, matrix, metadata


def staged_cycle(worker: Any, level: int) -> None:
    """verl's rollout cycle: sleep, wake the weights (then sync them), then the KV cache."""
    worker.sleep(level)
    worker.wake_up(["weights"])
    worker.wake_up(["kv_cache"])


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("camem_buffers", ["0.27.1rc1"], indirect=True)
def test_release_restore_writes_into_the_unmapped_kv_cache_pool(camem_buffers, level):
    worker, matrix, _ = start_up(camem_buffers)
    worker.sleep(level)
    assert set(doubles.UNMAPPED) == {matrix.untyped_storage().data_ptr()}
    with pytest.raises(RuntimeError, match="507899: copy_ on unmapped"):
        worker.wake_up(["weights"])


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("camem_buffers", ["0.27.1rc1"], indirect=True)
def test_patched_buffers_stay_mapped_and_restore(camem_buffers, level):
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert engine.report()[STATE].state == "applied", engine.report()[STATE].reason
    worker, matrix, metadata = start_up(camem_buffers)
    address = matrix.data_ptr()
    staged_cycle(worker, level)
    assert doubles.UNMAPPED == {}
    assert matrix.data_ptr() == address, "captured graphs keep reading the same matrix"
    assert torch.equal(matrix, hadamard(DIM))
    assert torch.equal(metadata, torch.arange(256, dtype=torch.int32)), "the segment's other tensors keep theirs"
    staged_cycle(worker, level)
    assert torch.equal(matrix, hadamard(DIM))
    assert engine.revert() == [STATE]
    worker, _, _ = start_up(camem_buffers)
    worker.sleep(level)
    with pytest.raises(RuntimeError, match="507899: copy_ on unmapped"):
        worker.wake_up(["weights"])


@pytest.mark.parametrize("camem_buffers", ["0.27.1rc1"], indirect=True)
def test_the_dsa_module_copy_is_rebound_and_put_back(camem_buffers):
    original = camem_buffers.dsa.get_or_register_attention_buffer
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert camem_buffers.dsa.get_or_register_attention_buffer is camem_buffers.utils.get_or_register_attention_buffer
    assert camem_buffers.dsa.get_or_register_attention_buffer is not original
    engine.revert()
    assert camem_buffers.dsa.get_or_register_attention_buffer is original


@pytest.mark.parametrize("camem_buffers", ["0.27.1rc1"], indirect=True)
def test_the_kv_cache_itself_is_still_released(camem_buffers):
    """Only the allocation holding a buffer is kept: a KV-cache tensor's allocation is released at sleep."""
    upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    worker, matrix, _ = start_up(camem_buffers)
    cache = torch.zeros(4096, dtype=torch.uint8)
    allocator = camem_buffers.camem.CaMemAllocator.get_instance()
    allocator.pointer_to_data[cache.data_ptr()] = camem_buffers.camem.AllocationData(
        (0, 4096, cache.data_ptr(), 0), "kv_cache"
    )
    worker.sleep(1)
    assert set(doubles.UNMAPPED) == {cache.data_ptr()}
    worker.wake_up(["weights"])
    worker.wake_up(["kv_cache"])
    assert doubles.UNMAPPED == {} and torch.equal(matrix, hadamard(DIM))


@pytest.mark.parametrize("camem_buffers", ["0.27.1rc1"], indirect=True)
def test_without_sleep_mode_nothing_is_tagged(camem_buffers):
    """No CaMem allocator was made (``enable_sleep_mode`` off): the buffer is left as the release made it."""
    upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert family.keep_mapped(torch.zeros(4)) is False
    assert camem_buffers.camem.CaMemAllocator.instance is None


@pytest.mark.parametrize("camem_buffers", ["0.28.0rc1", "0.30.0rc2"], indirect=True)
def test_fixed_releases_keep_the_buffers_outside_the_pool(camem_buffers):
    original = camem_buffers.utils.get_or_register_attention_buffer
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    record = engine.report()[STATE]
    assert record.state == "fixed-upstream"
    assert "kv_cache_allocation_context" in record.reason
    assert camem_buffers.utils.get_or_register_attention_buffer is original


@pytest.mark.parametrize("camem_buffers", ["0.27.1rc1"], indirect=True)
def test_opt_in_off_by_default(camem_buffers):
    engine = upstream.run_engine(family.PATCHES)
    assert engine.report()[STATE].state == "disabled"
