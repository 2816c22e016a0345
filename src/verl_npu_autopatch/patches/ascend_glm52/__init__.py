"""vllm-ascend fixes for GLM-5.2 RL training (opt-in, group ``glm52``).

- ``ascend.rms_norm_residual``: ``AscendRMSNorm.forward_oot`` with a residual adds explicitly and
  runs a plain RMSNorm instead of the fused add-RMSNorm kernel.
- ``ascend.sfa_keep_kv_b_proj``: ``AscendSFAImpl.process_weights_after_loading`` keeps
  ``kv_b_proj`` (``sfa_v1.dispose_layer`` skips it), so later weight syncs can load into it.
  vllm-ascend 0.30.0rc2 keeps it itself when RL weight update is on
  (``if not self.rl_weight_update_enabled: dispose_layer(self.kv_b_proj)``, where
  ``utils.is_rl_weight_update_enabled`` = ``rl_config.enabled or weight_transfer_config``): the
  check reads the live config and records ``fixed-upstream`` when that mode is on; when it is off
  (or not known yet at import) the fix applies and steps aside per call on layers whose
  ``rl_weight_update_enabled`` is set.
- ``ascend.sfa_indexer_scale``: the lightning-indexer head weights are scaled by
  ``n_head**-0.5 * head_dim**-0.5`` before ``DeviceOperator.indexer_select_post_process``.

  Still needed on vllm-ascend 0.30.0rc2 (decided from its source): the indexer moved to
  ``attention/indexer.py``; ``AscendSFAIndexerBackend.forward`` (the standard, non-KPool path; it
  is what ``ops/mla.py`` builds unless a model supplies its own backend) takes
  ``weights = kw[:, self.head_dim:]`` (or ``forward_k``'s identical ``indexer_weights``) and passes
  them unscaled to ``DeviceOperator.indexer_select_post_process(q_li, q_li_scale,
  q_li_shape_ori, weights, ...)``, which hands them unchanged to ``npu_lightning_indexer`` /
  ``npu_lightning_indexer_quant``. Every other indexer in the same release scales these weights
  by ``softmax_scale * n_head**-0.5`` with ``softmax_scale = head_dim**-0.5``: the GLM-Next KPool
  backend (``indexer_kpool.py``), the DeepSeek-V4/V4.1 indexers, the DSA context-parallel path
  (``dsa_cp.py``), and vLLM 0.30's own ``deepseek_v2.Indexer`` (``weights * q_scale *
  softmax_scale * n_head_scale``). So the 0.30 variant targets
  ``vllm_ascend.attention.indexer:DeviceOperator.indexer_select_post_process`` (the new signature
  has no ``sfa_impl``; ``n_head`` and ``head_dim`` are the last two dims of the query, which
  ``forward`` shapes as ``q_li.view(-1, self.n_head, self.head_dim)``; ``q_li_shape_ori`` when the
  query was quantized). Not covered, as before: paths that bypass ``DeviceOperator`` (the KV-offload
  ``topk_selector``, which already receives raw weights, and context-parallel SFA).

  Which variant is decided by what the code holds, not by which module exists: vllm-ascend 0.24 -
  0.27 already ship an ``attention/indexer.py``, but there it is an 85-93 line cache-layer
  placeholder backend (no ``DeviceOperator``, no ``forward``), and the unscaled code is still
  ``AscendSFAImpl.indexer_select_post_process`` in sfa_v1. Live, the indexer variant resolves only
  where that module has ``DeviceOperator``, and a variant whose check says unsupported hands over
  to the next; the static rule follows the same order (``static.static_indexer``).

Each patch's decision is a pure rule over :class:`~.fingerprints.Code` values, used by ``check`` on the
live target and by ``scripts/compat-matrix`` (the patch's ``static`` rule) on a release's source.

Next to verl 0.9's ``patch_vllm_ascend_glm52`` (same three fixes): each of ours carries verl's
``_verl_vllm_ascend_glm52_patched`` marker, so verl run after us skips its copy. Run after verl,
the indexer scale and kv_b_proj fixes (equivalent to verl's) record ``yielded``; the RMSNorm fix
(verl's drops the norm's bias) replaces verl's and wraps the upstream method verl wrapped.

This module is the family: the live checks, the fixes and ``PATCHES``. Its helpers, each with one job:

- ``rules``: the decisions, pure rules over ``Code`` values, with the upstream names they read;
- ``static``: the static rules, those decisions on a release's source (the decision table);
- ``verify_case``: the tiny input ``doctor --verify`` runs the RMSNorm fix on.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from verl_npu_autopatch.authoring import (
    Code,
    Patch,
    Reach,
    Site,
    StaticRule,
    Target,
    Undo,
    Verdict,
    chain,
    replace_method,
    set_marked,
)
from verl_npu_autopatch.patches._verl import GLM52_MARKER, claim, over_verl, peel, yield_to_verl
from verl_npu_autopatch.patches.ascend_glm52.rules import (
    DEVICE_OP_FILE,
    INDEXER,
    INDEXER_FILE,
    LAYERNORM,
    LAYERNORM_FILE,
    SFA,
    SFA_FILE,
    indexer_backend_rule,
    indexer_rule,
    kv_b_proj_rule,
    rms_norm_rule,
)
from verl_npu_autopatch.patches.ascend_glm52.static import static_indexer, static_kv_b_proj, static_rms_norm

GROUPS = ("glm52", "ascend")
REFERENCE = "https://github.com/verl-project/verl/pull/7779"


# =========================================================================== RMSNorm
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


# =========================================================================== SFA kv_b_proj
#: Layers that ``sfa_v1.dispose_layer`` must leave alone in the current context. A tuple, so
#: nested (re-entrant) calls stack; a ContextVar, so threads and tasks never see each other's.
_preserved: ContextVar[tuple[Any, ...]] = ContextVar("verl_npu_autopatch_sfa_preserved", default=())


def _rl_weight_update(module: Any) -> bool | None:
    """Upstream's RL weight-update switch for the current vLLM config (``None``: no such switch in
    this release, no current config yet, or the Ascend config is not initialised)."""
    probe = getattr(module, "is_rl_weight_update_enabled", None)
    config = getattr(sys.modules.get("vllm.config.vllm"), "_current_vllm_config", None)
    if not callable(probe) or config is None:
        return None
    try:
        return bool(probe(config))
    except Exception:  # upstream's probe on a config it cannot read yet: not known, the fix decides per call
        return None


def _check_kv_b_proj(site: Site) -> Verdict:
    return kv_b_proj_rule(
        Code.live(site.value), callable(getattr(site.module, "dispose_layer", None)), _rl_weight_update(site.module)
    )


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
            if getattr(self, "rl_weight_update_enabled", False) is True:  # upstream keeps it (0.30+)
                return original(self, *args, **kwargs)
            token = _preserved.set((*_preserved.get(), self.kv_b_proj))
            try:
                return original(self, *args, **kwargs)
            finally:
                _preserved.reset(token)

        return claim(process_weights_after_loading, GLM52_MARKER)

    undo_dispose = set_marked(site.module, "dispose_layer", dispose_layer, name)
    return chain(undo_dispose, replace_method(site.owner, site.attribute, make, name))


# =========================================================================== SFA indexer scale
def _method_code(cls: Any, name: str) -> Code | None:
    value = getattr(cls, name, None)
    return Code.live(value) if value is not None else None


def _check_indexer(site: Site) -> Verdict:
    if site.target.module == INDEXER:
        backend = getattr(site.module, "AscendSFAIndexerBackend", None)
        return indexer_backend_rule(
            Code.live(site.value), _method_code(backend, "forward"), _method_code(backend, "forward_k")
        )
    return indexer_rule(
        Code.live(site.value), _method_code(getattr(site.module, "AscendSFAImpl", None), "indexer_select_post_process")
    )


def scale_weights(weights: Any, n_head: int, head_dim: int) -> Any:
    """The lightning-indexer head weights scaled as vLLM's own indexer does."""
    return weights * (n_head**-0.5) * (head_dim**-0.5)


