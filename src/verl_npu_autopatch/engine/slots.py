"""The engine's slots, one per patch, and their store, which records each decision, applies each
pending patch, keeps what the fix installed and re-checks it, re-applies it after a re-execution,
hands it over (the ``HandOver`` of the fixes' sites) and reverts it."""

from __future__ import annotations

import _thread
import sys

from verl_npu_autopatch.engine import log

TYPE_CHECKING = False
if TYPE_CHECKING:  # ``decision`` and ``ownership`` are imported on first use: the inactive path never needs them
    from collections.abc import Callable, Iterable
    from types import ModuleType
    from typing import Any

    from typing_extensions import TypeIs

    from verl_npu_autopatch.authoring.spec import Patch, Target, Undo
    from verl_npu_autopatch.engine.catalog import Declared
    from verl_npu_autopatch.engine.config import Config
    from verl_npu_autopatch.engine.decision import Outcome
    from verl_npu_autopatch.engine.ownership import Footprint, Reexecutions
    from verl_npu_autopatch.engine.records import Record, RecordState

__all__ = ["Slot", "Slots"]

#: The record states a re-check moves between: ``applied`` and the displaced ones.
_RECHECKED: tuple[RecordState, ...] = ("applied", "superseded", "yielded")


class Slot:
    """One patch's record, and: ``patch`` (``None`` for an entry point's record, ``Declared`` until
    loaded); ``variants`` left after the gates; ``footprint`` and ``undo`` of the fix (``stale``: undos
    of fixes on module objects a re-execution replaced); ``yielded``: the target left to another
    owner at apply time; ``claimed``: an application is under way."""

    __slots__ = ("claimed", "footprint", "patch", "record", "stale", "undo", "variants", "yielded")

    def __init__(self, patch: Patch | Declared | None, record: Record, variants: tuple[Target, ...] = ()) -> None:
        self.patch, self.record, self.variants = patch, record, variants
        self.footprint: Footprint | None = None
        self.undo: Undo | None = None
        self.stale: list[Undo] = []
        self.yielded: Target | None = None
        self.claimed = False

    def live(self) -> bool:
        """A fix of this patch went in and was not taken back (its undo is kept)."""
        return self.undo is not None or self.footprint is not None or bool(self.stale)

    def release(self, keep: bool = False) -> Undo | None:
        """Forget the fix and return its undo, kept in ``stale`` with ``keep`` (its module re-executed)."""
        undo, self.undo, self.footprint = self.undo, None, None
        if keep and undo is not None:
            self.stale.append(undo)
        return undo


