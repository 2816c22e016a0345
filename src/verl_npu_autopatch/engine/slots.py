"""The engine's slots: one per patch, everything the engine holds about it in this process
(:class:`Slot`), and the store of them all (:class:`Slots`: their lock, the configuration they were
planned from, recording a decision). The engine fills the store; its ``AppliedFixes`` acts on it."""

from __future__ import annotations

import _thread

from verl_npu_autopatch.engine import log

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from verl_npu_autopatch.authoring.spec import Patch, Target, Undo
    from verl_npu_autopatch.engine.catalog import Declared
    from verl_npu_autopatch.engine.config import Config
    from verl_npu_autopatch.engine.ownership import Footprint
    from verl_npu_autopatch.engine.records import Record, RecordState

__all__ = ["Slot", "Slots"]


class Slot:
    """A patch's record and what the engine needs to act on it and re-check it.

    ``patch`` is ``None`` for an entry point that failed to load or was skipped (a record only),
    a ``Declared`` one until its target is imported (the engine then loads it);
    ``variants`` are the targets still in play after the gates; ``rejected`` maps the variants
    whose check said unsupported (last application) to why; ``installed`` and ``undo`` say where
    the applied fix installed what and how to take it back (``stale``: the undos of fixes left on
    module objects a re-execution replaced, run by ``revert`` too); ``yielded`` is the target left to
    another owner at apply time (re-checked); ``claimed``: an application is under way.
    """

    __slots__ = ("claimed", "footprint", "patch", "record", "rejected", "stale", "undo", "variants", "yielded")

    def __init__(self, patch: Patch | Declared | None, record: Record, variants: tuple[Target, ...] = ()) -> None:
        self.patch = patch
        self.record = record
        self.variants = variants
        self.rejected: dict[Target, str] = {}
        self.footprint: Footprint | None = None
        self.undo: Undo | None = None
        self.stale: list[Undo] = []
        self.yielded: Target | None = None
        self.claimed = False

    def live(self) -> bool:
        """A fix of this patch went in and was not taken back (its undo is kept)."""
        return self.undo is not None or self.footprint is not None or bool(self.stale)

    def release(self, keep: bool = False) -> Undo | None:
        """Forget what the fix installed (reverted, handed over, or to be applied afresh);
        returns its undo, also kept in :attr:`stale` with ``keep`` (the module was executed again)."""
        undo, self.undo, self.footprint = self.undo, None, None
        if keep and undo is not None:
            self.stale.append(undo)
        return undo


class Slots(dict[str, Slot]):
    """``{patch name: slot}`` in catalog order, read and changed under :attr:`lock` (an
    ``_thread.RLock``, held only briefly, never across imports; it also guards the engine's
    status). ``config`` is set by activation; ``on_change`` refreshes the report file, if any."""

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.lock = _thread.RLock()
        self.config = config
        self.on_change: Callable[[], None] | None = None

    def after_fork(self) -> None:
        """In the child of ``os.fork()``: the lock may be held by a thread that is not there."""
        self.lock = _thread.RLock()

    def records(self) -> dict[str, Record]:
        """``{patch name: its live record}``, in catalog order."""
        with self.lock:
            return {name: slot.record for name, slot in self.items()}

    def set_state(self, record: Record, state: RecordState, reason: str, exc: BaseException | None = None) -> None:
        """Record a decision and log it once (``exc``: its traceback goes with the line). The
        reason is kept within ``text.REASON_CHARS`` (it may quote a plugin's or upstream's text)."""
        from verl_npu_autopatch.engine.text import safe_str  # (records exist on the active path only)

        reason = safe_str(reason)
        with self.lock:
            record.state, record.reason = state, reason
        log.logger().log(log.level_of(state), "%s: %s (%s)", record.name, state, reason, exc_info=exc)
        if self.on_change is not None:
            self.on_change()
