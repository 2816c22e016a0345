"""vllm-ascend fixes for GLM-5.2 RL training (opt-in, group ``glm52``).

- ``ascend.rms_norm_residual``: ``AscendRMSNorm.forward_oot`` with a residual adds explicitly and
  runs a plain RMSNorm instead of the fused add-RMSNorm kernel.
- ``ascend.sfa_keep_kv_b_proj``: ``AscendSFAImpl.process_weights_after_loading`` keeps
  ``kv_b_proj`` (``sfa_v1.dispose_layer`` skips it), so later weight syncs can load into it.
- ``ascend.sfa_indexer_scale``: the lightning-indexer head weights are scaled by
  ``n_head**-0.5 * head_dim**-0.5`` before ``DeviceOperator.indexer_select_post_process``.

Each patch's decision is a pure rule over :class:`~._shapes.Code` values, used by ``check`` on the
live target and by ``scripts/compat-matrix`` (``STATIC``) on a release's source.

Next to verl 0.9's ``patch_vllm_ascend_glm52`` (same three fixes): each of ours carries verl's
``_verl_vllm_ascend_glm52_patched`` marker, so verl run after us skips its copy. Run after verl,
the indexer scale and kv_b_proj fixes (equivalent to verl's) record ``yielded``; the RMSNorm fix
(verl's drops the norm's bias) replaces verl's and wraps the upstream method verl wrapped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from verl_npu_autopatch.patches._shapes import Code, UpstreamTree, signature_text
from verl_npu_autopatch.patches._verl import GLM52_MARKER, claim, over_verl, peel, yield_to_verl
from verl_npu_autopatch.patching import chain, mark, replace_method, set_attribute
from verl_npu_autopatch.spec import APPLY, Patch, Site, Target, Undo, Verdict, fixed_upstream, unsupported

GROUPS = ("glm52", "ascend")
REFERENCE = "https://github.com/verl-project/verl/pull/7779"

LAYERNORM = "vllm_ascend.ops.layernorm"
SFA = "vllm_ascend.attention.sfa_v1"
DEVICE_OP = "vllm_ascend.device.device_op"


# =========================================================================== RMSNorm
RMS_PARAMS = ("self", "x", "residual")


def rms_norm_rule(forward_oot: Code) -> Verdict:
    """Decide on ``AscendRMSNorm.forward_oot``."""
    if forward_oot.params != RMS_PARAMS:
        return unsupported(
            f"forward_oot{signature_text(RMS_PARAMS)}", f"forward_oot{signature_text(forward_oot.params)}"
        )
    if forward_oot.has("residual=x+residual", "npu_rms_norm(residual,self.weight"):
        return fixed_upstream("forward_oot already adds the residual explicitly before npu_rms_norm")
    if not forward_oot.has("npu_add_rms_norm"):
        return unsupported("a fused npu_add_rms_norm call on the residual path", "forward_oot without it")
    return APPLY


def _check_rms_norm(site: Site) -> Verdict:
    return over_verl(rms_norm_rule(Code.live(site.value)), site.value, "it drops the norm's bias")


def _fix_rms_norm(site: Site) -> Undo:
    module = site.module
    chunks = Code.live(site.value).has("maybe_chunk_residual")

    def make(live: Callable[..., Any]) -> Callable[..., Any]:
        original = peel(live)  # the release's method, also when verl's copy is in place

        @functools.wraps(original)
        def forward_oot(self: Any, x: Any, residual: Any = None) -> Any:
            if residual is None:
                return original(self, x, residual)
            import torch_npu

            if chunks:  # the TP residual chunking the release does before its fused kernel
                residual = module.torch.ops.vllm.maybe_chunk_residual(x, residual)
            residual = x + residual
            out = torch_npu.npu_rms_norm(residual, self.weight, epsilon=self.variance_epsilon)[0]
            bias = getattr(self, "bias", None)
            if bias is not None:
                out.add_(bias)
            return out, residual

        return claim(forward_oot, GLM52_MARKER)

    return replace_method(site.owner, site.attribute, make, site.patch.name)


def _static_rms_norm(tree: UpstreamTree) -> Verdict:
    code = tree.code(LAYERNORM, "AscendRMSNorm.forward_oot")
    if code is None:
        return unsupported(f"{LAYERNORM}:AscendRMSNorm.forward_oot", _absent(tree, LAYERNORM))
    return rms_norm_rule(code)


# =========================================================================== SFA kv_b_proj
PWAL_PARAMS = ("self", "act_dtype")

#: Layers that ``sfa_v1.dispose_layer`` must leave alone in the current context. A tuple, so
#: nested (re-entrant) calls stack; a ContextVar, so threads and tasks never see each other's.
_preserved: ContextVar[tuple[Any, ...]] = ContextVar("verl_npu_autopatch_sfa_preserved", default=())


def kv_b_proj_rule(process: Code, module_has_dispose_layer: bool) -> Verdict:
    """Decide on ``AscendSFAImpl.process_weights_after_loading`` and the module's ``dispose_layer``."""
    if process.params != PWAL_PARAMS:
        return unsupported(
            f"process_weights_after_loading{signature_text(PWAL_PARAMS)}",
            f"process_weights_after_loading{signature_text(process.params)}",
        )
    if not process.has("dispose_layer(self.kv_b_proj)"):
        return fixed_upstream("process_weights_after_loading no longer disposes self.kv_b_proj")
    if not module_has_dispose_layer:
        return unsupported("a module-global dispose_layer in sfa_v1", "none")
    return APPLY


