"""The table of transformers families our torch_npu kernels patch (``MODELS``: family -> kernel
kinds and their qualname variants) and the names derived from it: modeling module, patch name,
group, enclosing callables. Data only; imports nothing of the package."""

from __future__ import annotations

REFERENCE = "https://github.com/verl-project/verl/blob/main/verl/models/transformers/npu_patch.py"
GROUP = "transformers"

#: family -> ((kind, qualname variants), ...). Kinds are the keys of ``table.KERNELS``: ``rms_norm``
#: (plain or ``(1+w)``, probed), ``rms_norm_gated``, ``mlp``/``vision_mlp`` (SwiGLU), ``rotary``
#: (full or partial, probed), ``experts`` (fused experts; else, as the second variant, the
#: sparse-MoE block: a legacy per-expert ``ModuleList`` block, or the 4.57 Qwen3-VL-MoE block
#: around fused experts that take dense routing weights — the engine tries the block when the
#: experts variant is unsupported).
MODELS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "qwen2": (
        ("rms_norm", ("Qwen2RMSNorm.forward",)),
        ("mlp", ("Qwen2MLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
    ),
    "qwen2_5_vl": (
        ("rms_norm", ("Qwen2_5_VLRMSNorm.forward", "Qwen2RMSNorm.forward")),
        ("mlp", ("Qwen2MLP.forward",)),
        ("vision_mlp", ("Qwen2_5_VLMLP.forward",)),
    ),
    "qwen3": (
        ("rms_norm", ("Qwen3RMSNorm.forward",)),
        ("mlp", ("Qwen3MLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
    ),
    "qwen3_moe": (
        ("rms_norm", ("Qwen3MoeRMSNorm.forward",)),
        ("mlp", ("Qwen3MoeMLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
        ("experts", ("Qwen3MoeExperts.forward", "Qwen3MoeSparseMoeBlock.forward")),
    ),
    "qwen3_vl": (
        ("rms_norm", ("Qwen3VLTextRMSNorm.forward",)),
        ("mlp", ("Qwen3VLTextMLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
    ),
    "qwen3_vl_moe": (
        ("rms_norm", ("Qwen3VLMoeTextRMSNorm.forward",)),
        ("mlp", ("Qwen3VLMoeTextMLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
        ("experts", ("Qwen3VLMoeTextExperts.forward", "Qwen3VLMoeTextSparseMoeBlock.forward")),
    ),
    "qwen3_next": (
        ("rms_norm", ("Qwen3NextRMSNorm.forward",)),
        ("rms_norm_gated", ("Qwen3NextRMSNormGated.forward",)),
        ("mlp", ("Qwen3NextMLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
        ("experts", ("Qwen3NextExperts.forward", "Qwen3NextSparseMoeBlock.forward")),
    ),
    "qwen3_5": (
        ("rms_norm", ("Qwen3_5RMSNorm.forward",)),
        ("rms_norm_gated", ("Qwen3_5RMSNormGated.forward",)),
        ("mlp", ("Qwen3_5MLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
    ),
    "qwen3_5_moe": (
        ("rms_norm", ("Qwen3_5MoeRMSNorm.forward",)),
        ("rms_norm_gated", ("Qwen3_5MoeRMSNormGated.forward",)),
        ("mlp", ("Qwen3_5MoeMLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
        ("experts", ("Qwen3_5MoeExperts.forward",)),
    ),
}


def module_name(family: str) -> str:
    """The modeling module of ``family`` (``transformers.models.qwen3.modeling_qwen3``)."""
    return f"transformers.models.{family}.modeling_{family}"


def patch_name(family: str, kind: str) -> str:
    return f"{GROUP}.{family}.{kind}"


def enclosing(family: str, kind: str) -> tuple[str, ...]:
    """Qualnames our ``kind`` target is only reached through: a fused experts module runs only
    while its MoE block's ``forward`` calls ``self.experts`` (verl's block forwards do not)."""
    if kind != "experts":
        return ()
    experts = dict(MODELS[family])[kind][0]
    return (experts.replace("Experts.forward", "SparseMoeBlock.forward"),)


def kinds(family: str) -> tuple[str, ...]:
    return tuple(kind for kind, _ in MODELS[family])
