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
  to the next; the static rule follows the same order (``_static_indexer``).

Each patch's decision is a pure rule over :class:`~._fingerprints.Code` values, used by ``check`` on the
live target and by ``scripts/compat-matrix`` (the patch's ``static`` rule) on a release's source.

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

from verl_npu_autopatch.patches._fingerprints import Code, ModuleSource, UpstreamTree, params_mismatch
from verl_npu_autopatch.patches._verl import GLM52_MARKER, claim, over_verl, peel, yield_to_verl
from verl_npu_autopatch.patching import chain, replace_method, set_marked, signature_text
from verl_npu_autopatch.spec import (
    APPLY,
    Patch,
    Site,
    StaticRule,
    Target,
    Undo,
    Verdict,
    fixed_upstream,
    unsupported,
)

GROUPS = ("glm52", "ascend")
REFERENCE = "https://github.com/verl-project/verl/pull/7779"

LAYERNORM = "vllm_ascend.ops.layernorm"
SFA = "vllm_ascend.attention.sfa_v1"
INDEXER = "vllm_ascend.attention.indexer"
DEVICE_OP = "vllm_ascend.device.device_op"

LAYERNORM_FILE = "vllm_ascend/ops/layernorm.py"
SFA_FILE = "vllm_ascend/attention/sfa_v1.py"
INDEXER_FILE = "vllm_ascend/attention/indexer.py"
DEVICE_OP_FILE = "vllm_ascend/device/device_op.py"


# =========================================================================== RMSNorm
RMS_PARAMS = ("self", "x", "residual")


def rms_norm_rule(forward_oot: Code) -> Verdict:
    """Decide on ``AscendRMSNorm.forward_oot``."""
    mismatch = params_mismatch(forward_oot, RMS_PARAMS, "forward_oot")
    if mismatch:
        return mismatch
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


#: 0.30.0rc2: upstream disposes kv_b_proj only outside RL weight-update mode.
RL_KEEPS = "ifnotself.rl_weight_update_enabled:dispose_layer(self.kv_b_proj)"
RL_MODE = "RL weight-update mode (additional_config.rl_config.enabled or --weight-transfer-config)"


def kv_b_proj_rule(process: Code, module_has_dispose_layer: bool, rl_update: bool | None = None) -> Verdict:
    """Decide on ``AscendSFAImpl.process_weights_after_loading`` and the module's ``dispose_layer``;
    ``rl_update`` is upstream's RL weight-update switch in the live config (``None``: not known)."""
    mismatch = params_mismatch(process, PWAL_PARAMS, "process_weights_after_loading")
    if mismatch:
        return mismatch
    if not process.has("dispose_layer(self.kv_b_proj)"):
        return fixed_upstream("process_weights_after_loading no longer disposes self.kv_b_proj")
    if not module_has_dispose_layer:
        return unsupported("a module-global dispose_layer in sfa_v1", "none")
    if process.has(RL_KEEPS):
        if rl_update:
            return fixed_upstream(f"upstream keeps kv_b_proj in {RL_MODE}, which is on")
        return Verdict(
            "apply",
            f"upstream keeps kv_b_proj only in {RL_MODE}; decided at run time: fixed-upstream when the "
            "live config has it on, else the fix keeps kv_b_proj (and steps aside per call on layers "
            "whose rl_weight_update_enabled is set)",
        )
    return APPLY


def _rl_weight_update(module: Any) -> bool | None:
    """Upstream's RL weight-update switch for the current vLLM config (``None``: no such switch in
    this release, no current config yet, or the Ascend config is not initialised)."""
    import sys

    probe = getattr(module, "is_rl_weight_update_enabled", None)
    config = getattr(sys.modules.get("vllm.config.vllm"), "_current_vllm_config", None)
    if not callable(probe) or config is None:
        return None
    try:
        return bool(probe(config))
    except Exception:
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


def _static_kv_b_proj(tree: UpstreamTree) -> Verdict:
    module = tree.module(SFA)
    code = module.code("AscendSFAImpl.process_weights_after_loading") if module else None
    if code is None:
        return unsupported(f"{SFA}:AscendSFAImpl.process_weights_after_loading", _absent(tree, SFA))
    return kv_b_proj_rule(code, module.binds("dispose_layer"))


# =========================================================================== SFA indexer scale
INDEXER_PARAMS = ("sfa_impl", "q_li", "q_li_scale", "q_li_shape_ori", "weights")
#: 0.30.0rc2: ``DeviceOperator.indexer_select_post_process`` without ``sfa_impl``.
BACKEND_PARAMS = ("q_li", "q_li_scale", "q_li_shape_ori", "weights")
BACKEND_CALL = "DeviceOperator.indexer_select_post_process(q_li,q_li_scale,q_li_shape_ori,weights,"
SCALED = ("n_head**-0.5", "head_dim**-0.5")


def _post_process_params(post_process: Code, expected: tuple[str, ...]) -> Verdict | None:
    found = post_process.params[: len(expected)] if post_process.params else post_process.params
    if found == expected:
        return None
    return unsupported(
        f"DeviceOperator.indexer_select_post_process{signature_text((*expected, '...'))}",
        f"DeviceOperator.indexer_select_post_process{signature_text(post_process.params)}",
    )


def indexer_rule(post_process: Code, impl: Code | None) -> Verdict:
    """Decide on ``DeviceOperator.indexer_select_post_process`` (the patched staticmethod) and the
    ``AscendSFAImpl.indexer_select_post_process`` that builds its weights (0.21 - 0.29)."""
    wrong = _post_process_params(post_process, INDEXER_PARAMS)
    if wrong:
        return wrong
    if impl is None or impl.source is None:
        return unsupported("AscendSFAImpl.indexer_select_post_process in sfa_v1", "none")
    if impl.has(*SCALED):
        return fixed_upstream("AscendSFAImpl.indexer_select_post_process already scales the indexer weights")
    if not impl.has("weights=kw[:,self.head_dim:]", "DeviceOperator.indexer_select_post_process("):
        return unsupported(
            "AscendSFAImpl.indexer_select_post_process slicing weights=kw[:, self.head_dim:] and calling "
            "DeviceOperator.indexer_select_post_process",
            "a different body",
        )
    return APPLY


def indexer_backend_rule(post_process: Code, forward: Code | None, forward_k: Code | None) -> Verdict:
    """Decide on 0.30's ``DeviceOperator.indexer_select_post_process`` and the standard
    ``AscendSFAIndexerBackend.forward`` / ``forward_k`` of ``attention/indexer.py`` feeding it."""
    wrong = _post_process_params(post_process, BACKEND_PARAMS)
    if wrong:
        return wrong
    if forward is None or forward.source is None:
        return unsupported(f"{INDEXER}:AscendSFAIndexerBackend.forward", "none")
    bodies = [c for c in (forward, forward_k) if c is not None]
    if any(c.has(SCALED[0]) or c.has("softmax_scale*") for c in bodies):
        return fixed_upstream("AscendSFAIndexerBackend already scales the indexer weights")
    if not forward.has(BACKEND_CALL) or not any(c.has("kw[:,self.head_dim:]") for c in bodies):
        return unsupported(
            "AscendSFAIndexerBackend.forward taking kw[:, self.head_dim:] as weights and calling "
            "DeviceOperator.indexer_select_post_process(q_li, q_li_scale, q_li_shape_ori, weights, ...)",
            "a different body",
        )
    return Verdict(
        "apply",
        "the standard AscendSFAIndexerBackend (attention/indexer.py) passes kw[:, head_dim:] unscaled to "
        "DeviceOperator.indexer_select_post_process; the GLM-Next KPool backend scales its own and is untouched",
    )


def _live_code(cls: Any, name: str) -> Code | None:
    value = getattr(cls, name, None)
    return Code.live(value) if value is not None else None


def _check_indexer(site: Site) -> Verdict:
    if site.target.module == INDEXER:
        backend = getattr(site.module, "AscendSFAIndexerBackend", None)
        return indexer_backend_rule(
            Code.live(site.value), _live_code(backend, "forward"), _live_code(backend, "forward_k")
        )
    return indexer_rule(
        Code.live(site.value), _live_code(getattr(site.module, "AscendSFAImpl", None), "indexer_select_post_process")
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


PLACEHOLDER_NOTE = (
    "attention/indexer.py here is a cache-layer placeholder (no AscendSFAIndexerBackend.forward); "
    "the unscaled weights are AscendSFAImpl.indexer_select_post_process's, in sfa_v1"
)


def _static_indexer(tree: UpstreamTree) -> Verdict:
    """The engine's variant order on the release's source: a variant counts only where its module
    holds the unscaled code the fix is for, and one whose rule says unsupported hands over to the
    next, as ``_pipeline.run`` does. vllm-ascend 0.24 - 0.27 ship an ``attention/indexer.py`` that
    is only a cache-layer placeholder (no ``DeviceOperator``, no ``AscendSFAIndexerBackend.forward``):
    there the unscaled code is still ``AscendSFAImpl.indexer_select_post_process`` in sfa_v1."""
    passed: list[str] = []
    notes: list[str] = []
    for variant in (_static_backend_variant, _static_sfa_variant):
        verdict = variant(tree)
        if verdict is None:
            if variant is _static_backend_variant and tree.has_module(INDEXER):
                notes.append(PLACEHOLDER_NOTE)
            continue
        if verdict.action != "unsupported":
            return Verdict(verdict.action, "; ".join(r for r in (verdict.reason, *notes) if r))
        passed.append(verdict.reason)
    if not passed:
        return unsupported(
            f"{INDEXER}:AscendSFAIndexerBackend.forward or {SFA}:AscendSFAImpl.indexer_select_post_process",
            "neither",
        )
    return Verdict("unsupported", " | ".join(passed))


def _static_backend_variant(tree: UpstreamTree) -> Verdict | None:
    """0.28+: ``attention/indexer.py`` with the standard backend's forward (``None``: the module is
    absent or a placeholder without it)."""
    indexer = tree.module(INDEXER)
    forward = indexer.code("AscendSFAIndexerBackend.forward") if indexer else None
    if indexer is None or forward is None or not indexer.imports_from(DEVICE_OP, "DeviceOperator"):
        return None
    return _static_device_classes(
        tree,
        indexer,
        f"{INDEXER}:DeviceOperator.indexer_select_post_process",
        lambda code: indexer_backend_rule(code, forward, indexer.code("AscendSFAIndexerBackend.forward_k")),
    )


def _static_sfa_variant(tree: UpstreamTree) -> Verdict | None:
    """0.21 - 0.27: ``AscendSFAImpl.indexer_select_post_process`` in sfa_v1 (``None``: no sfa_v1,
    or it no longer defines that method)."""
    sfa = tree.module(SFA)
    impl = sfa.code("AscendSFAImpl.indexer_select_post_process") if sfa else None
    if sfa is None or impl is None:
        return None
    target = f"{SFA}:DeviceOperator.indexer_select_post_process"
    return _static_device_classes(tree, sfa, target, lambda code: indexer_rule(code, impl))


def _static_device_classes(
    tree: UpstreamTree, module: ModuleSource, target: str, rule: Callable[[Code], Verdict]
) -> Verdict:
    """``rule`` on every device class ``DeviceOperator`` can resolve to, combined."""
    device_op = tree.module(DEVICE_OP)
    if not module.imports_from(DEVICE_OP, "DeviceOperator") or device_op is None:
        return unsupported(target, f"{target.partition(':')[0]} has no DeviceOperator from {DEVICE_OP}")
    verdicts: dict[str, Verdict] = {}
    for cls in device_op.returned_names("get_device_adaptor") or _adaptor_classes(device_op) or ["BaseDeviceAdaptor"]:
        code = device_op.code(f"{cls}.indexer_select_post_process")
        verdicts[cls] = (
            unsupported(target, f"{DEVICE_OP}.{cls} has no indexer_select_post_process") if code is None else rule(code)
        )
    return _combine(verdicts)


def _adaptor_classes(device_op: ModuleSource) -> list[str]:
    """The device classes of a ``get_device_adaptor`` that looks them up in a dict (0.30)."""
    import ast

    node = device_op._top("get_device_adaptor")
    if node is None:
        return []
    return [
        value.id
        for sub in ast.walk(node)
        if isinstance(sub, ast.Dict)
        for value in sub.values
        if isinstance(value, ast.Name)
    ]


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
        static=StaticRule(_static_rms_norm, reads=(LAYERNORM_FILE,)),
    ),
    Patch(
        name="ascend.sfa_keep_kv_b_proj",
        summary="SFA process_weights_after_loading keeps kv_b_proj so RL weight syncs can load into it again.",
        reference=REFERENCE,
        groups=GROUPS,
        targets=(Target.parse(f"{SFA}:AscendSFAImpl.process_weights_after_loading"),),
        secondary=(Target.parse(f"{SFA}:dispose_layer"),),
        default=False,
        check=_check_kv_b_proj,
        fix=_fix_kv_b_proj,
        yields_to=(yield_to_verl(),),
        static=StaticRule(_static_kv_b_proj, reads=(SFA_FILE,)),
    ),
    Patch(
        name="ascend.sfa_indexer_scale",
        summary="SFA lightning-indexer weights scaled by n_head**-0.5 * head_dim**-0.5 before top-k selection.",
        reference=REFERENCE,
        groups=GROUPS,
        # 0.30+ first: there sfa_v1 still imports DeviceOperator, with the new signature.
        targets=(
            Target.parse(f"{INDEXER}:DeviceOperator.indexer_select_post_process"),
            Target.parse(f"{SFA}:DeviceOperator.indexer_select_post_process"),
        ),
        default=False,
        check=_check_indexer,
        fix=_fix_indexer,
        yields_to=(yield_to_verl(),),
        static=StaticRule(_static_indexer, reads=(INDEXER_FILE, SFA_FILE, DEVICE_OP_FILE)),
    ),
]
