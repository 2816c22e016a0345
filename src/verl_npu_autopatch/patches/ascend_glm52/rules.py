"""The decisions of the GLM-5.2 vllm-ascend patches (``ascend_glm52``): pure rules over
:class:`~.fingerprints.Code` values, with the upstream names and source fingerprints they read.
The live ``check`` calls them on the imported target, the static rules (``static``) on a
release's source, so both decide with the one implementation."""

from __future__ import annotations

from verl_npu_autopatch.authoring import APPLY, Code, Verdict, fixed_upstream, signature_text, takes, unsupported

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


@takes("forward_oot", RMS_PARAMS)
def rms_norm_rule(forward_oot: Code) -> Verdict:
    """Decide on ``AscendRMSNorm.forward_oot``."""
    if forward_oot.has("residual=x+residual", "npu_rms_norm(residual,self.weight"):
        return fixed_upstream("forward_oot already adds the residual explicitly before npu_rms_norm")
    if not forward_oot.has("npu_add_rms_norm"):
        return unsupported("a fused npu_add_rms_norm call on the residual path", "forward_oot without it")
    return APPLY


# =========================================================================== SFA kv_b_proj
PWAL_PARAMS = ("self", "act_dtype")

#: 0.30.0rc2: upstream disposes kv_b_proj only outside RL weight-update mode.
RL_KEEPS = "ifnotself.rl_weight_update_enabled:dispose_layer(self.kv_b_proj)"
RL_MODE = "RL weight-update mode (additional_config.rl_config.enabled or --weight-transfer-config)"


@takes("process_weights_after_loading", PWAL_PARAMS)
def kv_b_proj_rule(process: Code, module_has_dispose_layer: bool, rl_update: bool | None = None) -> Verdict:
    """Decide on ``AscendSFAImpl.process_weights_after_loading`` and the module's ``dispose_layer``;
    ``rl_update`` is upstream's RL weight-update switch in the live config (``None``: not known)."""
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
