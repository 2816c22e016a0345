"""``doctor --verify``: each applied kernel patch against the upstream callable it replaced, on
tiny inputs on the device.

Runs in the doctor child (a fresh interpreter, where the patches went in at import). For every
applied transformers kernel patch (and each patch of :data:`INFERENCE`) and each dtype of
:data:`TOLERANCE`, the patched and the upstream callable get the same inputs; the outputs
(forward) and, for the transformers kernels (they train), the gradients of the inputs and
parameters (backward) are compared as the largest absolute error and that error relative to the
largest upstream magnitude, which must stay within the dtype's tolerance. The patches of
:data:`INFERENCE` are vLLM inference code: forward only, without autograd. Each callable is also
timed (the fastest of a few calls) and reported as patched / upstream.

The other patches have no tiny-input check (:data:`NOT_NUMERIC` says why, per patch); they are
listed, never counted as passed; a patch with a check that is not applied here is listed with its
state and reason. On an NPU host the tensors go to the ``npu`` device; elsewhere (``--device
npu``) they stay on the CPU and run whatever ``import torch_npu`` gives.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.engine.text import describe, safe_str

#: dtype name -> largest relative error (max abs error / max upstream magnitude) that passes.
TOLERANCE: dict[str, float] = {"float32": 1e-4, "bfloat16": 2e-2}

#: Timed calls per callable (after one warm-up call); the fastest counts.
REPEATS = 10

#: What :func:`check` measures; ``None`` in a row that could not be measured.
MEASURED = (
    "fwd_max_abs",
    "fwd_max_rel",
    "bwd_max_abs",
    "bwd_max_rel",
    "tolerance",
    "patched_us",
    "upstream_us",
    "time_ratio",
)

#: Patches checked forward only (vLLM inference code: no backward), beside the transformers kernels.
INFERENCE = ("ascend.rms_norm_residual",)

#: Patches (or name prefixes) without a tiny-input check, and why.
NOT_NUMERIC: dict[str, str] = {
    "vllm.moe_weight_loader": "fixes where shards land in vllm-ascend's transposed weights (upstream is the bug, no "
    "reference); needs a FusedMoE layer in a vLLM model context",
    "vllm.rotary_flash_attn_guard": "changes what ApplyRotaryEmb imports, not what it computes",
    "vllm.engine_partial_wake_up": "EngineCore scheduling control flow",
    "vllm.routed_experts_padding_slots": "which routing rows reach the slot buffer: indexing, no arithmetic",
    "ascend.sampler_record_stream": "a side-stream tensor's lifetime: the same draws and ids, a race no CPU shows",
    "verl.": "hands targets back from verl's own patches: ownership, no arithmetic",
    "ascend.sfa_indexer_scale": "changes the indexer weights' scale on purpose (upstream is the bug, no reference); "
    "needs the SFA attention layer",
    "ascend.": "vllm-ascend weight handling / memory / capture control flow inside a running engine",
    "liger.": "arbitration between Liger-Kernel and our kernels: no arithmetic of its own",
    **dict.fromkeys(
        ("transformers.qwen3_vl.deepstack_clone", "transformers.qwen3_vl_moe.deepstack_clone"),
        "upstream's own arithmetic on a clone of hidden_states (upstream raises only on an in-place view)",
    ),
    "tensordict.": "device synchronisation after copies: no arithmetic",
    "torch_npu.": "removes torch_npu's refusal of torch.nested: upstream raises, nothing to compare",
    "megatron.": "GPTModel post-processing control flow: needs a Megatron model",
}


def has_check(name: str) -> bool:
    """Whether patch ``name`` has a tiny-input check (a transformers kernel or one of :data:`INFERENCE`)."""
    from verl_npu_autopatch.patches.transformers_npu.table import KERNELS

    return name in INFERENCE or (name.startswith("transformers.") and name.rsplit(".", 1)[-1] in KERNELS)


def not_numeric(name: str) -> str:
    """Why patch ``name`` has no tiny-input check."""
    for key, reason in NOT_NUMERIC.items():
        if name == key or (key.endswith(".") and name.startswith(key)):
            return reason
    return "no tiny-input check for this patch"


def pick_device() -> tuple[Any, str]:
    """``(torch device, torch_npu origin)``: ``npu`` when torch_npu sees one, else the CPU."""
    import torch
    import torch_npu

    origin = getattr(torch_npu, "__file__", None) or repr(torch_npu)
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return torch.device("npu"), origin
    return torch.device("cpu"), origin


def _tensors(out: Any) -> list[Any]:
    """The floating-point tensors of a callable's result (a tensor or a tuple of them)."""
    import torch

    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


