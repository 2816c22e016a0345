"""``verl.hccl_broadcast_thread``: verl's HCCL checkpoint engine broadcasts each weight bucket on
the thread that asked for it, not on an executor thread.

verl 0.9.0's ``BroadcastOperation.__init__`` (``verl/checkpoint_engine/hccl_checkpoint_engine.py``,
the engine registered as the ``nccl`` backend on NPU) hands ``_run`` (the bucket's zmq metadata
exchange, then ``pyhccl.broadcast``) to ``loop.run_in_executor``: the broadcast runs on a pool
thread without the NPU device context the caller set, and fully-async weight updates fail with HCCL
errors (verl issue #7416). verl reverted it (PR #7488): 0.8.0 and 0.9.1 call ``self._run()`` in
``__init__``.

The fix replaces ``__init__`` with one that stores the same six attributes and calls ``self._run()``
on the calling thread, as the revert does; ``self._task`` is then an awaitable that is already
finished, so the release's ``wait_for_complete`` (``await self._task``) returns the metadata at
once. Decided from the code: the body must be exactly the six assignments and the executor call
(``apply``); a body that calls ``self._run()`` without an executor is ``fixed-upstream``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Site,
    Verdict,
    decides,
    fixed_upstream,
    unsupported,
    wrapping_patch,
)

MODULE = "verl.checkpoint_engine.hccl_checkpoint_engine"
CLASS = "BroadcastOperation"
PARAMS = ("self", "rank", "process_group", "bucket", "metadata", "socket", "topic")
#: The attributes ``__init__`` stores, in the release's order (whitespace-free).
ASSIGNED = (
    "self.rank=rank",
    "self.pyhccl=process_group",
    "self.bucket=bucket",
    "self.metadata=metadata",
    "self.socket=socket",
    "self.topic=topic",
)
#: verl 0.9.0's hand-off of the broadcast to an executor thread.
THREADED = "loop=asyncio.get_running_loop()self._task=loop.run_in_executor(None,self._run)"
#: The broadcast on the calling thread (0.8.0, 0.9.1).
CALLER = "self._run()"
#: What ``wait_for_complete`` must do for the finished task to stand in for the executor's.
AWAITED = ("awaitself._task", "returnself.metadata")


@decides(f"{MODULE}:{CLASS}.__init__", params=PARAMS, reading=(f"{MODULE}:{CLASS}.wait_for_complete",))
def broadcast_rule(init: Code, wait: Code | None = None) -> Verdict:
    """Decide on ``BroadcastOperation.__init__`` (and the ``wait_for_complete`` beside it)."""
    source = init.source or ""
    first = ASSIGNED[0]
    body = source[source.index(first) :] if first in source else ""
    stored = "".join(ASSIGNED)
    if not body.startswith(stored):
        return unsupported(f"{CLASS}.__init__ storing rank, pyhccl, bucket, metadata, socket, topic", "another body")
    if CALLER in body and "run_in_executor" not in body:
        return fixed_upstream(f"{CLASS}.__init__ runs self._run() on the calling thread")
    if body != stored + THREADED:
        return unsupported(f"{CLASS}.__init__ handing self._run to loop.run_in_executor", "another body")
    if wait is None or not wait.has(*AWAITED):
        return unsupported(f"{CLASS}.wait_for_complete awaiting self._task, returning self.metadata", "another body")
    return APPLY


class Finished:
    """An awaitable already finished: what the release's ``wait_for_complete`` awaits as ``_task``."""

    def __await__(self) -> Generator[None, None, None]:
        return
        yield  # a generator that ends at once: ``await`` returns ``None``


def _wrap(site: Site, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, rank: int, process_group: Any, bucket: Any, metadata: Any, socket: Any, topic: str) -> None:
        self.rank, self.pyhccl, self.bucket = rank, process_group, bucket
        self.metadata, self.socket, self.topic = metadata, socket, topic
        self._run()  # on the calling thread, which holds the NPU device context
        self._task = Finished()

    return __init__


PATCHES = [
    wrapping_patch(
        "verl.hccl_broadcast_thread",
        "verl 0.9.0's HCCL checkpoint engine broadcasts each weight bucket on the calling thread, not an executor's.",
        rule=broadcast_rule,
        wrap=_wrap,
        reference="https://github.com/verl-project/verl/issues/7416",
    ),
]
