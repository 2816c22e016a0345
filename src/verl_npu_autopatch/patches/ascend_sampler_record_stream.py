"""``ascend.sampler_record_stream``: vllm-ascend's ``random_sample`` keeps its side-stream tensor
alive until the consuming stream is done with it.

``random_sample`` draws the exponential noise ``q`` on vllm-ascend's ``global_stream()``, makes
the current stream wait for it, then divides ``probs`` by ``q`` on the current stream. The caching
allocator ties ``q``'s block to the side stream only, so once the function returns the block can
be handed out again on the side stream while the division still reads it: a few sampled token ids
come out masked or out of vocabulary (vllm-ascend PR #13394; the recipe's
``0001-record-sampler-stream.patch``). 0.26.0rc1 calls ``q.record_stream(current stream)`` after
the wait (``fixed-upstream``).

The fix is that one statement, added to the release's own function: the live function's source
is parsed, the call is inserted right after the ``wait_stream`` statement and the function is
compiled again with the module's globals and the file's line numbers, so everything else the
release does runs as shipped.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.patches._family import decides, wrapping_patch
from verl_npu_autopatch.patches._fingerprints import Code
from verl_npu_autopatch.patching import definition
from verl_npu_autopatch.spec import APPLY, Verdict, fixed_upstream, unsupported

SAMPLER = "vllm_ascend.sample.sampler"
PARAMS = ("probs", "generators")
#: What the rule looks for (whitespace-free): ``q`` drawn on the side stream, the wait, the use.
SIDE = "withnpu_stream_switch(global_stream()):q=torch.empty_like(probs)"
WAIT = "torch.npu.current_stream().wait_stream(global_stream())"
USE = "probs.div_(q)"
#: The statement the fix adds (and upstream's fixed release has) after the wait.
RECORD = "q.record_stream(torch.npu.current_stream())"


@decides(f"{SAMPLER}:random_sample", PARAMS)
def sampler_rule(code: Code) -> Verdict:
    if code.has(RECORD):
        return fixed_upstream("random_sample already calls q.record_stream(torch.npu.current_stream())")
    if not code.has(SIDE, WAIT, USE):
        return unsupported(
            "random_sample drawing q on global_stream() and dividing probs by it after wait_stream",
            "another body",
        )
    return APPLY


def with_record_stream(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` compiled again from its own source with :data:`RECORD` after the wait
    statement (same globals, file and line numbers)."""
    node = definition(original)
    if not isinstance(node, ast.FunctionDef):
        raise LookupError(f"no readable source for {original!r}")
    ast.increment_lineno(node, original.__code__.co_firstlineno - node.lineno)
    waits = [i for i, s in enumerate(node.body) if "".join(ast.unparse(s).split()) == WAIT]
    if len(waits) != 1:
        raise LookupError(f"expected one top-level {WAIT} in random_sample, found {len(waits)}")
    record = ast.parse(RECORD).body[0]
    ast.copy_location(record, node.body[waits[0]])
    ast.fix_missing_locations(record)
    node.body.insert(waits[0] + 1, record)
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    scratch: dict[str, Any] = {}  # the def binds here; the function's globals are the module's
    exec(compile(module, original.__code__.co_filename, "exec"), original.__globals__, scratch)
    return functools.wraps(original)(scratch[node.name])


PATCHES = [
    wrapping_patch(
        "ascend.sampler_record_stream",
        "vllm-ascend random_sample records its side-stream tensor q on the consuming stream.",
        rule=sampler_rule,
        wrap=lambda site, original: with_record_stream(original),
        reference="https://github.com/vllm-project/vllm-ascend/pull/13394",
    ),
]