def _check_kv_b_proj(site: Site) -> Verdict:
    return kv_b_proj_rule(Code.live(site.value), callable(getattr(site.module, "dispose_layer", None)))


def _fix_kv_b_proj(site: Site) -> Undo:
    name = site.patch.name
    original_dispose = site.module.dispose_layer

    @functools.wraps(original_dispose)
    def dispose_layer(layer: Any, *args: Any, **kwargs: Any) -> Any:
        if any(layer is kept for kept in _preserved.get()):
            return None
        return original_dispose(layer, *args, **kwargs)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def process_weights_after_loading(self: Any, *args: Any, **kwargs: Any) -> Any:
            token = _preserved.set((*_preserved.get(), self.kv_b_proj))
            try:
                return original(self, *args, **kwargs)
            finally:
                _preserved.reset(token)

        return claim(process_weights_after_loading, GLM52_MARKER)

    undo_dispose = set_attribute(site.module, "dispose_layer", mark(dispose_layer, name))
    return chain(undo_dispose, replace_method(site.owner, site.attribute, make, name))


def _static_kv_b_proj(tree: UpstreamTree) -> Verdict:
    module = tree.module(SFA)
    code = module.code("AscendSFAImpl.process_weights_after_loading") if module else None
    if code is None:
        return unsupported(f"{SFA}:AscendSFAImpl.process_weights_after_loading", _absent(tree, SFA))
    return kv_b_proj_rule(code, module.binds("dispose_layer"))


# =========================================================================== SFA indexer scale
INDEXER_PARAMS = ("sfa_impl", "q_li", "q_li_scale", "q_li_shape_ori", "weights")


def indexer_rule(post_process: Code, impl: Code | None) -> Verdict:
    """Decide on ``DeviceOperator.indexer_select_post_process`` (the patched staticmethod) and the
    ``AscendSFAImpl.indexer_select_post_process`` that builds its weights."""
    found = post_process.params[: len(INDEXER_PARAMS)] if post_process.params else post_process.params
    if found != INDEXER_PARAMS:
        return unsupported(
            f"DeviceOperator.indexer_select_post_process{signature_text((*INDEXER_PARAMS, '...'))}",
            f"DeviceOperator.indexer_select_post_process{signature_text(post_process.params)}",
        )
    if impl is None or impl.source is None:
        return unsupported("AscendSFAImpl.indexer_select_post_process in sfa_v1", "none")
    if impl.has("n_head**-0.5", "head_dim**-0.5"):
        return fixed_upstream("AscendSFAImpl.indexer_select_post_process already scales the indexer weights")
    if not impl.has("weights=kw[:,self.head_dim:]", "DeviceOperator.indexer_select_post_process("):
        return unsupported(
            "AscendSFAImpl.indexer_select_post_process slicing weights=kw[:, self.head_dim:] and calling "
            "DeviceOperator.indexer_select_post_process",
            "a different body",
        )
    return APPLY


