"""``ascend.dsv4_dummy_wo_a``: DeepSeek-V4 starts with ``load_format=dummy`` (what RL rollouts use
before the first weight sync): its attention output projection ``wo_a`` gets the 3-D layout the
attention kernel reads (opt-in, group ``dsv4``).

vllm-ascend keeps DeepSeek-V4's unquantized ``wo_a`` as ``[n_local_groups, hidden, o_lora_rank]``
for ``npu_transpose_batchmatmul``. Up to 0.27.1rc1 only ``AscendColumnParallelLinear.weight_loader``
makes that layout (from the 2-D ``[groups * rank, hidden]`` it was created with, when the release's
own condition holds: not an A5 card up to 0.26.0rc1; from 0.27.1rc1 a card without dynamic MX quant
fusion, or an unquantized bf16 load on one with it). vLLM's dummy loader fills the parameters
without running any ``weight_loader``, so ``wo_a`` stays 2-D and the first forward (the start-up
profile run) fails in the batched matmul (vllm-ascend issue #17197). 0.28.0rc1 reshapes it in
``AscendUnquantizedLinearMethod.process_weights_after_loading`` (PR #16485): ``fixed-upstream``.

That method is ``ascend.gate_fp32_in_place``'s target; the fix takes the site where the load is
skipped instead: it wraps vLLM's ``DummyModelLoader.load_weights`` and, after it, gives every
unquantized ``wo_a`` the release's ``weight_loader`` would have reshaped the layout it would have
made (``view(groups, rank, hidden).transpose(2, 1)``), before the loader's
``process_weights_after_loading`` runs, in the order of a real load. A later weight sync then
takes the release's in-place branch for a 3-D ``wo_a``. The vllm-ascend code is read from its
installed files (the rule runs while vLLM's model loader is being imported).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Site,
    Verdict,
    around,
    decides,
    fixed_upstream,
    module_file,
    unsupported,
    wrapping_patch,
)
from verl_npu_autopatch.patches._installed_source import installed_code

LOADER = "vllm.model_executor.model_loader.dummy_loader"
METHOD = "DummyModelLoader.load_weights"
LINEAR = "vllm_ascend.ops.linear"
LAYER = "AscendColumnParallelLinear"
WEIGHT_LOADER = f"{LAYER}.weight_loader"
PROCESS = "AscendUnquantizedLinearMethod.process_weights_after_loading"
#: What the rule looks for (whitespace-free).
#: vLLM's dummy fill: the whole module (to 0.29) or each of its own tensors (0.30 on).
DUMMY = ("initialize_dummy_weights(", "initialize_single_dummy_weight(")
TO_3D = ".view(self.n_local_groups,self.o_lora_rank,-1).transpose(2,1)"
#: The same reshape in the post-load step (0.28.0rc1 on).
PROCESS_TO_3D = ".view(layer.n_local_groups,layer.o_lora_rank,-1).transpose(2,1)"
NOT_A5 = "get_ascend_device_type()!=AscendDeviceType.A5"
FUSION = "HardwareCapability.DYNAMIC_MX_QUANT_FUSION"
#: The release's condition for the 3-D layout, by the form its ``weight_loader`` writes it in.
FORMS = {NOT_A5: "not_a5", FUSION: "fusion"}


def layout_form(weight_loader: Code | None) -> str | None:
    """Which condition the release's ``weight_loader`` reshapes ``wo_a`` under, or ``None``."""
    if weight_loader is None or not weight_loader.has('"wo_a"inself.prefix', TO_3D):
        return None
    return next((form for needle, form in FORMS.items() if weight_loader.has(needle)), None)


@decides(
    f"{LOADER}:{METHOD}",
    ("self", "model", "model_config"),
    reading=(f"{LINEAR}:{WEIGHT_LOADER}", f"{LINEAR}:{PROCESS}"),
)
def wo_a_rule(load: Code, weight_loader: Code | None, process: Code | None) -> Verdict:
    """vLLM's dummy ``load_weights`` read with vllm-ascend's ``wo_a`` loader and post-load step."""
    if not any(load.has(fill) for fill in DUMMY):
        return unsupported("DummyModelLoader.load_weights filling the layers with vLLM's dummy values", "another")
    if process is not None and process.has(PROCESS_TO_3D):
        return fixed_upstream(f"{PROCESS} reshapes wo_a to 3-D itself, so dummy loads get the layout too")
    if weight_loader is None or not weight_loader.has(TO_3D):
        return unsupported(f"{LINEAR}:{WEIGHT_LOADER} reshaping wo_a to [groups, hidden, rank]", "none")
    if layout_form(weight_loader) is None:
        return unsupported("the wo_a reshape under the A5 or the dynamic-MX-quant-fusion condition", "another")
    return APPLY


def _check(site: Site) -> Verdict:
    """The rule on the live loader and vllm-ascend's installed ``linear.py``."""
    return wo_a_rule(Code.live(site.value), *(installed_code(t.module, t.qualname) for t in wo_a_rule.reading))


def _takes_3d(layer: Any, linear: Any, form: str) -> bool:
    """The release's condition for ``layer``'s 3-D layout, with ``linear``'s own helpers."""
    if form == "not_a5":
        return bool(linear.get_ascend_device_type() != linear.AscendDeviceType.A5)
    import torch

    fusion = linear.get_current_hardware_profile().supports(linear.HardwareCapability.DYNAMIC_MX_QUANT_FUSION)
    return not fusion or (layer.quant_config is None and layer.weight.dtype == torch.bfloat16)


def to_3d(layer: Any, linear: Any, form: str) -> bool:
    """Give an unquantized 2-D ``wo_a`` of ``linear`` the layout its ``weight_loader`` makes; whether it did."""
    unquantized = getattr(linear, PROCESS.partition(".")[0], None)
    weight: Any = getattr(layer, "weight", None)
    groups, rank = getattr(layer, "n_local_groups", 0), getattr(layer, "o_lora_rank", 0)
    if not (
        isinstance(layer, getattr(linear, LAYER))
        and unquantized is not None
        and isinstance(getattr(layer, "quant_method", None), unquantized)
        and "wo_a" in getattr(layer, "prefix", "")
        and getattr(weight, "ndim", 0) == 2
        and isinstance(groups, int)
        and isinstance(rank, int)
        and groups * rank > 0
        and weight.shape[0] == groups * rank
        and _takes_3d(layer, linear, form)
    ):
        return False
    weight.data = weight.data.view(groups, rank, -1).transpose(2, 1).contiguous()
    return True


def reshape_after_dummy(original: Callable[..., Any], self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM's dummy ``load_weights``; then every ``wo_a`` the release's loader would reshape is 3-D."""
    result = original(self, model, *args, **kwargs)
    linear = sys.modules.get(LINEAR)
    loader = getattr(getattr(linear, LAYER, None), "weight_loader", None)
    form = layout_form(Code.live(loader)) if loader is not None else None
    if form is not None:
        for layer in model.modules():
            to_3d(layer, linear, form)
    return result


PATCHES = [
    dataclasses.replace(
        wrapping_patch(
            "ascend.dsv4_dummy_wo_a",
            "DeepSeek-V4's wo_a gets its 3-D layout under load_format=dummy, as a real load gives it.",
            rule=wo_a_rule,
            wrap=around(reshape_after_dummy),
            opt_in="dsv4",
            reads=(module_file(LOADER), module_file(LINEAR)),
            reference="https://github.com/vllm-project/vllm-ascend/pull/16485",
        ),
        check=_check,
    ),
]
