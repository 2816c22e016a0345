"""``megatron.expert_bias_fp32``: ``Float16Module`` leaves the MoE router's ``expert_bias`` buffer
in fp32, holding the very tensor (and value) it held before the wrap.

megatron-core's routers register ``expert_bias`` (the aux-loss-free load-balancing bias of
DeepSeek-V3/V4-style routing, ``moe_router_enable_expert_bias``) as an fp32 buffer.
``Float16Module.__init__`` then runs ``module.bfloat16()`` (or ``.half()``), which casts every
floating buffer, ``expert_bias`` included. The router's own ``_maintain_float32_expert_bias``
casts it back to fp32 later (at its first forward, before a state-dict load or save), but the
mantissa is gone by then; worse, a checkpoint bridge (mbridge) that copies the Hugging Face
``e_score_correction_bias`` into the buffer between the wrap and that upcast writes it into a bf16
tensor. Routing then picks experts with a rounded bias: a silent drift (the recipe's
``megatron-expert-bias-keep-fp32.patch``). Every release from core 0.12.1 to 0.19.2 does this.

The fix wraps ``Float16Module.__init__``: before the cast it notes, for each submodule holding an
fp32 ``expert_bias`` buffer, that tensor itself; after the cast it puts the same tensor back in the
submodule's buffers. ``module.bfloat16()`` binds a *new* tensor to each buffer and leaves the old
one untouched, so the noted tensor still has its exact fp32 value: no copy is made (a clone, as the
recipe makes, would cost memory and rebuild the buffer), nothing is rounded, the buffer keeps its
persistence (only the ``_buffers`` entry changes) and any other holder of the tensor sees the same
object. A buffer the cast did not change, or that another hand moved to another device meanwhile,
is left as it is. Decided from the code: a ``Float16Module.__init__`` that names ``expert_bias``
itself is taken as fixed upstream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    RECIPE,
    Code,
    Verdict,
    around,
    decides,
    fixed_upstream,
    signature_text,
    unsupported,
    wrapping_patch,
)

MODULE = "megatron.core.transformer.module"
BUFFER = "expert_bias"
#: How the releases cast the wrapped module (bf16 and fp16 branches).
CASTS = ("module.bfloat16()", "module.half()")


@decides(f"{MODULE}:Float16Module.__init__")
def float16_rule(init: Code) -> Verdict:
    if init.params is not None and init.params[:3] != ("self", "config", "module"):
        return unsupported("Float16Module.__init__(self, config, module)", f"__init__{signature_text(init.params)}")
    if init.has(BUFFER):
        return fixed_upstream("Float16Module.__init__ handles expert_bias itself")
    if not any(init.has(cast) for cast in CASTS):
        return unsupported("Float16Module.__init__ casting module.bfloat16() / module.half()", "another cast")
    return APPLY


def fp32_expert_biases(module: Any) -> list[tuple[Any, Any]]:
    """``(submodule, its fp32 expert_bias tensor)`` for every submodule of ``module`` holding one."""
    import torch

    held = []
    for sub in module.modules():
        tensor = sub._buffers.get(BUFFER)
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
            held.append((sub, tensor))
    return held


def restore(held: list[tuple[Any, Any]]) -> None:
    """Put each noted fp32 tensor back where a cast replaced it by another dtype's copy."""
    for sub, tensor in held:
        now = sub._buffers.get(BUFFER)
        if now is not tensor and now is not None and now.dtype != tensor.dtype and now.device == tensor.device:
            sub._buffers[BUFFER] = tensor


def keep_fp32_biases(
    original: Callable[..., Any], self: Any, config: Any, module: Any, *args: Any, **kwargs: Any
) -> None:
    """The release's ``Float16Module.__init__``, the fp32 expert biases noted before and put back after."""
    held = fp32_expert_biases(module)
    original(self, config, module, *args, **kwargs)
    restore(held)


PATCHES = [
    wrapping_patch(
        "megatron.expert_bias_fp32",
        "Float16Module keeps the MoE router's expert_bias buffer in fp32 (the same tensor, unrounded).",
        rule=float16_rule,
        wrap=around(keep_fp32_biases),
        reference=RECIPE,
    ),
]
