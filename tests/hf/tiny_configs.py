"""Config arguments that differ between transformers releases, shared by the HF tests and the
upstream-mixin testers (``upstream/moe_testers.py``)."""

from __future__ import annotations

import inspect
from typing import Any

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
