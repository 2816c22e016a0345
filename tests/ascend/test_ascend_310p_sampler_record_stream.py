"""``ascend.310p_sampler_record_stream`` on the releases' real ``vllm_ascend/_310p/sample/sampler.py``.

The module holds every top-level function of the release's file (``upstream.load_subset``: the
file's name and line numbers, so the check and the fix read the real release text) and the
release's own ``npu_stream_switch``; ``global_stream()`` returns the side-stream double. The
device is doubled: ``probs`` is an :class:`Npu` tensor (a CPU tensor recording the stream its
device blocks are allocated on), ``.cpu()`` gives a :class:`Host` tensor whose ``.npu()`` /
``.to(device)`` is a device copy allocated on the current stream, and ``torch.rand`` ignores
``pin_memory`` (no pinned memory on a CPU host).
"""

from __future__ import annotations

import ast
import contextlib
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.ascend import doubles, streams
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import _side_stream
from verl_npu_autopatch.patches import ascend_310p_sampler_record_stream as family

NAME = family.SAMPLER
STATE = "ascend.310p_sampler_record_stream"
ENABLE = {"VERL_NPU_AUTOPATCH_ENABLE": "310p"}
#: The releases whose files hold the 310P sampler (0.13.0 has none), by shape.
Q_SHAPE = ("0.18.0", "0.21.0rc1", "0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1")
UNIFORMS_SHAPE = ("0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc2")
RELEASES = (*Q_SHAPE, *UNIFORMS_SHAPE)


def _to_device(tensor: torch.Tensor) -> Npu:
    doubles.EVENTS.append(("allocate", streams.CURRENT["stream"].name))
    return tensor.as_subclass(torch.Tensor).clone().as_subclass(Npu)


class Npu(streams.NpuTensor):
    """TEST DOUBLE of an NPU tensor whose ``.cpu()`` is a host copy."""

    def cpu(self, *args: Any, **kwargs: Any) -> Host:  # type: ignore[override]
        return self.as_subclass(torch.Tensor).clone().as_subclass(Host)


class Host(torch.Tensor):
    """TEST DOUBLE of a host tensor whose copy to the device is allocated on the current stream."""

    def npu(self, *args: Any, **kwargs: Any) -> Npu:  # type: ignore[override]
        return _to_device(self)

    def to(self, *args: Any, **kwargs: Any) -> Npu:  # type: ignore[override]
        return _to_device(self)


class _Torch(types.ModuleType):
    """``torch`` as the release's functions see it: ``rand`` makes host tensors, without pinning."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def rand(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Host:
        return torch.rand(*args, **kwargs).as_subclass(Host)


def load_sampler(root, path=None) -> types.ModuleType:
    utils = upstream.load_subset(
        root / "vllm_ascend/utils.py",
        "vllm_ascend.utils",
        {},
        ("npu_stream_switch",),
        {"torch": torch, "nullcontext": contextlib.nullcontext},
    )
    path = path or root / "vllm_ascend/_310p/sample/sampler.py"
    functions = tuple(n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef))
    namespace = {
        "torch": _Torch("torch"),
        "npu_stream_switch": utils.npu_stream_switch,
        "global_stream": lambda: streams.SIDE,
        "_CPU_GENERATOR_CACHE_310P": {},
    }
    return upstream.load_subset(path, NAME, {}, functions, namespace)


@release_loaders.loads(
    family,
    "vllm-ascend",
    RELEASES,
    sites={label: {f"{NAME}:_random_sample_310p"} for label in ("0.18.0", "0.25.1rc1", "0.30.0rc2")},
    param=True,
)
@pytest.fixture
def sampler_310p(request, releases, npu, monkeypatch) -> Iterator[types.ModuleType]:
    streams.install(monkeypatch)
    module = load_sampler(releases[request.param][0])
    with doubles.alone_in_package(module):
        yield module


def sample(module: types.ModuleType) -> tuple[torch.Tensor, list[tuple[str, object]]]:
    """Sample 3 rows with seeded generators; the ids and the stream events."""
    probs = torch.softmax(torch.randn(3, 11, generator=torch.Generator().manual_seed(0)), -1).as_subclass(Npu)
    generators = {i: torch.Generator().manual_seed(10 + i) for i in range(3)}
    module._CPU_GENERATOR_CACHE_310P.clear()
    doubles.EVENTS.clear()
    ids = getattr(module, family.FUNCTION)(probs, generators)
    return torch.as_tensor(ids).as_subclass(torch.Tensor), list(doubles.EVENTS)


def made(label: str) -> list[tuple[str, object]]:
    """The release's events up to the wait: where its tensors are allocated."""
    side = [("allocate", "side")] * (2 if label in Q_SHAPE else 1)  # q: empty_like and the device copy
    return [*side, ("wait_stream", ("main", "side"))]


