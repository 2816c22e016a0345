"""A tensor made on vllm-ascend's side stream and consumed on the current stream: the decision and
the fix the sampler families share (``ascend.sampler_record_stream``,
``ascend.310p_sampler_record_stream``).

The shape: inside ``with npu_stream_switch(global_stream()):`` a device tensor is allocated, the
current stream waits for the side stream, then the current stream reads the tensor. The caching
allocator ties the tensor's block to the side stream only, so once the function returns the block
can be handed out again on the side stream while the current stream still reads it. The fix is
one statement, ``<tensor>.record_stream(torch.npu.current_stream())`` right after the top-level
wait, added to the release's own function: its source is parsed, the call inserted, and the
function compiled again with the module's globals and the file's line numbers, so everything else
the release does runs as shipped.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl_npu_autopatch.authoring import APPLY, Code, Site, Verdict, definition, fixed_upstream, unsupported

#: The side-stream block and the wait after it, whitespace-free as ``Code`` holds them.
SWITCH = "withnpu_stream_switch(global_stream()):"
WAIT = "torch.npu.current_stream().wait_stream(global_stream())"


def record(tensor: str) -> str:
    """The statement the fix adds (and upstream's fixed releases have) after the wait."""
    return f"{tensor}.record_stream(torch.npu.current_stream())"


@dataclass(frozen=True)
class SideTensor:
    """One release shape: ``tensor`` made on the side stream by the statements ``made`` (the first
    one opening the side-stream block), then read on the current stream by ``used``."""

    tensor: str
    made: tuple[str, ...]
    used: str
    #: What the shape is, in words (the ``unsupported`` reason).
    words: str

    def found(self, code: Code) -> bool:
        return code.has(*self.made, WAIT, self.used)


def side_stream_rule(code: Code, function: str, shapes: tuple[SideTensor, ...]) -> Verdict:
    """``fixed-upstream`` where the function records one of the shapes' tensors on the current
    stream, ``apply`` where it has one of the shapes, else ``unsupported`` naming them all."""
    for shape in shapes:
        if code.has(record(shape.tensor)):
            return fixed_upstream(f"{function} already calls {record(shape.tensor)}")
    if any(shape.found(code) for shape in shapes):
        return APPLY
    return unsupported(f"{function} " + " or ".join(shape.words for shape in shapes), "another body")


def shape_of(code: Code, shapes: tuple[SideTensor, ...]) -> SideTensor:
    """The shape ``code`` has (the rule said ``apply``)."""
    for shape in shapes:
        if shape.found(code):
            return shape
    raise LookupError("none of the side-stream shapes the rule knows")


def with_record_stream(original: Callable[..., Any], tensor: str) -> Callable[..., Any]:
    """``original`` compiled again from its own source with :func:`record` of ``tensor`` after the
    top-level wait statement (same globals, file and line numbers)."""
    node = definition(original)
    if not isinstance(node, ast.FunctionDef):
        raise LookupError(f"no readable source for {original!r}")
    ast.increment_lineno(node, original.__code__.co_firstlineno - node.lineno)
    waits = [i for i, s in enumerate(node.body) if "".join(ast.unparse(s).split()) == WAIT]
    if len(waits) != 1:
        raise LookupError(f"expected one top-level {WAIT} in {node.name}, found {len(waits)}")
    statement = ast.parse(record(tensor)).body[0]
    ast.copy_location(statement, node.body[waits[0]])
    ast.fix_missing_locations(statement)
    node.body.insert(waits[0] + 1, statement)
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    scratch: dict[str, Any] = {}  # the def binds here; the function's globals are the module's
    exec(compile(module, original.__code__.co_filename, "exec"), original.__globals__, scratch)
    return functools.wraps(original)(scratch[node.name])


def recording(shapes: tuple[SideTensor, ...]) -> Callable[[Site, Callable[..., Any]], Callable[..., Any]]:
    """The ``wrap`` of a family: the target compiled again recording the tensor of its shape."""

    def wrap(site: Site, original: Callable[..., Any]) -> Callable[..., Any]:
        return with_record_stream(original, shape_of(Code.live(original), shapes).tensor)

    return wrap
