"""vLLM MoE expert weight loader that accepts vllm-ascend's runtime (transposed) weight layout.

vLLM creates the fused expert weights in checkpoint layout: ``w13_weight`` is ``[E, 2*I, H]`` and
``w2_weight`` is ``[E, H, I]``. vllm-ascend's unquantized MoE method transposes both to
``[E, H, 2*I]`` / ``[E, I, H]`` for its grouped-matmul kernel (``process_weights_after_loading``).
Up to 0.25.1rc1 only ``NPUWorker.wake_up`` flips them back; from 0.26.0rc1 nothing does (the
flip-back left ``wake_up``), so every reload after the first load meets the runtime layout. RL
weight syncs hand checkpoint-shaped tensors to runtime-shaped parameters and fail with shape
mismatches (vllm-ascend #5915, verl #5479).

The fix wraps the layer class's ``weight_loader``: when the parameter is in the runtime layout
(``w1``/``w3`` with ``param.shape[1] == hidden_size``, or ``w2`` with ``param.shape[2] ==
hidden_size``), ``param.data`` is re-pointed to its ``transpose(1, 2)`` view (no copy; the Parameter
object and its attributes stay) before the original loader runs with the same arguments. The caller
(verl) runs ``process_weights_after_loading`` afterwards, which restores the runtime layout.

Ambiguity: when ``2*I == H`` (w13) or ``I == H`` (w2) both layouts have the same shape, so the rule
cannot tell them apart. The wrapper then leaves the layout alone and logs once, at debug level, on
the ``verl_npu_autopatch`` logger.

Where the loader lives, found by structure rather than version numbers (the first variant present
in the live modules wins):

* vLLM >= 0.24: ``fused_moe.routed_experts.RoutedExperts.weight_loader`` (``FusedMoE`` became a
  factory function, later renamed ``FusedMoEFactory``); ``self.hidden_size`` is an attribute.
* vLLM 0.13 - 0.23: ``fused_moe.layer.FusedMoE.weight_loader``; ``hidden_size`` is an attribute
  (0.13) or a property over ``moe_config.hidden_dim`` (0.23).

``RoutedExperts`` is listed first so that, should both ever exist, the base class that owns the
parameters is the one patched (vllm-ascend's ``AscendRoutedExperts`` inherits the wrapper).

verl 0.9 wraps ``FusedMoE.weight_loader`` itself (``vllm_v013_weight_loader_method_wrapper``, only
while ``fused_moe.FusedMoE`` is a class) with the same rule minus the square-shape guard. Ours is
strictly better, so it runs in both orders: it carries verl's ``_verl_npu_weight_loader_patched``
marker (verl then skips), and installed after verl it wraps the upstream loader under verl's
wrapper, not the wrapper, so the layout is flipped at most once.
"""

from __future__ import annotations

import functools
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Patch,
    Site,
    StaticRule,
    Target,
    Undo,
    Verdict,
    describe,
    parameter_names,
    replace_method,
    signature_text,
    unsupported,
)
from verl_npu_autopatch.engine import log
from verl_npu_autopatch.patches._verl import WEIGHT_LOADER_MARKER, claim, over_verl, peel

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: the kit's static reading is not loaded at activation
    from verl_npu_autopatch.authoring import UpstreamTree

#: The parameter names the wrapper is written for (identical in vLLM 0.13 ... 0.33).
#: Where the loader lives: the first variant present wins (see above).
TARGETS = (
    Target.parse("vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.weight_loader"),
    Target.parse("vllm.model_executor.layers.fused_moe.layer:FusedMoE.weight_loader"),
)

EXPECTED_PARAMETERS = ("self", "param", "loaded_weight", "weight_name", "shard_id", "expert_id", "return_success")

_ambiguity_logged = False


def _log_ambiguous(layer: Any, shape: Any, shard_id: str, hidden: int) -> None:
    """Log the first ambiguous call of this process at debug level."""
    global _ambiguity_logged
    if _ambiguity_logged:
        return
    _ambiguity_logged = True
    log.logger().debug(
        "vllm.moe_weight_loader: %s param of shape %s in %s is square in its last two dims "
        "(hidden_size=%d), so checkpoint and runtime layouts look alike; layout left untouched "
        "(logged once per process)",
        shard_id,
        tuple(shape),
        type(layer).__name__,
        hidden,
    )


def make_weight_loader(live: Any) -> Any:
    """Wrap the upstream loader (``live``, or the one under verl's wrapper when ``live`` is
    verl's) so a runtime-layout parameter is viewed back to checkpoint layout first.

    The per-call cost is a shape look-up and a few comparisons; nothing is inspected.
    """
    original = peel(live)

    @functools.wraps(original)
    def weight_loader(
        self: Any,
        param: Any,
        loaded_weight: Any,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> Any:
        shape = param.shape
        if len(shape) == 3:
            if shard_id == "w2":
                dim = 2
            elif shard_id == "w1" or shard_id == "w3":
                dim = 1
            else:
                dim = 0
            if dim:
                hidden = getattr(self, "hidden_size", None)
                if hidden is not None and shape[dim] == hidden:
                    if shape[1] == shape[2]:
                        _log_ambiguous(self, shape, shard_id, hidden)
                    else:
                        param.data = param.data.transpose(1, 2)
        return original(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success)

    return claim(weight_loader, WEIGHT_LOADER_MARKER)


def parameters_rule(qualname: str, names: tuple[str, ...] | None, what: str) -> Verdict:
    """Apply when the loader ``qualname`` (described as ``what``) has the known parameter list."""
    if names != EXPECTED_PARAMETERS:
        found = "no inspectable signature" if names is None else signature_text(names)
        return unsupported(f"{qualname}{signature_text(EXPECTED_PARAMETERS)}", f"{what}{found}")
    return APPLY


def _check(site: Site) -> Verdict:
    """The live loader must be a method of a class with the known parameter list."""
    if not isinstance(site.owner, type):
        return unsupported("weight_loader defined on a layer class", f"owner {site.owner!r}")
    verdict = parameters_rule(site.target.qualname, parameter_names(site.value), describe(site.value))
    if verdict.action != "apply":
        return verdict
    return over_verl(APPLY, site.value, "it also transposes square (ambiguous) expert weights")


def _fix(site: Site) -> Undo:
    """Replace the class's ``weight_loader`` by the layout-aware wrapper."""
    return replace_method(site.owner, site.attribute, make_weight_loader, site.patch.name)


def _static(tree: UpstreamTree) -> Verdict:
    """The first variant a release defines (as the engine resolves them), under the same rule."""
    for target in TARGETS:
        code = tree.code(target.module, target.qualname)
        if code is not None:
            verdict = parameters_rule(target.qualname, code.params, target.qualname)
            return Verdict("apply", f"on {target}") if verdict.action == "apply" else verdict
    return unsupported(" or ".join(str(t) for t in TARGETS), "neither in this release")


PATCHES = [
    Patch(
        name="vllm.moe_weight_loader",
        summary=(
            "MoE weight_loader views vllm-ascend's transposed (runtime-layout) expert weights back to "
            "checkpoint layout before loading, so RL weight syncs without wake_up load correctly; "
            "square (ambiguous) shapes are left alone."
        ),
        reference="https://github.com/vllm-project/vllm-ascend/issues/5915",
        groups=("vllm",),
        targets=TARGETS,
        device="npu-stack",
        default=True,
        check=_check,
        fix=_fix,
        static=StaticRule(
            _static,
            reads=(
                "vllm/model_executor/layers/fused_moe/routed_experts.py",
                "vllm/model_executor/layers/fused_moe/layer.py",
            ),
        ),
    ),
]
