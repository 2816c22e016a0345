"""``ascend.routed_experts_dp_padding_trim``: ``RoutedExpertsCapturer.capture`` trims this DP
rank's routing rows padded to the widest rank's count before the DP all-gather (opt-in, group
``dsv4``: only DeepSeek-V4's bucketed decode hands ``capture`` that layout; verl-ascend-recipe's
``DeepSeek-V4-Flash/patch/A5/verl_A5.patch``).

The trim itself and its rule are in ``_capture_trim``. This patch wraps whatever capture is live
once vllm-ascend applied its worker patches (the trigger: the ``__file__`` of
``vllm_ascend.patch.worker``, as ``ascend.routed_experts_capture``): vllm-ascend's where the
release imports it (0.25.1rc1 on), else vLLM's. Where ``ascend.routed_experts_capture`` installs
vllm-ascend's capture and both are enabled, that patch installs it already trimmed and this one
records ``yielded`` to it (one owner of the attribute, one undo). A capture that already branches
on the padded count is ``fixed-upstream``; one without a branch taking this rank's own rows
(vLLM 0.18, 0.21) is ``unsupported``: the trimmed rows would fail there too.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from verl_npu_autopatch.authoring import (
    ABSENT,
    Patch,
    Reach,
    Site,
    StaticRule,
    Undo,
    UpstreamTree,
    Verdict,
    definition,
    imports_module_unconditionally,
    marked_by,
    origin,
    own_value,
    set_marked,
    unsupported,
)
from verl_npu_autopatch.patches._capture_trim import (
    CAPTURE,
    CAPTURER,
    CARRIES,
    RECIPE_MARK,
    TARGET,
    TRIGGER,
    TRIM,
    WORKER,
    WORKER_READS,
    trim_rule,
    trimmed,
)

CAPTURE_OWNER = "ascend.routed_experts_capture"
METHOD = TARGET.qualname


def _live() -> Any:
    """The capture vLLM's class holds now (:data:`ABSENT` while its module is not imported)."""
    capturer = getattr(sys.modules.get(CAPTURER), "RoutedExpertsCapturer", None)
    return ABSENT if capturer is None else own_value(capturer, "capture")


def _carried(site: Site) -> str | None:
    """``ascend.routed_experts_capture`` holds the capture, with this trim inside."""
    live = _live()
    if marked_by(live) == CAPTURE_OWNER and getattr(live, CARRIES, False):
        return f"{CAPTURE_OWNER}, which carries this trim"
    return None


def _recipe(site: Site) -> str | None:
    """verl-ascend-recipe's own wrapper (``verl_A5.patch``) holds the capture."""
    live = _live()
    if getattr(live, RECIPE_MARK, False) and not getattr(live, CARRIES, False):
        return f"verl-ascend-recipe ({origin(live)})"
    return None


def _check(site: Site) -> Verdict:
    live = own_value(importlib.import_module(CAPTURER).RoutedExpertsCapturer, "capture")
    if live is ABSENT:
        return trim_rule(None, f"{CAPTURER}.{METHOD}")
    verdict = trim_rule(definition(live), origin(live))
    return Verdict("apply", f"wraps {origin(live)}") if verdict.action == "apply" else verdict


def _fix(site: Site) -> Undo:
    capturer = importlib.import_module(CAPTURER).RoutedExpertsCapturer
    original = own_value(capturer, "capture")
    return set_marked(capturer, "capture", trimmed(original), site.patch.name, original)


def _capture_of(tree: UpstreamTree) -> tuple[Any, str, bool]:
    """``(definition, name, vllm-ascend's)`` of the capture live on a release once vllm-ascend's
    worker patches ran: vllm-ascend's where its worker package imports it unconditionally."""
    worker, ascend = tree.module(WORKER), tree.module(CAPTURE)
    if ascend is not None and worker is not None and imports_module_unconditionally(worker.text, CAPTURE):
        return ascend.function_node("capture"), f"{CAPTURE}.capture", True
    vllm = tree.module(CAPTURER)
    return (vllm.function_node(METHOD) if vllm else None), f"{CAPTURER}.{METHOD}", False


def _static(tree: UpstreamTree) -> Verdict:
    node, name, imported = _capture_of(tree)
    if not imported and not tree.has_module(CAPTURER):
        return unsupported(f"module {CAPTURER}", "no such module")
    return trim_rule(node, name)


def _note(tree: UpstreamTree) -> str | None:
    """Which capture the trim wraps where it is vllm-ascend's, and where ``ascend.routed_experts_capture``
    would load vllm-ascend's: what the two do together."""
    _, _, imported = _capture_of(tree)
    ascend = tree.module(CAPTURE)
    if imported:
        return f"the capture live is vllm-ascend's ({WORKER} imports it)"
    if ascend is None:
        return None
    verdict = trim_rule(ascend.function_node("capture"), f"{CAPTURE}.capture")
    if verdict.action != "apply":
        return f"the capture live is vLLM's; with {CAPTURE_OWNER} enabled too, vllm-ascend's: {verdict.action} there"
    return (
        f"the capture live is vLLM's; with {CAPTURE_OWNER} enabled too, that patch installs vllm-ascend's capture "
        "already trimmed and this one records yielded to it"
    )


PATCHES = [
    Patch(
        name=TRIM,
        summary=(
            "RoutedExpertsCapturer.capture trims DP-padded routing rows (topk_ids padded to the widest DP rank's "
            "count before the all-gather: DeepSeek-V4's bucketed decode only)."
        ),
        reference="https://github.com/verl-project/verl-ascend-recipe",
        groups=("dsv4", "ascend"),
        targets=(TARGET,),
        reach=Reach(triggers=(TRIGGER,)),
        default=False,
        yields_to=(_carried, _recipe),
        check=_check,
        fix=_fix,
        static=StaticRule(
            _static,
            reads=(*WORKER_READS, "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py"),
            note=_note,
        ),
    ),
]
