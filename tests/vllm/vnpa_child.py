"""Code run in child interpreters by ``test_vllm_processes.py`` (importable there by name).

Kept free of test-only imports: the spawn child must do nothing but import vLLM modules and read
``verl_npu_autopatch.report()``.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: Modules holding the two vLLM patches' targets.
TARGET_MODULES = (
    "vllm.model_executor.layers.fused_moe",
    "vllm.model_executor.layers.rotary_embedding.common",
)


def report_data() -> dict[str, Any]:
    """This process's report, pid and whether the patched callables carry our marker."""
    import sys

    import verl_npu_autopatch
    from verl_npu_autopatch.authoring.patching import marked_by

    marks = {}
    routed = sys.modules.get("vllm.model_executor.layers.fused_moe.routed_experts")
    layer = sys.modules.get("vllm.model_executor.layers.fused_moe.layer")
    owner = getattr(routed, "RoutedExperts", None) or getattr(layer, "FusedMoE", None)
    if isinstance(owner, type):
        marks["weight_loader"] = marked_by(owner.weight_loader)
    common = sys.modules.get("vllm.model_executor.layers.rotary_embedding.common")
    if common is not None:
        marks["rotary_init"] = marked_by(common.ApplyRotaryEmb.__dict__["__init__"])
    return {"pid": os.getpid(), "report": verl_npu_autopatch.report().to_dict(), "marks": marks}


def import_and_report(queue: Any) -> None:
    """Spawn-child target: import the vLLM target modules, send back the report as JSON."""
    import importlib

    for module in TARGET_MODULES:
        importlib.import_module(module)
    queue.put(json.dumps(report_data()))
