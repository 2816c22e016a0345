"""``ascend.sampler_record_stream``: vllm-ascend's ``random_sample`` keeps its side-stream tensor
alive until the consuming stream is done with it.

``random_sample`` draws the exponential noise ``q`` on vllm-ascend's ``global_stream()``, makes
the current stream wait for it, then divides ``probs`` by ``q`` on the current stream. The caching
allocator ties ``q``'s block to the side stream only, so once the function returns the block can
be handed out again on the side stream while the division still reads it: a few sampled token ids
come out masked or out of vocabulary (vllm-ascend PR #13394; the recipe's
``0001-record-sampler-stream.patch``). 0.26.0rc1 calls ``q.record_stream(current stream)`` after
the wait (``fixed-upstream``).

The fix is that one statement, added to the release's own function (``_side_stream``, shared with
the 310P sampler's ``ascend.310p_sampler_record_stream``), so everything else the release does
runs as shipped.
"""

from __future__ import annotations

from verl_npu_autopatch.authoring import Code, Verdict, decides, wrapping_patch
from verl_npu_autopatch.patches._side_stream import SWITCH, SideTensor, recording, side_stream_rule

SAMPLER = "vllm_ascend.sample.sampler"
PARAMS = ("probs", "generators")
#: ``q`` drawn on the side stream, then dividing ``probs`` on the current stream.
Q = SideTensor(
    "q",
    made=(f"{SWITCH}q=torch.empty_like(probs)",),
    used="probs.div_(q)",
    words="drawing q on global_stream() and dividing probs by it after wait_stream",
)


@decides(f"{SAMPLER}:random_sample", PARAMS)
def sampler_rule(code: Code) -> Verdict:
    return side_stream_rule(code, "random_sample", (Q,))


PATCHES = [
    wrapping_patch(
        "ascend.sampler_record_stream",
        "vllm-ascend random_sample records its side-stream tensor q on the consuming stream.",
        rule=sampler_rule,
        wrap=recording((Q,)),
        reference="https://github.com/vllm-project/vllm-ascend/pull/13394",
    ),
]
