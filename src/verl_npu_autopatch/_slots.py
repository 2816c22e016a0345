"""One slot per patch: everything the engine holds about it in this process, in one place."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from verl_npu_autopatch.ownership import Installation
    from verl_npu_autopatch.records import Record
    from verl_npu_autopatch.spec import Patch, Target, Undo

__all__ = ["Slot"]


class Slot:
    """A patch's record and what the engine needs to act on it and re-check it.

    ``patch`` is ``None`` for an entry point that failed to load or was skipped (a record only);
    ``variants`` are the targets still in play after the gates; ``rejected`` maps the variants
    whose check said unsupported (last application) to why; ``installed`` and ``undo`` say where
    the applied fix installed what and how to take it back (``stale``: the undos of fixes left on
    module objects a re-execution replaced, run by ``revert`` too); ``yielded`` is the target left to
    another owner at apply time (re-checked); ``claimed``: an application is under way.
    """

    __slots__ = ("claimed", "installed", "patch", "record", "rejected", "stale", "undo", "variants", "yielded")

    def __init__(self, patch: Patch | None, record: Record, variants: tuple[Target, ...] = ()) -> None:
        self.patch = patch
        self.record = record
        self.variants = variants
        self.rejected: dict[Target, str] = {}
        self.installed: Installation | None = None
        self.undo: Undo | None = None
        self.stale: list[Undo] = []
        self.yielded: Target | None = None
        self.claimed = False

    def live(self) -> bool:
        """A fix of this patch went in and was not taken back (its undo is kept)."""
        return self.undo is not None or self.installed is not None or bool(self.stale)

    def release(self, keep: bool = False) -> Undo | None:
        """Forget what the fix installed (reverted, handed over, or to be applied afresh);
        returns its undo, also kept in :attr:`stale` with ``keep`` (the module was executed again)."""
        undo, self.undo, self.installed = self.undo, None, None
        if keep and undo is not None:
            self.stale.append(undo)
        return undo