@pytest.mark.parametrize("sampler_310p", RELEASES, indirect=True)
def test_release_frees_its_tensor_with_only_the_side_stream_knowing_it(sampler_310p, request):
    _, events = sample(sampler_310p)
    assert events == made(request.node.callspec.params["sampler_310p"])


@pytest.mark.parametrize("sampler_310p", RELEASES, indirect=True)
def test_patched_sampler_records_its_tensor_on_the_consuming_stream(sampler_310p, request):
    original = getattr(sampler_310p, family.FUNCTION)
    expected, _ = sample(sampler_310p)
    engine = upstream.run_engine(family.PATCHES, **ENABLE)
    assert engine.report()[STATE].state == "applied", engine.report()[STATE].reason
    patched = getattr(sampler_310p, family.FUNCTION)
    assert patched is not original
    assert patched.__code__.co_filename == original.__code__.co_filename  # the release's file
    ids, events = sample(sampler_310p)
    assert events == [*made(request.node.callspec.params["sampler_310p"]), ("record_stream", "main")]
    assert torch.equal(ids, expected)  # the same draws, the same ids
    assert engine.revert() == [STATE]
    assert getattr(sampler_310p, family.FUNCTION) is original
    assert ("record_stream", "main") not in sample(sampler_310p)[1]


@pytest.mark.parametrize("sampler_310p", ["0.23.0", "0.30.0rc2"], indirect=True)
def test_off_by_default(sampler_310p):
    original = getattr(sampler_310p, family.FUNCTION)
    assert upstream.run_engine(family.PATCHES).report()[STATE].state == "disabled"
    assert getattr(sampler_310p, family.FUNCTION) is original


@pytest.mark.parametrize("label", ["0.25.1rc1", "0.30.0rc2"])
def test_fixed_upstream_where_the_function_records_its_tensor(label, releases, npu, monkeypatch, tmp_path):
    """The release's file with upstream's fix written in (one line after the wait, as
    ``random_sample`` has it from 0.26.0rc1)."""
    streams.install(monkeypatch)
    root = releases[label][0]
    tensor = "q" if label in Q_SHAPE else "uniforms"
    lines = (root / "vllm_ascend/_310p/sample/sampler.py").read_text().splitlines(keepends=True)
    (wait,) = [i for i, line in enumerate(lines) if "".join(line.split()) == _side_stream.WAIT]
    lines.insert(wait + 1, f"    {_side_stream.record(tensor)}\n")
    fixed = tmp_path / "sampler.py"
    fixed.write_text("".join(lines))
    with doubles.alone_in_package(load_sampler(root, fixed)) as module:
        original = getattr(module, family.FUNCTION)
        record = upstream.run_engine(family.PATCHES, **ENABLE).report()[STATE]
        assert record.state == "fixed-upstream", record.reason
        assert _side_stream.record(tensor) in record.reason
        assert getattr(module, family.FUNCTION) is original
        assert sample(module)[1].count(("record_stream", "main")) == 1


@pytest.mark.parametrize("sampler_310p", ["0.30.0rc2"], indirect=True)
def test_unsupported_where_the_helper_makes_no_device_copy(sampler_310p, monkeypatch):
    def helper(batch_size, generators, device):  # a host tensor: nothing to record on the device
        return torch.rand(batch_size)

    monkeypatch.setattr(sampler_310p, family.UNIFORMS_HELPER, helper)
    original = getattr(sampler_310p, family.FUNCTION)
    record = upstream.run_engine(family.PATCHES, **ENABLE).report()[STATE]
    assert record.state == "unsupported"
    assert family.UNIFORMS_HELPER in record.reason
    assert getattr(sampler_310p, family.FUNCTION) is original