def _check_indexer(site: Site) -> Verdict:
    impl_cls = getattr(site.module, "AscendSFAImpl", None)
    impl = getattr(impl_cls, "indexer_select_post_process", None)
    return indexer_rule(Code.live(site.value), Code.live(impl) if impl is not None else None)


def _fix_indexer(site: Site) -> Undo:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def indexer_select_post_process(
            sfa_impl: Any, q_li: Any, q_li_scale: Any, q_li_shape_ori: Any, weights: Any, *args: Any, **kwargs: Any
        ) -> Any:
            weights = weights * (sfa_impl.n_head**-0.5) * (sfa_impl.head_dim**-0.5)
            return original(sfa_impl, q_li, q_li_scale, q_li_shape_ori, weights, *args, **kwargs)

        return claim(indexer_select_post_process, GLM52_MARKER)

    # site.owner is the class sfa_v1.DeviceOperator resolved to on this device (Base/A5/310P).
    return replace_method(site.owner, site.attribute, make, site.patch.name)


def _static_indexer(tree: UpstreamTree) -> Verdict:
    target = f"{SFA}:DeviceOperator.indexer_select_post_process"
    sfa, device_op = tree.module(SFA), tree.module(DEVICE_OP)
    if sfa is None or not sfa.imports_from(DEVICE_OP, "DeviceOperator") or device_op is None:
        return unsupported(target, f"{SFA} has no DeviceOperator from {DEVICE_OP}")
    impl = sfa.code("AscendSFAImpl.indexer_select_post_process")
    verdicts: dict[str, Verdict] = {}
    for cls in device_op.returned_names("get_device_adaptor") or ["BaseDeviceAdaptor"]:
        code = device_op.code(f"{cls}.indexer_select_post_process")
        verdicts[cls] = (
            unsupported(target, f"{DEVICE_OP}.{cls} has no indexer_select_post_process")
            if code is None
            else indexer_rule(code, impl)
        )
    return _combine(verdicts)


# =========================================================================== helpers
def _absent(tree: UpstreamTree, module: str) -> str:
    return f"{module} is missing" if not tree.has_module(module) else f"{module} without it"


def _combine(verdicts: dict[str, Verdict]) -> Verdict:
    """One verdict for several device classes: theirs when they agree, else the first that is not
    ``apply`` with the class named."""
    distinct = {(v.action, v.reason) for v in verdicts.values()}
    if len(distinct) == 1:
        return next(iter(verdicts.values()))
    cls, worst = next((c, v) for c, v in verdicts.items() if v.action != "apply")
    return Verdict(worst.action, f"{cls}: {worst.reason}")


PATCHES = [
    Patch(
        name="ascend.rms_norm_residual",
        summary="AscendRMSNorm with a residual: explicit x + residual, then a plain RMSNorm (no fused add-RMSNorm).",
        reference=REFERENCE,
        groups=GROUPS,
        targets=(Target.parse(f"{LAYERNORM}:AscendRMSNorm.forward_oot"),),
        default=False,
        check=_check_rms_norm,
        fix=_fix_rms_norm,
    ),
    Patch(
        name="ascend.sfa_keep_kv_b_proj",
        summary="SFA process_weights_after_loading keeps kv_b_proj so RL weight syncs can load into it again.",
        reference=REFERENCE,
        groups=GROUPS,
        targets=(Target.parse(f"{SFA}:AscendSFAImpl.process_weights_after_loading"),),
        default=False,
        check=_check_kv_b_proj,
        fix=_fix_kv_b_proj,
        yields_to=(yield_to_verl(),),
    ),
    Patch(
        name="ascend.sfa_indexer_scale",
        summary="SFA lightning-indexer weights scaled by n_head**-0.5 * head_dim**-0.5 before top-k selection.",
        reference=REFERENCE,
        groups=GROUPS,
        targets=(Target.parse(f"{SFA}:DeviceOperator.indexer_select_post_process"),),
        default=False,
        check=_check_indexer,
        fix=_fix_indexer,
        yields_to=(yield_to_verl(),),
    ),
]

#: Static checks for ``scripts/compat-matrix``: patch name → rule applied to a release's source.
STATIC: dict[str, Callable[[UpstreamTree], Verdict]] = {
    "ascend.rms_norm_residual": _static_rms_norm,
    "ascend.sfa_keep_kv_b_proj": _static_kv_b_proj,
    "ascend.sfa_indexer_scale": _static_indexer,
}
