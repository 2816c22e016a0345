"""``ascend.sampler_record_stream`` on the releases' real ``vllm_ascend/sample/sampler.py``.

The module holds the release's own ``random_sample`` (``upstream.load_subset``: the file's name
and line numbers, so the check and the fix read the real release text) and the release's own
``npu_stream_switch`` from ``vllm_ascend/utils.py``; ``global_stream()`` returns the side-stream
double and ``probs`` is an :class:`~tests.ascend.streams.NpuTensor`, so the doubles record where
``q`` is allocated, the wait, and the streams ``q`` is recorded on.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import pytest
import torch

from tests.ascend import doubles, streams
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_sampler_record_stream

NAME = ascend_sampler_record_stream.SAMPLER
STATE = "ascend.sampler_record_stream"
MISSING = ("0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1")
FIXED = ("0.26.0rc1", "0.30.0rc2")
#: The releases whose files hold the sampler (older ones: ``unsupported`` in the table, no file to load).
RELEASES = ("0.21.0rc1", *MISSING, "0.26.0rc1", "0.27.1rc1", "0.30.0rc2")


def load_sampler(root) -> types.ModuleType:
    utils = upstream.load_subset(
        root / "vllm_ascend/utils.py",
        "vllm_ascend.utils",
        {},
        ("npu_stream_switch",),
        {"torch": torch, "nullcontext": contextlib.nullcontext},
    )
    return upstream.load_subset(
        root / "vllm_ascend/sample/sampler.py",
        NAME,
        {},
        ("random_sample",),
        {"torch": torch, "npu_stream_switch": utils.npu_stream_switch, "global_stream": lambda: streams.SIDE},
    )


SITES = {f"{NAME}:random_sample"}


@release_loaders.loads(
    ascend_sampler_record_stream,
    "vllm-ascend",
    RELEASES,
    sites=dict.fromkeys(("0.23.0", "0.25.1rc1"), SITES),
    param=True,
)
@pytest.fixture
def sampler(request, releases, npu, monkeypatch) -> Iterator[types.ModuleType]:
    streams.install(monkeypatch)
    module = load_sampler(releases[request.param][0])
    with doubles.alone_in_package(module):
        yield module


def sample(module: types.ModuleType) -> tuple[torch.Tensor, list[tuple[str, object]]]:
    """Sample 3 rows with seeded generators; the ids and the stream events."""
    probs = torch.softmax(torch.randn(3, 11, generator=torch.Generator().manual_seed(0)), -1).as_subclass(
        streams.NpuTensor
    )
    generators = {i: torch.Generator().manual_seed(10 + i) for i in range(3)}
    doubles.EVENTS.clear()
    ids = module.random_sample(probs, generators)
    return torch.as_tensor(ids).as_subclass(torch.Tensor), list(doubles.EVENTS)


@pytest.mark.parametrize("sampler", MISSING, indirect=True)
def test_release_frees_q_with_only_the_side_stream_knowing_it(sampler):
    _, events = sample(sampler)
    assert events == [("allocate", "side"), ("wait_stream", ("main", "side"))]


@pytest.mark.parametrize("sampler", MISSING, indirect=True)
def test_patched_random_sample_records_q_on_the_consuming_stream(sampler):
    original = sampler.random_sample
    expected, _ = sample(sampler)
    engine = upstream.run_engine(ascend_sampler_record_stream.PATCHES)
    assert engine.report()[STATE].state == "applied", engine.report()[STATE].reason
    assert sampler.random_sample is not original
    assert sampler.random_sample.__code__.co_filename == original.__code__.co_filename  # the release's file
    ids, events = sample(sampler)
    assert events == [("allocate", "side"), ("wait_stream", ("main", "side")), ("record_stream", "main")]
    assert torch.equal(ids, expected)  # the same draws, the same ids
    assert engine.revert() == [STATE]
    assert sampler.random_sample is original
    assert ("record_stream", "main") not in sample(sampler)[1]


@pytest.mark.parametrize("sampler", FIXED, indirect=True)
def test_fixed_upstream_where_the_release_records_q(sampler):
    original = sampler.random_sample
    record = upstream.run_engine(ascend_sampler_record_stream.PATCHES).report()[STATE]
    assert record.state == "fixed-upstream"
    assert "record_stream" in record.reason
    assert sampler.random_sample is original
    assert sample(sampler)[1].count(("record_stream", "main")) == 1


@pytest.mark.parametrize("sampler", ["0.23.0"], indirect=True)
def test_record_stream_double_refuses_what_torch_refuses(sampler):
    tensor = torch.zeros(2).as_subclass(streams.NpuTensor)
    with pytest.raises(TypeError, match="argument 's' must be Stream"):
        tensor.record_stream("main")
    assert streams.record_stream_arguments() == [("self", "Tensor"), ("s", "Stream")]
