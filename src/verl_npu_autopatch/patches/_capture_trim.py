"""The DP-padding trim of vLLM's ``RoutedExpertsCapturer.capture``, shared by the two families
that may install it: ``ascend_routed_experts_dp_padding_trim`` (which owns ``capture`` and wraps
whatever capture is live) and ``ascend_routed_experts_capture`` (which, with the trim enabled
too, installs vllm-ascend's capture already wrapped by it: one owner of the attribute).

Under data parallelism DeepSeek-V4's bucketed decode hands ``capture`` this DP rank's rows padded
to the widest rank's count *before* the DP all-gather: ``topk_ids.shape[0] == max_tokens`` with
``max_tokens > token_num_per_dp``. vLLM's capture (0.23 to 0.32) and vllm-ascend's (0.21.0rc1 to
0.30.0rc2, which handles the padded layout *after* the all-gather, ``max_tokens * dp``) both raise
``AssertionError`` on it. The trim hands the capture its first ``token_num_per_dp`` rows (the real
ones), which every capture in range takes whole.
"""

from __future__ import annotations

import ast
import functools
import importlib
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import APPLY, Code, Target, Verdict, fixed_upstream, params_mismatch, unsupported

__all__ = [
    "CAPTURE",
    "CAPTURER",
    "CAPTURE_PARAMS",
    "CARRIES",
    "RECIPE_MARK",
    "TARGET",
    "TRIGGER",
    "TRIM",
    "WORKER",
    "WORKER_READS",
    "trim_rule",
    "trimmed",
]

WORKER = "vllm_ascend.patch.worker"
CAPTURE = f"{WORKER}.patch_routed_experts_capture"
CAPTURER = "vllm.model_executor.layers.fused_moe.routed_experts_capturer"
CAPTURE_PARAMS = ("self", "layer_id", "topk_ids")
#: What both families fix, and where they hook: right after vllm-ascend applied its worker patches.
TARGET = Target.parse(f"{CAPTURER}:RoutedExpertsCapturer.capture")
TRIGGER = Target.parse(f"{WORKER}:__file__")
#: The vllm-ascend files both static rules read.
WORKER_READS = ("vllm_ascend/patch/worker/__init__.py", "vllm_ascend/patch/worker/patch_routed_experts_capture.py")
#: The patch that owns the trim.
TRIM = "ascend.routed_experts_dp_padding_trim"
#: Set on every capture carrying the trim (ours, or ``ascend.routed_experts_capture``'s).
CARRIES = "__verl_npu_autopatch_dp_padding_trim__"
#: The marker verl-ascend-recipe's own wrapper sets and checks (``verl_A5.patch``,
#: ``npu_vllm_patch.py``): ours carries it too, so the recipe's patch leaves our capture alone.
RECIPE_MARK = "_verl_ascend_local_dp_padding"

_CONTEXT = "vllm.forward_context"
_ROWS = ("topk_ids.shape[0]", "len(topk_ids)", "topk_ids.size(0)")


def _unwrapped(expr: ast.expr) -> ast.expr:
    """``expr`` without ``int(...)`` and ``.item()`` around it."""
    while isinstance(expr, ast.Call):
        func = expr.func
        if isinstance(func, ast.Name) and func.id == "int" and len(expr.args) == 1:
            expr = expr.args[0]
        elif isinstance(func, ast.Attribute) and func.attr == "item" and not expr.args:
            expr = func.value
        else:
            break
    return expr


def _kind(expr: ast.expr) -> str | None:
    """``rows`` (the batch dim of ``topk_ids``), ``max`` (the widest DP rank's count), ``own``
    (this DP rank's count, indexed by ``self.dp_rank``) or ``None``."""
    expr = _unwrapped(expr)
    if ast.unparse(expr) in _ROWS:
        return "rows"
    if isinstance(expr, ast.Call) and (
        (isinstance(expr.func, ast.Attribute) and expr.func.attr == "max")
        or (isinstance(expr.func, ast.Name) and expr.func.id == "max")
    ):
        return "max"
    if isinstance(expr, ast.Subscript) and ast.unparse(expr.slice) == "self.dp_rank":
        return "own"
    return None


def _branches(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[frozenset[str]]:
    """The pairs of kinds that an ``if``/``elif`` of the function compares with ``==``, names
    resolved through the function's own assignments (a name may have several kinds)."""
    names: dict[str, set[str]] = {}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name):
            kind = _kind(sub.value)
            if kind:
                names.setdefault(sub.targets[0].id, set()).add(kind)

    def kinds(expr: ast.expr) -> set[str]:
        direct = _kind(expr)
        return {direct} if direct else set(names.get(expr.id, ())) if isinstance(expr, ast.Name) else set()

    found = set()
    for test in (sub.test for sub in ast.walk(node) if isinstance(sub, ast.If)):
        for compare in (c for c in ast.walk(test) if isinstance(c, ast.Compare)):
            if len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq):
                left, right = kinds(compare.left), kinds(compare.comparators[0])
                found |= {frozenset((a, b)) for a in left for b in right}
    return found


def trim_rule(capture: ast.AST | None, where: str) -> Verdict:
    """Decide on the definition of the capture that is live (``where`` names it): ``fixed-upstream``
    when it already branches on ``topk_ids.shape[0] == max`` of the DP counts; ``apply`` when it
    has a branch taking this rank's own rows whole (``== counts[self.dp_rank]``), which the
    trimmed rows then take; else ``unsupported`` (trimming would not help that capture)."""
    if not isinstance(capture, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return unsupported(where, "no such function")
    params = tuple(a.arg for a in (*capture.args.posonlyargs, *capture.args.args))
    mismatch = params_mismatch(Code(None, params), CAPTURE_PARAMS, "capture", where)
    if mismatch:
        return mismatch
    branches = _branches(capture)
    if frozenset(("rows", "max")) in branches:
        return fixed_upstream(f"{where} branches on topk_ids.shape[0] == the widest DP rank's token count")
    if frozenset(("rows", "own")) not in branches:
        return unsupported(
            f"{where} with a branch taking this DP rank's own rows (topk_ids.shape[0] == counts[self.dp_rank])",
            "none",
        )
    return APPLY


def trimmed(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a capture) behind the trim, marked as carrying it (:data:`CARRIES`, and the
    recipe's :data:`RECIPE_MARK`). The forward context is read the way ``original`` reads it: its
    module's ``get_forward_context``."""
    namespace = getattr(original, "__globals__", {})

    @functools.wraps(original)
    def capture(self: Any, layer_id: int, topk_ids: Any) -> Any:
        context = namespace.get("get_forward_context") or importlib.import_module(_CONTEXT).get_forward_context
        metadata = context().dp_metadata
        if metadata is not None:
            counts = metadata.num_tokens_across_dp_cpu
            own, widest = int(counts[self.dp_rank]), int(counts.max())
            if topk_ids.shape[0] == widest > own:  # this rank's rows padded to the widest rank's count
                topk_ids = topk_ids[:own]
        return original(self, layer_id, topk_ids)

    setattr(capture, CARRIES, True)
    setattr(capture, RECIPE_MARK, True)
    return capture
