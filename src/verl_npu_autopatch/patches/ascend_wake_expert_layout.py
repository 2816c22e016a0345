"""``ascend.wake_expert_layout``: a wake-up that no weight reload follows leaves the MoE expert
weights in the layout the grouped matmul reads (opt-in, group ``sleep_no_reload``).

vllm-ascend's unquantized MoE method turns ``w13_weight`` (``[E, 2I, H]``) and ``w2_weight``
(``[E, H, I]``) into its runtime layout (``[E, H, 2I]`` / ``[E, I, H]``) once they are loaded.
Up to 0.25.1rc1, ``NPUWorker.wake_up`` replaces every runtime-layout expert weight by a new
Parameter holding its ``transpose(1, 2)`` view whenever the weights wake: the checkpoint layout a
weight reload expects. A set-up that sleeps and wakes without reloading (inference between sleeps,
level 1) then runs the grouped matmul on the wrong layout: a shape mismatch, or wrong numbers where
``2I == H`` (vllm-ascend issues #11548 and #12226). 0.26.0rc1 drops the transposition from
``wake_up`` (vllm-ascend PR #13012): ``fixed-upstream``.

The fix wraps ``NPUWorker.wake_up``: each expert weight the release replaced by a transposed view
of itself is put back, the very Parameter it held before (its storage, address and attributes).
verl reloads after every wake and relies on the release's flip (and on ``vllm.moe_weight_loader``
from 0.26.0rc1), so it needs none of this: where a reload follows, a model whose two layouts have
one shape (``2I == H`` or ``I == H``) would load into the runtime layout. Opt-in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Verdict,
    around,
    decides,
    fixed_upstream,
    unsupported,
    wrapping_patch,
)

WORKER = "vllm_ascend.worker.worker"
PARAMS = ("self", "tags")
#: The expert weights the release flips (matched in the parameter's name, as the release does).
EXPERTS = ("w13_weight", "w2_weight")
#: What the rule looks for (whitespace-free).
WAKES = "allocator.wake_up(tags=tags)"
FLIPS = (".transpose(1,2)", "setattr(parent_module,param_name,", *EXPERTS)


@decides(f"{WORKER}:NPUWorker.wake_up", PARAMS)
def wake_layout_rule(code: Code) -> Verdict:
    """``NPUWorker.wake_up``: does it flip the expert weights it woke?"""
    if not code.has(WAKES):
        return unsupported("NPUWorker.wake_up waking CaMemAllocator with its tags", "another wake_up")
    if code.has(*FLIPS):
        return APPLY
    if not code.has("transpose"):
        return fixed_upstream("NPUWorker.wake_up leaves the expert weights' layout alone (no transpose in it)")
    return unsupported(
        "NPUWorker.wake_up flipping w13_weight / w2_weight by transpose(1, 2) and setattr", "another transpose"
    )


def _expert_weights(model: Any) -> list[tuple[Any, str, Any]]:
    """``(module, name, parameter)`` of every expert weight of ``model``, as it holds them now."""
    found = []
    for name, param in model.named_parameters():
        if any(expert in name for expert in EXPERTS) and param.dim() == 3:
            path, _, leaf = name.rpartition(".")
            found.append((model.get_submodule(path), leaf, param))
    return found


def _flipped(now: Any, kept: Any) -> bool:
    """Whether ``now`` is a ``transpose(1, 2)`` view of ``kept``'s own storage (not ``kept``)."""
    if now is kept or getattr(now, "dim", lambda: 0)() != 3:
        return False
    view = kept.transpose(1, 2)
    return bool(now.shape == view.shape and now.stride() == view.stride() and now.data_ptr() == kept.data_ptr())


def keep_layout(original: Callable[..., Any], self: Any, tags: list[str] | None = None) -> Any:
    """The release's ``wake_up``; each expert weight it flipped is then the one held before."""
    model = getattr(getattr(self, "model_runner", None), "model", None)
    waking = model is not None and (tags is None or "weights" in tags)
    held = _expert_weights(model) if waking else []
    result = original(self, tags)
    for module, leaf, param in held:
        if _flipped(getattr(module, leaf, None), param):
            setattr(module, leaf, param)
    return result


PATCHES = [
    wrapping_patch(
        "ascend.wake_expert_layout",
        "A wake-up without a weight reload keeps vllm-ascend's MoE expert weights in their runtime layout.",
        rule=wake_layout_rule,
        wrap=around(keep_layout),
        opt_in="sleep_no_reload",
        reference="https://github.com/vllm-project/vllm-ascend/pull/13012",
    ),
]
