"""Our NPU op calls are the calls verl's hardware-run ``npu_patch`` (release 0.9.1) makes.

For every family verl also patches, a tiny model runs forward and backward once with verl's kernels
and once with ours (only the kinds verl patches), in fp32 and bf16; the torch_npu test double
records every call as the op receives it (op, every bound argument, tensors as shape, dtype and
strides). Per op the two call sequences must be equal, except for the entries of :data:`ALLOWED`,
each with its reason; there our calls must still use only call *forms* verl uses (the same
non-tensor arguments, and tensors of the same rank, dtype and layout: row-major, transposed or
other strides).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from tests.hf import npu_emulation
from tests.hf.conftest import PRESENT, VERL_OWNS, builders, randomize, restored
from verl_npu_autopatch.patches import transformers_npu

FUSED_GATE_UP = (
    "one grouped matmul over the fused gate/up weight [E, H, 2I] where verl runs two over [E, H, I] (up, "
    "then gate) and concatenates; verl itself fuses them for Qwen3-VL-MoE and Qwen3.5-MoE"
)
#: (family, op) -> why our calls of that op differ from verl's.
ALLOWED: dict[tuple[str, str], str] = {
    ("qwen3_moe", "npu_grouped_matmul"): FUSED_GATE_UP,
    ("qwen3_next", "npu_grouped_matmul"): FUSED_GATE_UP,
}
FAMILIES = [family for family in VERL_OWNS if family in PRESENT]


def _ours(family: str) -> list[Any]:
    """Our patches of ``family`` for the kinds verl patches too."""
    return [p for p in transformers_npu.family_patches(family) if p.name.split(".")[-1] in VERL_OWNS[family]]


def _run(model: Any, ids: torch.Tensor) -> None:
    out = model(input_ids=ids)
    hidden = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    hidden.float().sin().sum().backward()


def _by_op(trace: list[tuple[Any, ...]]) -> dict[str, list[tuple[Any, ...]]]:
    ops: dict[str, list[tuple[Any, ...]]] = {}
    for op, arguments in trace:
        ops.setdefault(op, []).append(arguments)
    return ops


def _layout(summary: Any) -> Any:
    """A call's form: tensors as (rank, dtype, row-major / transposed / other strides)."""
    if isinstance(summary, tuple) and summary[:1] == ("tensor",):
        _, shape, dtype, strides = summary
        return ("tensor", len(shape), dtype, npu_emulation.layout(shape, strides))
    if isinstance(summary, tuple):
        return tuple(_layout(s) for s in summary)
    return summary


def _traces(family: str, dtype: torch.dtype, make_engine: Any, verl: Any, npu: Any) -> dict[str, Any]:
    module = importlib.import_module(transformers_npu.module_name(family))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    installs = {"verl": lambda: verl.NPU_PATCHES[family](), "ours": lambda: make_engine(_ours(family))}
    traces = {}
    for label, install in installs.items():
        with restored([module]):
            install()
            # Built after the owners are in place, as a model loaded after start-up (verl replaces
            # Qwen3-VL-MoE's block class, whose parameters are its own): random weights, same seed.
            model = randomize(builders()[family]()).to(dtype)
            npu.trace.clear()
            _run(model, ids)
            traces[label] = _by_op(list(npu.trace))
    return traces


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_our_npu_calls_are_verls(family: str, dtype: torch.dtype, make_engine: Any, verl: Any, npu: Any) -> None:
    traces = _traces(family, dtype, make_engine, verl, npu)
    ours, theirs = traces["ours"], traces["verl"]
    assert ours, f"{family}: our kernels made no NPU call"
    assert set(ours) == set(theirs), (family, sorted(ours), sorted(theirs))
    for op, calls in ours.items():
        if (family, op) in ALLOWED:
            forms = {_layout(c) for c in theirs[op]}
            assert {_layout(c) for c in calls} <= forms, (family, op, "a call form verl does not use")
            continue
        assert calls == theirs[op], (family, op)


def test_every_allowed_difference_is_real(make_engine: Any, verl: Any, npu: Any) -> None:
    """An allowlist entry whose calls have become equal must go (it would hide a later change)."""
    for family, op in ALLOWED:
        if family in PRESENT:
            traces = _traces(family, torch.float32, make_engine, verl, npu)
            assert traces["ours"][op] != traces["verl"][op], (family, op)
