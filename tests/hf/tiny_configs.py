"""The tiny model dimensions and the config arguments that differ between transformers releases,
shared by the HF tests (``conftest.py``) and the upstream-mixin testers (``upstream/moe_testers.py``)."""

from __future__ import annotations

import inspect
from typing import Any

#: Dimensions of every tiny random model.
DIMS: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
#: The MoE families' routed experts.
MOE: dict[str, Any] = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1
)
#: Hybrid linear/full attention layers (Qwen3-Next, Qwen3.5).
LINEAR: dict[str, Any] = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_conv_kernel_dim=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)

#: Multimodal rotary of the tiny Qwen2.5-VL / Qwen3-VL(-MoE) text models (head_dim 8: sections 2+1+1).
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}


def rope_arguments(config_cls: type, extra: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` as the live config class takes it: transformers 5.x has one dict;
    4.x has ``rope_theta``, ``partial_rotary_factor`` and a ``rope_scaling`` dict."""
    if "rope_parameters" not in extra or "rope_parameters" in inspect.signature(config_cls).parameters:
        return extra
    extra = dict(extra)
    scaling = dict(extra.pop("rope_parameters"))
    extra["rope_theta"] = scaling.pop("rope_theta")
    if "partial_rotary_factor" in scaling:
        extra["partial_rotary_factor"] = scaling.pop("partial_rotary_factor")
    return {**extra, "rope_scaling": scaling}
