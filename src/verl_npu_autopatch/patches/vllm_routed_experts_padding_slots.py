"""``vllm.routed_experts_padding_slots``: vLLM's ``RoutedExpertsManager.store_batch`` skips the
padding slot id -1 (opt-in, group ``router_replay``).

With routed-experts capture on (router replay, R3), the scheduler stores each step's routing rows
into a slot-indexed buffer with ``slot_buffer[slot_mapping] = data``. Padded tokens carry slot id
-1, and numpy reads -1 as the last slot: the padding's routing overwrites whatever request owns
that slot (the recipe's ``DeepSeek-V4-Flash/patch/vllm.patch``). vLLM 0.23 to 0.30 store it so;
0.31 removed the class (the patch then records ``unsupported``, naming it). A release that masks
negative slot ids itself is ``fixed-upstream``.

The fix wraps ``store_batch``: rows whose slot id is negative are dropped before the release's own
method stores the rest. Opt-in: the buffer exists only with routed-experts capture on, and the
class is gone from the vLLM releases most users run now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.patches._family import RECIPE, around, decides, wrapping_patch
from verl_npu_autopatch.patches._fingerprints import Code
from verl_npu_autopatch.spec import APPLY, Verdict, fixed_upstream, unsupported

CAPTURER = "vllm.model_executor.layers.fused_moe.routed_experts_capturer"
METHOD = "RoutedExpertsManager.store_batch"
PARAMS = ("self", "data", "slot_mapping")
STORE = "self.routed_experts_by_slot[slot_mapping]=data"
MASKED = ("slot_mapping>=0", "slot_mapping<0")


@decides(f"{CAPTURER}:{METHOD}", PARAMS)
def slots_rule(code: Code) -> Verdict:
    if any(code.has(mask) for mask in MASKED):
        return fixed_upstream("store_batch already masks negative slot ids")
    if not code.has(STORE):
        return unsupported("store_batch storing with routed_experts_by_slot[slot_mapping] = data", "another body")
    return APPLY


def store_batch(original: Callable[..., Any], self: Any, data: Any, slot_mapping: Any) -> Any:
    """The release's ``store_batch`` on the rows of real slots only."""
    real = slot_mapping >= 0  # numpy arrays, as the scheduler passes them
    if not real.all():  # padding rows (slot id -1) would land in the last slot
        data, slot_mapping = data[real], slot_mapping[real]
    return original(self, data, slot_mapping)


PATCHES = [
    wrapping_patch(
        "vllm.routed_experts_padding_slots",
        "RoutedExpertsManager.store_batch skips padding slot id -1 instead of writing the last slot.",
        rule=slots_rule,
        wrap=around(store_batch),
        opt_in="router_replay",
        reference=RECIPE,
    ),
]