def _fix_indexer(site: Site) -> Undo:
    def make_sfa(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def indexer_select_post_process(
            sfa_impl: Any, q_li: Any, q_li_scale: Any, q_li_shape_ori: Any, weights: Any, *args: Any, **kwargs: Any
        ) -> Any:
            weights = scale_weights(weights, sfa_impl.n_head, sfa_impl.head_dim)
            return original(sfa_impl, q_li, q_li_scale, q_li_shape_ori, weights, *args, **kwargs)

        return claim(indexer_select_post_process, GLM52_MARKER)

    def make_backend(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def indexer_select_post_process(
            q_li: Any, q_li_scale: Any, q_li_shape_ori: Any, weights: Any, *args: Any, **kwargs: Any
        ) -> Any:
            shape = q_li_shape_ori if q_li_shape_ori is not None else q_li.shape  # (tokens, n_head, head_dim)
            weights = scale_weights(weights, shape[-2], shape[-1])
            return original(q_li, q_li_scale, q_li_shape_ori, weights, *args, **kwargs)

        return indexer_select_post_process

    # site.owner is the class DeviceOperator resolved to on this device (Base/A5/310P).
    make = make_backend if site.target.module == INDEXER else make_sfa
    return replace_method(site.owner, site.attribute, make, site.patch.name)


#: The three patches share their reference, groups and opt-in.
_glm52_patch = functools.partial(Patch, reference=REFERENCE, groups=GROUPS, default=False)

PATCHES = [
    _glm52_patch(
        name="ascend.rms_norm_residual",
        summary="AscendRMSNorm with a residual: explicit x + residual, then a plain RMSNorm (no fused add-RMSNorm).",
        targets=(Target.parse(f"{LAYERNORM}:AscendRMSNorm.forward_oot"),),
        check=_check_rms_norm,
        fix=_fix_rms_norm,
        static=StaticRule(static_rms_norm, reads=(LAYERNORM_FILE,)),
    ),
    _glm52_patch(
        name="ascend.sfa_keep_kv_b_proj",
        summary="SFA process_weights_after_loading keeps kv_b_proj so RL weight syncs can load into it again.",
        targets=(Target.parse(f"{SFA}:AscendSFAImpl.process_weights_after_loading"),),
        reach=Reach(secondary=(Target.parse(f"{SFA}:dispose_layer"),)),
        check=_check_kv_b_proj,
        fix=_fix_kv_b_proj,
        yields_to=(yield_to_verl(),),
        static=StaticRule(static_kv_b_proj, reads=(SFA_FILE,)),
    ),
    _glm52_patch(
        name="ascend.sfa_indexer_scale",
        summary="SFA lightning-indexer weights scaled by n_head**-0.5 * head_dim**-0.5 before top-k selection.",
        # 0.30+ first: there sfa_v1 still imports DeviceOperator, with the new signature.
        targets=(
            Target.parse(f"{INDEXER}:DeviceOperator.indexer_select_post_process"),
            Target.parse(f"{SFA}:DeviceOperator.indexer_select_post_process"),
        ),
        check=_check_indexer,
        fix=_fix_indexer,
        yields_to=(yield_to_verl(),),
        static=StaticRule(static_indexer, reads=(INDEXER_FILE, SFA_FILE, DEVICE_OP_FILE)),
    ),
]
