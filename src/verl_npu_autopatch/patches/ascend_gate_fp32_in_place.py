"""``ascend.gate_fp32_in_place``: a weight sync copies the new fp32 router-gate weight into the
tensor the model already holds, instead of rebinding ``layer.weight_fp32`` (opt-in, group ``dsv4``).

vllm-ascend keeps an fp32 copy of the router gate of DeepSeek-V4 (layers marked
``precast_fp32_weight``) as ``layer.weight_fp32``, made again by
``AscendUnquantizedLinearMethod.process_weights_after_loading`` after every load. Up to 0.27.1rc1
it assigns a new tensor; graphs captured before the sync keep reading the old one, so after an RL
weight update the router keeps routing with the stale gate (the recipe's
``vllm-ascend-dsv4-gate-fp32-inplace.patch``; vllm-ascend issue #17197). 0.28.0rc1 replaces it
with ``replace_parameter(..., prefer_copy=True)``, upstream's fix, vllm-ascend PR #15666
(``fixed-upstream``).

The fix wraps the method: when the layer already held an fp32 gate of the same shape and dtype,
the newly made one is copied into it and the layer keeps the old tensor (the first load, or a
changed shape, keeps the new one). Opt-in: only DeepSeek-V4's gate carries the flag.
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

LINEAR = "vllm_ascend.ops.linear"
METHOD = "AscendUnquantizedLinearMethod.process_weights_after_loading"
PARAMS = ("self", "layer")
REBIND = "layer.weight_fp32="
IN_PLACE = ('replace_parameter(layer,"weight_fp32"', "prefer_copy=True")


@decides(f"{LINEAR}:{METHOD}", PARAMS)
def gate_rule(code: Code) -> Verdict:
    if code.has(*IN_PLACE):
        return fixed_upstream(
            'process_weights_after_loading already calls replace_parameter(layer, "weight_fp32", ..., prefer_copy=True)'
        )
    if not code.has(REBIND):
        return unsupported("process_weights_after_loading assigning layer.weight_fp32", "one without weight_fp32")
    return APPLY


def _same_layout(old: Any, new: Any) -> bool:
    """Whether ``new`` can be copied into ``old``: two distinct tensors of one shape, dtype, device."""
    import torch

    return (
        isinstance(old, torch.Tensor)
        and isinstance(new, torch.Tensor)
        and old is not new
        and old.shape == new.shape
        and old.dtype == new.dtype
        and old.device == new.device
    )


def process_weights(original: Callable[..., Any], self: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
    """The release's method; a gate of the held layout is then copied into the held tensor."""
    held: Any = getattr(layer, "weight_fp32", None)
    result = original(self, layer, *args, **kwargs)
    made = getattr(layer, "weight_fp32", None)
    if _same_layout(held, made):
        import torch

        with torch.no_grad():
            held.copy_(made)
        layer.weight_fp32 = held
    return result


PATCHES = [
    wrapping_patch(
        "ascend.gate_fp32_in_place",
        "A weight sync copies DeepSeek-V4's new fp32 router gate into the tensor captured graphs hold.",
        rule=gate_rule,
        wrap=around(process_weights),
        opt_in="dsv4",
        reference="https://github.com/vllm-project/vllm-ascend/pull/15666",
    ),
]