class Slots(dict[str, Slot]):
    """``{patch name: slot}`` in catalog order, under :attr:`lock` (held briefly, never across an
    import). ``config``: set by activation; ``on_change`` refreshes the report file; ``error``: the
    strict-mode exception type (the engine's ``PatchError``)."""

    __hash__ = object.__hash__  # type: ignore[assignment]  # site.handover: a plugin may key on it

    def __init__(self, config: Config | None = None, error: type[Exception] = RuntimeError) -> None:
        super().__init__()
        self.lock = _thread.RLock()
        self.config = config
        self.error = error
        self.on_change: Callable[[], None] | None = None
        self._reexecutions: Reexecutions | None = None
        self._absent: set[str] = set()  # modules ``settle`` was told do not exist
        self._rechecking: set[int] = set()  # threads in recheck(): a decision it records asks for none again

    def after_fork(self) -> None:
        """In the child of ``os.fork()``: the lock may be held by a thread that is not there."""
        self.lock = _thread.RLock()

    def _each(self, keep: Callable[[Slot], object]) -> list[Slot]:
        with self.lock:
            return [slot for slot in self.values() if keep(slot)]

    def set_state(self, record: Record, state: RecordState, reason: str, exc: BaseException | None = None) -> None:
        """Record a decision and log it once; the reason is made safe (it may quote foreign text)."""
        from verl_npu_autopatch.engine.text import safe_str  # (records exist on the active path only)

        reason = safe_str(reason)
        with self.lock:
            record.state, record.reason = state, reason
        log.logger().log(log.level_of(state), "%s: %s (%s)", record.name, state, reason, exc_info=exc)
        if self.on_change is not None:
            self.on_change()

    # ----------------------------------------------------------------- application
    def on_import(self, module: ModuleType) -> list[Exception]:
        """Apply each pending patch on ``module`` (or what replaced it in ``sys.modules`` while it
        executed); returns the strict-mode errors."""
        live = sys.modules.get(module.__name__)
        module = module if live is None else live
        names = [s.record.name for s in self._each(lambda s: any(t.module == module.__name__ for t in s.variants))]
        return [error for error in (self.apply(name, module) for name in names) if error is not None]

    def pending_modules(self) -> list[str]:
        """Modules still awaited by pending patches, in catalog order."""
        pending = self._each(lambda slot: slot.record.state == "pending")
        return list(dict.fromkeys(t.module for slot in pending for t in slot.variants))

    def settle(self, absent: Iterable[str], catch_up: Callable[[], None]) -> None:
        """Conclude every pending patch from what is imported and ``absent``, after ``catch_up``: one
        none of whose variants can be found any more becomes ``unsupported``."""
        with self.lock:
            self._absent.update(absent)
        pending = self._each(lambda s: s.patch is not None and s.record.state == "pending" and s.variants)
        catch_up()
        for slot in pending:
            self.apply(slot.record.name, None)

    def apply(self, name: str, module: ModuleType | None) -> Exception | None:
        """Decide, apply and record pending patch ``name`` on a module just imported (``None``: from
        what is imported and known absent), loading its family first. Returns a strict-mode error."""
        from verl_npu_autopatch.engine import decision

        config = self.config
        assert config is not None, "hooks are registered only by activate()"
        with self.lock:
            slot = self[name]
            if slot.record.state != "pending" or slot.claimed:
                return None
            slot.claimed = True
            absent = frozenset(self._absent)
        try:
            try:
                patch = _loaded(slot)
            except Exception as exc:  # a family that cannot be imported: this patch's failure alone
                reason = f"loading its family raised {describe(exc)}"
                outcome = decision.Outcome("failed", reason, stage="load", error=exc)
            else:
                versions = slot.record.versions
                outcome = decision.run(patch, slot.variants, versions, module, config, absent=absent, handover=self)
            return self._record(slot, outcome, module, config)
        finally:
            with self.lock:
                slot.claimed = False

    def _record(self, slot: Slot, outcome: Outcome, module: ModuleType | None, config: Config) -> Exception | None:
        """Keep what the pipeline decided in ``slot`` and its record. Returns a strict-mode error."""
        from verl_npu_autopatch.engine import ownership

        record, state, reason, error = slot.record, outcome.state, outcome.reason, outcome.error
        if outcome.target is not None:
            record.target = str(outcome.target)
        with self.lock:
            if state == "yielded":
                slot.yielded = outcome.target
            if outcome.undo is not None:
                slot.undo = outcome.undo
        if state == "pending":
            return None  # another variant's module is still to come
        if state == "applied" and outcome.site is not None:
            try:  # where the fix installed what; its module is watched for re-executions
                footprint = ownership.installation(outcome.site, reason, outcome.undo)
                with self.lock:
                    slot.footprint = footprint
                    if self._reexecutions is None:
                        self._reexecutions = ownership.Reexecutions(self._watches, self._on_reload)
                    reexecutions = self._reexecutions
                reexecutions.watch(footprint.target.module)
            except Exception as exc:  # as if the fix raised: its undo is kept for revert()
                state, reason, error = "failed", f"fix raised {describe(exc)}", exc
        self.set_state(record, state, reason, error)
        if not config.strict or state not in ("failed", "unsupported"):
            return None
        if state == "unsupported":
            return self.error(f"patch {record.name} on {record.target}: unsupported: {reason}")
        where = outcome.target or (module.__name__ if module else record.name)
        failure = self.error(f"patch {record.name} on {where}: {reason}")
        failure.__cause__ = error
        return failure

    def recheck(self) -> None:
        """Move each applied (or displaced) record to what the live attribute says, and re-name the
        owner of each target yielded at apply time. Never raises: a detector's error is logged. Called
        again from a decision it records (the report file's refresh), it returns: the outer one goes on."""
        me = _thread.get_ident()
        if me in self._rechecking:
            return
        self._rechecking.add(me)
        try:
            self._recheck()
        finally:
            self._rechecking.discard(me)

    def _recheck(self) -> None:
        from verl_npu_autopatch.engine import ownership

        with self.lock:
            held = [(s, s.footprint, s.yielded) for s in self.values() if s.footprint is not None or s.yielded]
        held.sort(key=lambda found: found[1] is None)  # displaced first: a yield's detector may read their records
        for slot, where, target in held:
            record = slot.record
            try:
                if where is None:
                    assert target is not None
                    state: RecordState = "yielded"
                    reason = ownership.yielded_reason(_loaded(slot), target, record.versions, self)
                else:
                    state, reason = ownership.recheck(_loaded(slot), record.versions, where, self)
            except Exception as exc:  # a detector bug must not break report()
                log.logger().debug("re-checking %s raised %s", record.name, describe(exc), exc_info=True)
                continue
            with self.lock:
                if where is not None and (slot.footprint is not where or record.state not in _RECHECKED):
                    continue  # reverted, yielded or re-applied meanwhile
                if where is None and record.state != "yielded":
                    slot.yielded = None
                    continue
                changed = reason is not None and (record.state, record.reason) != (state, reason)
            if changed and reason is not None:
                self.set_state(record, state, reason)

    def _watches(self, module: str) -> bool:
        """Whether a re-execution of ``module`` concerns an applied or displaced patch."""
        return bool(self._each(lambda s: s.footprint is not None and s.footprint.target.module == module))

    def _on_reload(self, module: ModuleType, how: str) -> None:
        """``module`` was executed again (a reload, or a fresh import): apply its patches afresh; the
        old undos are kept for ``revert`` (each acts only while its value is live)."""
        with self.lock:
            reloaded = [
                slot
                for slot in self.values()
                if slot.footprint is not None
                and slot.footprint.target.module == module.__name__
                and slot.record.state in _RECHECKED
            ]
            for slot in reloaded:
                slot.release(keep=True)
                slot.record.state = "pending"
        for slot in reloaded:
            try:
                self.apply(slot.record.name, module)
            except Exception:  # apply records failures itself; this is a last guard for reload
                log.logger().debug("re-applying %s after reload raised", slot.record.name, exc_info=True)
            with self.lock:
                where = slot.footprint if slot.record.state == "applied" else None
                if where is not None:
                    where.reason = f"{where.reason}; again after {how}"
            if where is not None:
                self.set_state(slot.record, "applied", where.reason)

    # ----------------------------------------------------------------- hand-over
    def record(self, name: str) -> Record | None:
        """A copy of patch ``name``'s record as it stands, or ``None`` for an unknown name."""
        with self.lock:
            slot = self.get(name)
            return None if slot is None else slot.record.copy()

    def note(self, name: str, text: str) -> None:
        """Add ``text`` to the reason of applied patch ``name``; kept when the record is re-checked."""
        with self.lock:
            slot = self.get(name)
            if slot is None or slot.record.state != "applied" or text in slot.record.reason:
                return
            reason = f"{slot.record.reason}; {text}"
            if slot.footprint is not None:
                slot.footprint.reason = reason
        self.set_state(slot.record, "applied", reason)

    def reapply(self, name: str, when: Callable[[Any], bool]) -> bool:
        """Apply patch ``name`` afresh when ``when(live value)`` holds for what another owner put over
        ours (verl <= 0.8, after our hooks ran); the new undo restores that owner's value (the old
        acts only while ours is live). Returns whether ``name`` is applied now."""
        from verl_npu_autopatch.engine.ownership import lookup

        with self.lock:
            slot = self.get(name)
            where = None if slot is None else slot.footprint
            if slot is None or where is None or where.checks != "ours":
                return False
        found = lookup(where.module, where.target.qualname)  # outside the lock: a getter or when() may import
        if found is None or found[1] is where.value or not when(found[1]):
            return False
        with self.lock:
            if slot.footprint is not where:  # reverted, yielded or re-applied meanwhile
                return False
            slot.release()
            slot.record.state = "pending"
        self.apply(name, where.module)
        return slot.record.state == "applied"

    def yield_to(self, name: str, owner: str) -> bool:
        """Hand patch ``name``'s target to ``owner``: undo it, record ``yielded``; returns whether it was
        applied. It runs in the user's call (Liger's apply): an undo that raises is recorded, not raised."""
        with self.lock:
            slot = self.get(name)
            if slot is None or slot.record.state not in ("pending", "applied"):
                return False
            undo = slot.release()
        if undo is not None:
            try:
                undo()
            except Exception as exc:  # logged at ERROR with its traceback
                self.set_state(slot.record, "failed", f"handing to {owner}: undo raised {describe(exc)}", exc)
                return True
        self.set_state(slot.record, "yielded", f"target handed to {owner}")
        return undo is not None

    # ----------------------------------------------------------------- revert
    def revert(self, name: str | None = None) -> list[str]:
        """Undo applied patches (all, one by name, or a group); returns the names reverted. A patch
        another owner displaced on the live module (re-checked first) is left alone: never clobbered."""
        self.recheck()
        done = []
        for slot in self._each(
            lambda s: name is None or (s.patch is not None and name in (s.record.name, *s.patch.groups))
        ):
            record = slot.record
            with self.lock:  # displaced on the live module: the owner's; on one gone from sys.modules: undone
                where, displaced = slot.footprint, ""
                if (
                    where is not None
                    and record.state != "applied"
                    and sys.modules.get(where.target.module) is where.module
                ):
                    displaced = f"{record.state}: {record.reason}"
                else:
                    undos = [step for step in (slot.release(), *slot.stale) if step is not None]
                    slot.stale = []
            if displaced:
                log.logger().info("%s: not reverted, the live target is not ours (%s)", record.name, displaced)
                continue
            if not undos:
                continue
            try:
                for step in undos:  # the live fix, then those left on earlier module objects
                    step()
            except Exception as exc:
                log.logger().error("reverting %s failed", record.name, exc_info=True)
                self.set_state(record, "failed", f"revert raised {describe(exc)}")
                continue
            self.set_state(record, "reverted", "reverted by revert()")
            done.append(record.name)
        # a patch that yielded its target to one reverted here is not in effect either (that owner
        # held the target, or carried this fix inside its own): its record says so
        for slot in self._each(lambda s: s.record.state == "yielded"):
            owner = next((n for n in done if _names_owner(slot.record.reason, n)), None)
            if owner is not None:
                slot.yielded = None
                self.set_state(slot.record, "reverted", f"reverted with {owner}, which held its target")
        return done


def describe(exc: BaseException) -> str:
    """``text.describe``, imported on first use (not on the inactive path)."""
    from verl_npu_autopatch.engine.text import describe

    return describe(exc)


def _names_owner(reason: str, name: str) -> bool:
    """Whether a ``yielded`` reason names patch ``name`` as the target's owner."""
    prefix = f"target owned by {name}"
    return reason == prefix or reason.startswith((f"{prefix} ", f"{prefix},", f"{prefix};"))


def _loaded(slot: Slot) -> Patch:
    """The patch of ``slot``, loaded (and kept there) if the catalog only declared it."""
    patch = slot.patch
    assert patch is not None, "an entry point's record is never applied"
    if _declared(patch):
        slot.patch = patch = patch.load()
    return patch


def _declared(patch: Patch | Declared) -> TypeIs[Declared]:
    """Whether the catalog only declared ``patch`` (by its shape: a fresh copy of our modules has its own classes)."""
    return callable(getattr(patch, "load", None))
