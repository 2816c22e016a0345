"""``ascend.mooncake_truncate_rehash``: vllm-ascend's Mooncake connector rebuilds a prefill-side
request's block hashes after it drops the prompt's last token.

For models with state (Mamba groups) or compressed KV, the prefill node of a prefill/decode
disaggregation computes one token less than the prompt: ``MooncakeConnectorScheduler.
_truncate_request_for_prefill`` pops the last prompt token (``prompt_token_ids``,
``_all_token_ids``, ``num_prompt_tokens``; ``max_tokens = 1``) so the decoder recomputes it. vLLM
built the request's ``block_hashes`` from the whole prompt when the request was made and the
releases leave them so: when the prompt filled its last block, that block's hash still covers the
dropped token, and the prefix cache later offers a block holding one token less under the full
prompt's hash (a later request, or rollout, reads KV it never computed; the prefix-cache count can
exceed the truncated prompt). The recipe's ``partial_rollout/vllm-ascend.patch`` clears the
hashes and lets the request compute them again (``update_block_hashes``).

The fix wraps ``_truncate_request_for_prefill``: when this call truncated the request (its
``_p_side_truncated`` mark newly set), the hashes are rebuilt from the shortened prompt; a call
that changed nothing (already truncated, or nothing to truncate) changes nothing more. The
recipe's other half, truncating before the prefix-cache lookup (a connector ``on_new_request``
instead of ``get_num_new_matched_tokens``), is done by the release from 0.30.0rc2 and not carried
here (see docs/ascend-recipes.md). Opt-in (group ``pd_disaggregation``). Decided from the code: a
``_truncate_request_for_prefill`` that calls ``update_block_hashes`` is fixed upstream.
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
PARAMS = ("self", "request")
MARK = "_p_side_truncated"
#: What the releases' truncation does (whitespace-free): drops the token, sets the mark.
DROPS = ("request._all_token_ids.pop()", f'params["{MARK}"]=True')
REHASH = "update_block_hashes"


@decides(f"{MODULE}:MooncakeConnectorScheduler._truncate_request_for_prefill", PARAMS)
def truncate_rule(code: Code) -> Verdict:
    if code.has(REHASH):
        return fixed_upstream("_truncate_request_for_prefill rebuilds the block hashes itself")
    if not code.has(*DROPS):
        return unsupported(
            "_truncate_request_for_prefill popping the last token and marking _p_side_truncated", "another body"
        )
    return APPLY


def truncate_request(original: Callable[..., Any], self: Any, request: Any) -> None:
    """The release's truncation; when this call truncated the request, its hashes rebuilt."""
    params = request.kv_transfer_params
    before = params is not None and bool(params.get(MARK))
    original(self, request)
    if params is not None and not before and params.get(MARK):
        request.block_hashes.clear()
        request.update_block_hashes()


PATCHES = [
    wrapping_patch(
        "ascend.mooncake_truncate_rehash",
        "vllm-ascend's Mooncake connector rebuilds a prefill-side request's block hashes after "
        "dropping its last prompt token.",
        rule=truncate_rule,
        wrap=around(truncate_request),
        opt_in="pd_disaggregation",
        reference=RECIPE,
    ),
]
