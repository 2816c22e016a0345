"""``vllm.routed_experts_padding_slots``: vLLM's ``RoutedExpertsManager.store_batch`` skips the
padding slot id -1 (opt-in, group ``router_replay``).

With routed-experts capture on (router replay, R3), the scheduler stores each step's routing rows
into a slot-indexed buffer with ``slot_buffer[slot_mapping] = data``. Padded tokens carry slot id
-1, and numpy reads -1 as the last slot: the padding's routing overwrites whatever request owns
that slot (the recipe's ``DeepSeek-V4-Flash/patch/vllm.patch``). vLLM 0.23 to 0.30 store it so.
A release that masks negative slot ids itself is ``fixed-upstream``.

0.31 removed the class and the slot buffer with it: the capture path of 0.32 to 0.34
(``vllm.distributed.aux_output_connector.worker:AuxOutputWorkerConnector.prepare_output``, the
patch's second variant) snapshots only the scheduled requests' rows (``num_rows =
int(query_start_loc[-1])``, ``snapshot_routing_data(num_rows)``) and commits them per request by
token position, so a padded token's row is never stored anywhere: ``fixed-upstream``, decided from
that code.

The fix wraps ``store_batch``: rows whose slot id is negative are dropped before the release's own
method stores the rest. Opt-in: the buffer exists only with routed-experts capture on, and the
class is gone from the vLLM releases most users run now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    RECIPE,
    Code,
    Patch,
    Site,
    StaticRule,
    UpstreamTree,
    Verdict,
    around,
    code_check,
    decides,
    fixed_upstream,
    module_file,
    unsupported,
    wrapping_fix,
)

CAPTURER = "vllm.model_executor.layers.fused_moe.routed_experts_capturer"
METHOD = "RoutedExpertsManager.store_batch"
PARAMS = ("self", "data", "slot_mapping")
STORE = "self.routed_experts_by_slot[slot_mapping]=data"
MASKED = ("slot_mapping>=0", "slot_mapping<0")
#: The capture path after the class was removed (vLLM 0.31 on): its step snapshot.
WORKER = "vllm.distributed.aux_output_connector.worker"
PREPARE = "AuxOutputWorkerConnector.prepare_output"
#: Only the scheduled requests' rows are snapshot (whitespace-free, as ``Code`` holds them).
REAL_ROWS = (
    "query_start_loc=input_batch.query_start_loc_np[:len(request_ids)+1]",
    "num_rows=int(query_start_loc[-1])",
    "routed_experts_gpu=self._capturer.snapshot_routing_data(num_rows)",
)


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


@decides(f"{WORKER}:{PREPARE}", ("self", "input_batch"))
def capture_rule(code: Code) -> Verdict:
    """The capture path without slot ids: fixed where it snapshots the scheduled rows only."""
    if code.has(*REAL_ROWS):
        return fixed_upstream(
            "no slot buffer any more: prepare_output snapshots only the scheduled requests' rows "
            "(num_rows = int(query_start_loc[-1]); snapshot_routing_data(num_rows)), so padding rows are never stored"
        )
    return unsupported(
        "prepare_output snapshotting snapshot_routing_data(int(query_start_loc[-1])) rows", "another body"
    )


def check(site: Site) -> Verdict:
    """The rule of the variant found: the slot buffer's ``store_batch``, or the newer capture path."""
    rule = capture_rule if (site.target.module, site.target.qualname) == (WORKER, PREPARE) else slots_rule
    return code_check(rule)(site)


def static(tree: UpstreamTree) -> Verdict:
    """The engine's choice on a release: ``store_batch`` where the class is, else the capture
    path where it is, else ``unsupported`` naming ``store_batch``."""
    if tree.code(CAPTURER, METHOD) is None and tree.code(WORKER, PREPARE) is not None:
        return capture_rule.judge(tree)
    return slots_rule.judge(tree)


PATCHES = [
    Patch(
        name="vllm.routed_experts_padding_slots",
        summary=(
            "RoutedExpertsManager.store_batch skips padding slot id -1 instead of writing the last slot "
            "(fixed upstream where capture stores the scheduled rows only)."
        ),
        reference=RECIPE,
        groups=("router_replay", "vllm"),
        targets=(slots_rule.target, capture_rule.target),
        check=check,
        fix=wrapping_fix(around(store_batch)),
        default=False,
        static=StaticRule(static, reads=(module_file(CAPTURER), module_file(WORKER))),
    ),
]
