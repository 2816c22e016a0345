"""``megatron.async_save_format`` on the real megatron-core and the installed torch (2.13, whose
``_write_item`` requires ``serialization_format``): the release's wheel is put on ``sys.path``, its
``FileSystemWriterAsync`` made as a save makes it, and its ``write_preloaded_data`` run in this
process on a real write bucket (a tensor and a bytes item planned by torch's own planner helper)
into a real file. The only stand-in: ``psutil`` (the writer's memory log reads it; the verl test
environment does not install it)."""

from __future__ import annotations

import io
import queue
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from tests.support import release_loaders
from tests.verl.helpers import forget_megatron, import_megatron, record, start
from verl_npu_autopatch.patches import megatron_async_save_format

NAME = "megatron.async_save_format"
TENSOR = torch.tensor([1.5, -2.0, 3.25, 7.0])
BYTES = b"a checkpoint's non-tensor state"


def _psutil() -> types.ModuleType:
    """What ``_process_memory`` reads: ``psutil.Process(pid).memory_info().rss``."""
    standin = types.ModuleType("psutil")
    info = types.SimpleNamespace(rss=0)
    standin.Process = lambda pid=None: types.SimpleNamespace(memory_info=lambda: info)  # type: ignore[attr-defined]
    return standin


@release_loaders.loads(
    megatron_async_save_format,
    "megatron-core",
    ("0.12.1", "0.13.1", "0.17.0"),
    sites={"0.12.1": {f"{megatron_async_save_format.MODULE}:_write_item"}},
)
@pytest.fixture
def megatron_writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Import a megatron-core release's ``filesystem_async`` from its wheel's files; forgets it after."""

    monkeypatch.setitem(sys.modules, "psutil", _psutil())
    yield lambda version: import_megatron(monkeypatch, version, megatron_async_save_format.MODULE)[0]
    forget_megatron()


def write(module: Any, folder: Path) -> Any:
    """Run the release's ``write_preloaded_data`` on one bucket, as its worker process does; returns
    what it reports: a list of ``WriteResult`` or the exception it caught."""
    writer = module.FileSystemWriterAsync(str(folder))
    transform_list = [writer.transforms] if hasattr(writer, "transforms") else []
    (tensor_item,) = _create_write_items("weight", TENSOR)
    (bytes_item,) = _create_write_items("state", io.BytesIO(BYTES))
    bucket = (folder / "__0_0.distcp", "__0_0.distcp", ([(bytes_item, io.BytesIO(BYTES))], [(tensor_item, TENSOR)]))
    results: queue.Queue = queue.Queue()
    count: queue.Queue = queue.Queue()
    count.put(0)
    module.FileSystemWriterAsync.write_preloaded_data(transform_list, 0, bucket, results, count, False)
    index, outcome = results.get_nowait()
    assert index == 0
    return outcome


def read_back(folder: Path, outcome: list) -> tuple[bytes, torch.Tensor]:
    """The bytes item and the tensor, read from the file at the places the results name."""
    data = (folder / "__0_0.distcp").read_bytes()
    by_name = {r.index.fqn: r.storage_data for r in outcome}
    state, weight = by_name["state"], by_name["weight"]
    raw = data[state.offset : state.offset + state.length]
    tensor = torch.load(io.BytesIO(data[weight.offset : weight.offset + weight.length]), weights_only=True)
    return raw, tensor


def test_the_real_0_12_1_writer_fails_every_item_on_this_torch(megatron_writer: Any, tmp_path: Path) -> None:
    module = megatron_writer("0.12.1")
    outcome = write(module, tmp_path)
    assert isinstance(outcome, TypeError) and "serialization_format" in str(outcome)


def test_with_the_patch_the_0_12_1_writer_saves_both_items(megatron_writer: Any, engines: list, tmp_path: Path) -> None:
    module = megatron_writer("0.12.1")
    original = module._write_item
    engine = start(engines, megatron_async_save_format.PATCHES)
    assert record(engine, NAME) == ("applied", "fix installed")

    raw, tensor = read_back(tmp_path, write(module, tmp_path))
    assert raw == BYTES
    assert torch.equal(tensor, TENSOR)

    engine.revert()
    assert module._write_item is original
    assert isinstance(write(module, tmp_path), TypeError)


def test_an_argument_the_caller_gives_goes_through() -> None:
    import torch.distributed.checkpoint.filesystem as filesystem

    seen: list[Any] = []

    def spy(transforms: Any, stream: Any, data: Any, write_item: Any, key: str, serialization_format: Any) -> None:
        seen.append(serialization_format)

    spy.__module__ = filesystem.__name__  # where the wrapper finds SerializationFormat
    site: Any = None
    wrapped = megatron_async_save_format.with_format(site, spy)
    formats = filesystem.SerializationFormat
    wrapped(None, None, None, None, "key")
    wrapped(None, None, None, None, "key", formats.SAFETENSORS)
    wrapped(None, None, None, None, "key", serialization_format=formats.SAFETENSORS)
    assert seen == [formats.TORCH_SAVE, formats.SAFETENSORS, formats.SAFETENSORS]


def test_0_13_1_passes_the_argument_itself(megatron_writer: Any, engines: list, tmp_path: Path) -> None:
    module = megatron_writer("0.13.1")
    raw, tensor = read_back(tmp_path, write(module, tmp_path))
    assert (raw, tensor.tolist()) == (BYTES, TENSOR.tolist())
    engine = start(engines, megatron_async_save_format.PATCHES)
    state, reason = record(engine, NAME)
    assert state == "fixed-upstream" and "passes serialization_format" in reason
