"""Our NPU op calls are the calls verl's hardware-run ``npu_patch`` (release 0.9.1) makes.

For every family verl also patches, a tiny model runs forward and backward once with verl's kernels
and once with ours (only the kinds verl patches), in fp32 and bf16; the torch_npu test double
records every call as the op receives it (op, every bound argument, tensors as shape, dtype and
strides). Per op the two call sequences must be equal, strides included, except for the entries of
:data:`ALLOWED`, each saying how ours does less. There ours must do no more: no more calls of that
op, and over the whole forward and backward no more host ops and no more bytes allocated
(:class:`~tests.hf.meter.Meter`; a copy of the expert weights would show there), and our calls use
only call *forms* verl uses (the same non-tensor arguments, tensors of the same rank, dtype and
layout: row-major, transposed or other strides).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import transformers

from tests.hf import npu_emulation
from tests.hf.conftest import PRESENT, VERL_OWNS, builders, randomize, restored
from tests.hf.meter import Meter
from verl_npu_autopatch.patches import transformers_npu

FUSED_GATE_UP = (
    "fewer calls and bytes: one grouped matmul over the fused gate/up weight (a transposed view of the "
    "model's [E, 2I, H]) where verl runs two over its halves (up, then gate) and concatenates the results; "
    "verl itself fuses them for Qwen3-VL-MoE and Qwen3.5-MoE"
)
#: (family, op) -> how our calls of that op differ from verl's, doing less.
ALLOWED: dict[tuple[str, str], str] = {
    ("qwen3_moe", "npu_grouped_matmul"): FUSED_GATE_UP,
    ("qwen3_next", "npu_grouped_matmul"): FUSED_GATE_UP,
    ("qwen3_5_moe", "npu_grouped_matmul"): (
        "fewer bytes: the weights are transposed views of the model's own [E, 2I, H] / [E, H, I] where verl "
        "copies both (permute(0, 2, 1).contiguous(), every expert's weights at every forward)"
    ),
}
if int(transformers.__version__.split(".")[0]) >= 5:  # 4.57's experts store [E, H, 2I] as verl's class does: equal
    ALLOWED[("qwen3_vl_moe", "npu_grouped_matmul")] = (
        "fewer host ops and bytes: the model's own experts under its own router, the weights transposed views "
        "of its [E, 2I, H] / [E, H, I]; verl replaces the block class by its own, whose parameters are stored "
        "[E, H, 2I] and whose router builds dense [T, E] routing weights"
    )
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
    """Per side, the calls by op and (under ``"meter"``) the run's host ops and bytes allocated."""
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
            with Meter() as meter:
                _run(model, ids)
            traces[label] = _by_op(list(npu.trace))
            traces[label]["meter"] = [(meter.ops, meter.bytes)]
    return traces


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_our_npu_calls_are_verls(family: str, dtype: torch.dtype, make_engine: Any, verl: Any, npu: Any) -> None:
    traces = _traces(family, dtype, make_engine, verl, npu)
    ours, theirs = traces["ours"], traces["verl"]
    [(our_ops, our_bytes)], [(their_ops, their_bytes)] = ours.pop("meter"), theirs.pop("meter")
    assert ours, f"{family}: our kernels made no NPU call"
    assert set(ours) == set(theirs), (family, sorted(ours), sorted(theirs))
    for op, calls in ours.items():
        if (family, op) in ALLOWED:
            forms = {_layout(c) for c in theirs[op]}
            assert {_layout(c) for c in calls} <= forms, (family, op, "a call form verl does not use")
            assert len(calls) <= len(theirs[op]), (family, op, "more calls than verl")
            assert our_ops <= their_ops, (family, "more host ops than verl", our_ops, their_ops)
            assert our_bytes <= their_bytes, (family, "more bytes allocated than verl", our_bytes, their_bytes)
            continue
        assert calls == theirs[op], (family, op)


def test_every_allowed_difference_is_real(make_engine: Any, verl: Any, npu: Any) -> None:
    """An allowlist entry whose calls have become equal must go (it would hide a later change)."""
    for family, op in ALLOWED:
        if family in PRESENT:
            traces = _traces(family, torch.float32, make_engine, verl, npu)
            assert traces["ours"][op] != traces["verl"][op], (family, op)
