"""``ascend.mxfp8_reload_in_place``: an RL weight reload leaves vllm-ascend's MXFP8 linear weights
at the addresses captured graphs read (opt-in, group ``mxfp8``).

``AscendW8A8MXFP8DynamicLinearMethod.process_weights_after_loading`` turns the loaded weight and
its scale into the layout the MXFP8 matmul reads. vllm-ascend 0.23.0 to 0.25.1rc1 do it with
``.transpose(0, 1).contiguous()`` into ``layer.weight.data`` / ``layer.weight_scale.data``, again
at every RL reload (after ``restore_weights_for_rl_loading``): the layer then holds tensors at
new addresses while ACL graphs captured at start-up replay on the old, freed ones, and the rollout
produces garbled text (vllm-ascend PR #13902). 0.23.0.post1 and 0.26.0rc1 on allocate the buffers
once and copy each reload into them (``_mxfp8_weight_buf``): ``fixed-upstream``. Releases that
transpose by view (0.18.0, 0.21.0rc1) are not what the fix was written for.

The fix wraps the method: once the release transformed the layer, each of the two tensors that is
now at another address than the one the previous call left is copied into that one, and the layer
points at it again, so every reload ends where the first load did. Opt-in: only MXFP8 checkpoints
use the method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Target,
    UpstreamTree,
    Verdict,
    around,
    decides,
    fixed_upstream,
    module_file,
    unsupported,
    wrapping_patch,
)

#: Where the method lives: up to 0.26.0rc1, then in the ``w8a8`` subpackage (0.27.1rc1 on).
MXFP8 = "vllm_ascend.quantization.methods.w8a8_mxfp8"
MOVED = "vllm_ascend.quantization.methods.w8a8.w8a8_mxfp8"
METHOD = "AscendW8A8MXFP8DynamicLinearMethod.process_weights_after_loading"
PARAMS = ("self", "layer")
#: What the rule looks for (whitespace-free).
BUFFERS = "layer._mxfp8_weight_buf"
REALLOCATES = ("layer.weight.data=layer.weight.data.transpose(0,1).contiguous()", "layer._mxfp8_transformed=True")
#: Every tensor of the layer this method transforms.
TENSORS = ("weight", "weight_scale")

#: Layer → the tensors the previous call left in it (their storage: what graphs captured).
_LEFT: WeakKeyDictionary[Any, dict[str, Any]] = WeakKeyDictionary()


@decides(f"{MXFP8}:{METHOD}", PARAMS)
def mxfp8_rule(code: Code) -> Verdict:
    """``process_weights_after_loading``: new tensors at every reload, or buffers made once?"""
    if code.has(BUFFERS):
        return fixed_upstream("process_weights_after_loading copies each reload into the buffers of the first load")
    if code.has(*REALLOCATES):
        return APPLY
    return unsupported(
        "process_weights_after_loading transposing into new tensors at each reload (.transpose(0, 1).contiguous())",
        "another body",
    )


def static(tree: UpstreamTree) -> Verdict:
    """The rule on the release's module holding the method (the moved one when the first is absent)."""
    module = MXFP8 if tree.has_module(MXFP8) or not tree.has_module(MOVED) else MOVED
    return tree.judge(module, METHOD, mxfp8_rule)


def _same_place(old: Any, new: Any) -> bool:
    """Whether ``new`` (at another address) can be copied into ``old``: one shape, dtype, device, contiguous."""
    return bool(
        old.data_ptr() != new.data_ptr()
        and old.shape == new.shape
        and old.dtype == new.dtype
        and old.device == new.device
        and old.is_contiguous()
        and new.is_contiguous()
    )


def keep_in_place(original: Callable[..., Any], self: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
    """The release's method; a reload's transformed tensors then go into the previous call's."""
    result = original(self, layer, *args, **kwargs)
    if not getattr(layer, "_mxfp8_transformed", False):
        return result
    left = _LEFT.get(layer, {})
    import torch

    with torch.no_grad():
        for name in TENSORS:
            param, old = getattr(layer, name, None), left.get(name)
            if param is not None and old is not None and _same_place(old, param.data):
                old.copy_(param.data)
                param.data = old
    _LEFT[layer] = {name: getattr(layer, name).data for name in TENSORS if getattr(layer, name, None) is not None}
    return result


PATCHES = [
    dataclasses.replace(
        wrapping_patch(
            "ascend.mxfp8_reload_in_place",
            "An RL reload copies vllm-ascend's MXFP8 linear weight and scale into the tensors captured graphs read.",
            rule=mxfp8_rule,
            wrap=around(keep_in_place),
            opt_in="mxfp8",
            static=static,
            reads=(module_file(MXFP8), module_file(MOVED)),
            reference="https://github.com/vllm-project/vllm-ascend/pull/13902",
        ),
        targets=(Target.parse(f"{MXFP8}:{METHOD}"), Target.parse(f"{MOVED}:{METHOD}")),
    ),
]