def errors(got: list[Any], want: list[Any]) -> tuple[float, float]:
    """``(max abs error, max abs error / max |want|)`` over pairs of tensors."""
    if len(got) != len(want):
        raise ValueError(f"patched gave {len(got)} tensors, upstream {len(want)}")
    worst_abs, scale = 0.0, 0.0
    for a, b in zip(got, want, strict=True):
        if a.shape != b.shape:
            raise ValueError(f"patched shape {tuple(a.shape)} != upstream {tuple(b.shape)}")
        worst_abs = max(worst_abs, (a.float() - b.float()).abs().max().item() if a.numel() else 0.0)
        scale = max(scale, b.float().abs().max().item() if b.numel() else 0.0)
    return worst_abs, worst_abs / scale if scale > 0 else worst_abs


def _forward(fn: Callable[..., Any], call: Any) -> list[Any]:
    """One forward: the floating-point outputs (still attached to the graph)."""
    return _tensors(fn(*call.args))


def _inference(fn: Callable[..., Any], call: Any) -> list[Any]:
    """One forward without autograd, as inference runs it."""
    import torch

    with torch.no_grad():
        return _forward(fn, call)


def _grads(outs: list[Any], call: Any, seeds: list[Any]) -> list[Any]:
    """The leaves' gradients of ``outs`` with ``seeds`` as output gradients (zeros where unused)."""
    import torch

    pairs = [(o, g) for o, g in zip(outs, seeds, strict=True) if o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], call.leaves, [g for _, g in pairs], allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(call.leaves, grads, strict=True)]


def _step(fn: Callable[..., Any], call: Any, seeds: list[Any] | None) -> None:
    """One call as :func:`_seconds` times it: forward and backward, or (``seeds`` ``None``: the
    case does not train) forward only."""
    if seeds is None:
        _inference(fn, call)
    else:
        _grads(_forward(fn, call), call, seeds)


def _seconds(fn: Callable[..., Any], call: Any, seeds: list[Any] | None, device: Any) -> float:
    """Seconds of one :func:`_step`, synchronised with the device: the fastest of
    :data:`REPEATS` calls after a warm-up (the least disturbed by other work on the host)."""
    import torch

    sync = torch.npu.synchronize if device.type == "npu" else (lambda: None)
    _step(fn, call, seeds)
    best = float("inf")
    for _ in range(REPEATS):
        sync()
        start = time.perf_counter()
        _step(fn, call, seeds)
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def check(case: Any, dtype_name: str, device: Any) -> dict[str, Any]:
    """One case in one dtype: errors forward and (where the case trains) backward, pass/fail,
    time ratio."""
    import torch

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    call = case.make(dtype, device)
    seeds: list[Any] | None = None
    bwd_abs: float | None = None
    bwd_rel: float | None = None
    if case.trains:
        want = _forward(case.upstream, call)
        seeds = [torch.randn_like(t) for t in want]
        want_grads = _grads(want, call, seeds)
        got = _forward(case.patched, call)
        bwd_abs, bwd_rel = errors(_grads(got, call, seeds), want_grads)
    else:
        want, got = _inference(case.upstream, call), _inference(case.patched, call)
    fwd_abs, fwd_rel = errors(got, want)
    tol = TOLERANCE[dtype_name]
    patched_s, upstream_s = _seconds(case.patched, call, seeds, device), _seconds(case.upstream, call, seeds, device)
    return {
        "fwd_max_abs": fwd_abs,
        "fwd_max_rel": fwd_rel,
        "bwd_max_abs": bwd_abs,
        "bwd_max_rel": bwd_rel,
        "tolerance": tol,
        "passed": fwd_rel <= tol and (bwd_rel is None or bwd_rel <= tol),
        "patched_us": patched_s * 1e6,
        "upstream_us": upstream_s * 1e6,
        "time_ratio": patched_s / upstream_s if upstream_s > 0 else None,
    }


def _failure(exc: BaseException) -> str:
    """``TypeName: message``, bounded, whatever the exception's ``__str__`` does."""
    return describe(exc)


def absent() -> dict[str, Any]:
    """An empty verify report: nothing checked, nothing failed (yet)."""
    return {
        "device": None,
        "torch_npu": None,
        "tolerance": dict(TOLERANCE),
        "results": [],
        "not_checked": [],
        "not_run": [],
        "error": None,
        "ok": True,
    }


