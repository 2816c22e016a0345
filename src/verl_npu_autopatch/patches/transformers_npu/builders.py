"""What installs a transformers kernel on its target: a builder takes the live ``Site`` and what
the probe found, imports the kernels (``kernels``, and with them torch) at fix time, installs
the replacement and returns the undo."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import Site, Undo, set_marked

Replacement = Callable[[Any, Any, dict[str, Any]], Any]


def replacing(make: Replacement) -> Callable[[Site, dict[str, Any]], Undo]:
    """A builder installing ``make(kernels, original, found)`` on the target; the kernels
    (and torch) are imported then, at fix time."""

    def build(site: Site, found: dict[str, Any]) -> Undo:
        import verl_npu_autopatch.patches.transformers_npu.kernels as kernels

        return set_marked(site.owner, site.attribute, make(kernels, site.value, found), site.patch.name)

    return build


def build_experts(site: Site, found: dict[str, Any]) -> Undo:
    """A fused experts forward, a legacy or fused sparse-MoE block forward, or (behind
    transformers' experts dispatcher) the kernel registered as an experts implementation."""
    import verl_npu_autopatch.patches.transformers_npu.kernels as kernels

    original = site.value
    if found["block"] == "legacy":
        replacement = kernels.legacy_moe_block(original)
    elif found["block"] == "fused":
        replacement = kernels.fused_moe_block(original, found["transposed"])
    elif found["dispatched"]:
        import verl_npu_autopatch.patches.transformers_npu.experts_interface as experts_interface

        return experts_interface.register(site.owner, found["transposed"], site.patch.name)
    else:
        replacement = kernels.fused_experts(original, found["transposed"])
    return set_marked(site.owner, site.attribute, replacement, site.patch.name)
