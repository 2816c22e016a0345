"""TEST DOUBLES of torch_npu's stream API (``torch.npu.Stream``, ``current_stream``, ``stream``)
and of an NPU tensor's stream bookkeeping, for code that moves work to a side stream.

On a CPU host every operation runs at once, so no race can be shown; what the doubles record is
the contract the caching allocator relies on: which stream a tensor was allocated on
(``torch.empty_like`` under ``torch.npu.stream(s)``) and which streams it was recorded on
(``Tensor.record_stream``, bound to the installed torch's own ``aten::record_stream`` schema).
Events go to ``tests.ascend.doubles.EVENTS``. None of it is used outside tests.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.ascend import doubles


class Stream:
    """TEST DOUBLE of ``torch.npu.Stream``: a named stream; ``wait_stream`` records the wait."""

    def __init__(self, name: str = "stream") -> None:
        self.name = name

    def wait_stream(self, other: Stream) -> None:
        doubles.EVENTS.append(("wait_stream", (self.name, other.name)))

    def __repr__(self) -> str:
        return f"Stream({self.name!r})"


#: The stream work goes to now (``current_stream()``), and vllm-ascend's side stream.
CURRENT = {"stream": Stream("main")}
SIDE = Stream("side")


def current_stream(device: Any = None) -> Stream:
    """TEST DOUBLE of ``torch.npu.current_stream``."""
    return CURRENT["stream"]


@contextmanager
def stream(target: Stream) -> Iterator[None]:
    """TEST DOUBLE of ``torch.npu.stream``: work inside the block goes to ``target``."""
    before = CURRENT["stream"]
    CURRENT["stream"] = target
    try:
        yield
    finally:
        CURRENT["stream"] = before


@functools.cache
def record_stream_arguments() -> list[tuple[str, str]]:
    """``[(name, type)]`` of the installed torch's ``aten::record_stream`` schema."""
    return [(a.name, str(a.type)) for a in torch.ops.aten.record_stream.default._schema.arguments]


class NpuTensor(torch.Tensor):
    """A CPU tensor standing for an NPU one: ``torch.empty_like`` records the stream the block was
    allocated on; ``record_stream`` records the stream it is recorded on, after checking its
    argument against the real schema (``TypeError`` for anything but a stream, as torch raises)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.empty_like:
            doubles.EVENTS.append(("allocate", CURRENT["stream"].name))
        return result

    def record_stream(self, s: Any) -> None:  # type: ignore[override]
        names = [name for name, _ in record_stream_arguments()]
        assert names == ["self", "s"] and record_stream_arguments()[1][1] == "Stream", record_stream_arguments()
        if not isinstance(s, Stream):
            raise TypeError(f"record_stream(): argument 's' must be Stream, not {type(s).__name__}")
        doubles.EVENTS.append(("record_stream", s.name))


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put the stream doubles on the ``torch.npu`` double (installed by the ``npu`` fixture)."""
    CURRENT["stream"] = Stream("main")
    monkeypatch.setattr(torch.npu, "Stream", Stream, raising=False)
    monkeypatch.setattr(torch.npu, "current_stream", current_stream, raising=False)
    monkeypatch.setattr(torch.npu, "stream", stream, raising=False)