def run(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Verify every applied patch with a check among ``records`` (the doctor child's record dicts);
    list the applied ones without a check, and the ones with a check that are not applied."""
    checked = [r for r in records if has_check(r["name"])]
    to_run = [r for r in checked if r["state"] == "applied"]
    report = absent()
    report["not_checked"] = [
        {"name": r["name"], "reason": not_numeric(r["name"])}
        for r in records
        if r["state"] == "applied" and r not in to_run
    ]
    report["not_run"] = [{k: r[k] for k in ("name", "state", "reason")} for r in checked if r not in to_run]
    if to_run:
        try:
            device, report["torch_npu"] = pick_device()
            report["device"] = str(device)
        except Exception as exc:
            report["error"] = f"cannot choose the device ({len(to_run)} applied kernels not verified): {_failure(exc)}"
            to_run = []
    for record in to_run:
        report["results"] += _verify_record(record, device)
    report["ok"] = report["error"] is None and all(r["passed"] for r in report["results"])
    return report


def _case(name: str, target: str) -> Any:
    """The tiny-input case of the applied patch ``name`` on ``target``."""
    if name in INFERENCE:
        from verl_npu_autopatch.patches.ascend_glm52.verify_case import case
    else:
        from verl_npu_autopatch.patches.transformers_npu.verify_cases import case
    return case(name, target)


def _verify_record(record: dict[str, Any], device: Any) -> list[dict[str, Any]]:
    """One row per dtype for an applied patch with a check; a failure to run is a failed row."""
    from verl_npu_autopatch.authoring.verify_case import Unverifiable

    base = {"name": record["name"], "target": record["target"], "inputs": None, "backward": None}
    base.update(dict.fromkeys(MEASURED))
    try:
        found = _case(record["name"], record["target"])
    except Unverifiable as exc:
        return [{**base, "dtype": None, "passed": False, "error": f"cannot verify: {safe_str(exc)}"}]
    except Exception as exc:
        return [{**base, "dtype": None, "passed": False, "error": f"building the tiny input raised {_failure(exc)}"}]
    base["inputs"], base["backward"] = found.inputs, found.trains
    rows = []
    for dtype_name in TOLERANCE:
        try:
            rows.append({**base, "dtype": dtype_name, **check(found, dtype_name, device), "error": None})
        except Exception as exc:
            failed = {"dtype": dtype_name, "tolerance": TOLERANCE[dtype_name], "passed": False, "error": _failure(exc)}
            rows.append({**base, **failed})
    return rows


# --------------------------------------------------------------------------- printing
_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _backward_cells(row: dict[str, Any]) -> list[str]:
    """The bwd abs / rel cells: ``inference -`` for a forward-only check."""
    if row.get("backward") is False:
        return ["inference", "-"]
    return [_num(row.get("bwd_max_abs")), _num(row.get("bwd_max_rel"))]


def render(report: dict[str, Any], width: int = 120) -> list[str]:
    """The ``--verify`` section of ``doctor``: a table of the checks, then what failed and why,
    the checks not run (their patch is not applied) and the applied patches without a tiny-input
    check; no line is wider than ``width``."""
    from verl_npu_autopatch.cli.summary import table, wrap

    where = f"device {report['device']}, torch_npu from {report['torch_npu']}" if report["device"] else "no device"
    lines = wrap(f"verify: patched kernel against upstream on tiny inputs ({where})", width)
    tolerances = ", ".join(f"{_SHORT_DTYPE.get(k, k)} {v:g}" for k, v in report["tolerance"].items())
    lines += wrap(
        f"pass: max abs error / max |upstream| <= {tolerances}, forward and backward (inference code: forward only)",
        width,
    )
    if report["error"]:
        lines += wrap(f"VERIFY FAILED: {report['error']}", width)
    rows = [
        [
            r["name"].removeprefix("transformers."),
            _SHORT_DTYPE.get(r["dtype"], r["dtype"] or "-"),
            "ok" if r["passed"] else ("ERROR" if r["error"] else "FAIL"),
            _num(r.get("fwd_max_abs")),
            _num(r.get("fwd_max_rel")),
            *_backward_cells(r),
            "-" if r.get("time_ratio") is None else f"{r['time_ratio']:.2f}x",
        ]
        for r in report["results"]
    ]
    header = ["kernel", "dtype", "result", "fwd abs", "fwd rel", "bwd abs", "bwd rel", "time patched/upstream"]
    if rows or not report["error"]:
        lines += table(rows, header).splitlines() if rows else ["no applied kernel patch to verify"]
    failed = [r for r in report["results"] if not r["passed"]]
    for r in failed:
        why = r["error"] or f"error above the {_SHORT_DTYPE.get(r['dtype'], r['dtype'])} tolerance {r['tolerance']:g}"
        lines += wrap(f"MISMATCH {r['name']} ({r['dtype'] or 'setup'}): {why}", width, indent="  ")
    checked = [r["name"] for r in report["results"]] + [e["name"] for e in report["not_run"]]
    lines += _not_run(report["not_run"], checked, width)
    if report["not_checked"]:
        lines.append("no tiny-input check (applied, not arithmetic that a tiny input can compare):")
        for item in report["not_checked"]:
            lines += wrap(f"  {item['name']}: {item['reason']}", width, indent="    ")
    return lines


def _not_run(entries: list[dict[str, Any]], checked: list[str], width: int) -> list[str]:
    """The patches with a check that are not applied here, one line per state and reason, their
    names compact (``transformers.* (34)``: every checked patch under that prefix)."""
    from verl_npu_autopatch.cli.summary import compact, wrap

    grouped: dict[tuple[str, str], list[str]] = {}
    for entry in entries:
        grouped.setdefault((entry["state"], entry["reason"]), []).append(entry["name"])
    lines = ["checks not run (the patch is not applied here):"] if grouped else []
    for (state, reason), names in grouped.items():
        text = f"  {', '.join(compact(names, checked))}: {state}" + (f" ({reason})" if reason else "")
        lines += wrap(text, width, indent="    ")
    return lines
