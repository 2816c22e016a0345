"""``ascend.mooncake_aborted_receive``: vllm-ascend's Mooncake connector (decode side of
prefill/decode disaggregation) still tells the prefill node it is done when a request waiting for
its remote KV is aborted, and never pulls KV into blocks the abort freed.

A decode request with ``do_remote_prefill`` pulls its prompt's KV from the prefill node; the
worker's receive ends with a ``DONE_RECVING`` message, on which the prefill node frees the blocks
it kept for the request. ``MooncakeConnectorScheduler.request_finished`` decides what an ending
request leaves behind, and the releases miss two cases of an abort (verl's partial rollout aborts
requests routinely):

* aborted before its blocks were allocated (``do_remote_prefill`` still set, or rejected at
  admission): nothing is queued, so no ``DONE_RECVING`` is sent and the prefill node holds the
  blocks until its abort timeout (``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``). 0.26.0rc1 queues an
  empty receive for this case; 0.18.0 to 0.25.1rc1 do not.
* aborted after ``update_state_after_alloc`` queued the receive (the flag already cleared) but
  before the next ``build_connector_meta`` handed it to the worker: the queued entry keeps the
  request's local block ids, which the abort has just freed, so the worker pulls the remote KV
  into blocks another request may now hold. No release read (0.18.0 to 0.30.0rc2) handles this.

The fix (the recipe's ``all_disconnect/vllm-ascend.patch``, its scheduler part) wraps
``request_finished``: for a request with ``kv_transfer_params`` that still has a receive coming
(the flag set, or an entry in ``_reqs_need_recv``) it queues an empty receive (no blocks, no
external tokens; every release's worker then skips the transfer and still sends ``DONE_RECVING``),
clears the flag and frees the blocks now, as 0.26.0rc1 does for the first case; every other
request goes to the release's method. The recipe's other part, retrying ``DONE_RECVING`` with a
fresh socket, is not carried: the release's ``_send_done_recv_signal`` swallows a failed delivery
(it logs and returns), so a wrapper cannot tell one from a success, and a retry would mean writing
the method again around its socket pool. Opt-in (group ``pd_disaggregation``): it only matters
for disaggregated serving. Decided from the code: a ``request_finished`` that already tests
``request.request_id in self._reqs_need_recv`` is fixed upstream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    RECIPE,
    Code,
    Verdict,
    around,
    decides,
    fixed_upstream,
    unsupported,
    wrapping_patch,
)

MODULE = "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector"
PARAMS = ("self", "request", "block_ids")
#: The recipe's (and a fixed release's) test for a receive queued before the abort.
QUEUED = "request.request_idinself._reqs_need_recv"
#: What every release's method reads: the decode-side early return on anything but a length cap.
DECODE_SIDE = 'params.get("do_remote_decode")'
CAPPED = "request.status!=RequestStatus.FINISHED_LENGTH_CAPPED"


@decides(f"{MODULE}:MooncakeConnectorScheduler.request_finished", PARAMS)
def finished_rule(code: Code) -> Verdict:
    if code.has(QUEUED):
        return fixed_upstream("request_finished replaces a receive queued before the abort itself")
    if not code.has(DECODE_SIDE, CAPPED):
        return unsupported(
            "request_finished returning early unless do_remote_decode and FINISHED_LENGTH_CAPPED", "another body"
        )
    return APPLY


def receive_pending(scheduler: Any, request: Any) -> bool:
    """Whether ``request`` still has a remote-KV receive coming: the flag set, or queued."""
    params = request.kv_transfer_params
    return params is not None and bool(
        params.get("do_remote_prefill") or request.request_id in scheduler._reqs_need_recv
    )


def request_finished(
    original: Callable[..., Any], self: Any, request: Any, block_ids: Any
) -> tuple[bool, dict[str, Any] | None]:
    """The release's ``request_finished``, but a request still waiting for its KV queues an empty
    receive and frees its blocks now."""
    if not receive_pending(self, request):
        return original(self, request, block_ids)
    nothing: tuple[list[int], ...] = tuple([] for _ in self.kv_cache_groups)
    self._reqs_need_recv[request.request_id] = (request, nothing, nothing, 0)
    request.kv_transfer_params["do_remote_prefill"] = False
    return False, None


PATCHES = [
    wrapping_patch(
        "ascend.mooncake_aborted_receive",
        "vllm-ascend's Mooncake connector signals DONE_RECVING for an aborted remote-prefill request "
        "and never pulls KV into the blocks the abort freed.",
        rule=finished_rule,
        wrap=around(request_finished),
        opt_in="pd_disaggregation",
        reference=RECIPE,
    ),
]
