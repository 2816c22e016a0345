"""Applying each pending patch and keeping what it installed: the pipeline's outcome recorded
in the patch's slot, what was installed remembered there, re-checked against the live attribute
(``ownership.recheck``), applied again after ``importlib.reload``, handed over between patches
(it is the :class:`~verl_npu_autopatch.authoring.handover.HandOver` the fixes' sites carry) and reverted.

:class:`AppliedFixes` acts on the engine's slots (``slots.Slots``), given at its creation, and
knows nothing else of the engine."""

from __future__ import annotations

import sys

from verl_npu_autopatch.engine import log

TYPE_CHECKING = False
if TYPE_CHECKING:  # ``ownership`` is imported on first use: the inactive path never needs it
    from collections.abc import Callable, Iterable, Iterator
    from types import ModuleType
    from typing import Any, TypeVar

    from typing_extensions import TypeIs

    from verl_npu_autopatch.authoring.spec import Patch, Site, Target, Undo
    from verl_npu_autopatch.engine import ownership
    from verl_npu_autopatch.engine.catalog import Declared
    from verl_npu_autopatch.engine.config import Config
    from verl_npu_autopatch.engine.decision import Outcome
    from verl_npu_autopatch.engine.records import Record, RecordState
    from verl_npu_autopatch.engine.slots import Slot, Slots

    Held = TypeVar("Held")
    Decided = TypeVar("Decided")


__all__ = ["AppliedFixes"]


class AppliedFixes:
    """The ownership and hand-over half of an engine: what its fixes installed, and who owns
    each of those targets now."""

    def __init__(self, slots: Slots, strict_error: type[Exception]) -> None:
        self._slots = slots
        self._strict_error = strict_error  # the engine's PatchError
        self._reexecutions: ownership.Reexecutions | None = None
        self._absent: set[str] = set()  # modules ``settle`` was told do not exist

    # ----------------------------------------------------------------- application
    def on_import(self, module: ModuleType) -> list[Exception]:
        """Apply every pending patch that targets ``module`` (what ``sys.modules`` holds under its
        name, should it have replaced itself there while executing); returns the strict-mode errors."""
        live = sys.modules.get(module.__name__)  # (``ownership.live_module``, not imported on the inactive path)
        module = module if live is None else live
        with self._slots.lock:
            patches = [
                slot.patch
                for slot in self._slots.values()
                if slot.patch is not None and any(t.module == module.__name__ for t in slot.variants)
            ]
        return [error for error in (self.apply(patch, module) for patch in patches) if error is not None]

    def pending_modules(self) -> list[str]:
        """Modules still awaited by pending patches, in catalog order."""
        with self._slots.lock:
            modules = [
                t.module for slot in self._slots.values() if slot.record.state == "pending" for t in slot.variants
            ]
        return list(dict.fromkeys(modules))

    def settle(self, absent: Iterable[str], catch_up: Callable[[], None]) -> None:
        """Conclude every pending patch from what is imported and ``absent`` (modules that do not
        exist here), once ``catch_up`` has handled the modules whose hook was deferred: a patch
        none of whose variants can be found any more becomes ``unsupported``."""
        with self._slots.lock:
            self._absent.update(absent)
            pending = [
                s.patch
                for s in self._slots.values()
                if s.patch is not None and s.record.state == "pending" and s.variants
            ]
        catch_up()
        for patch in pending:
            self.apply(patch, None)

    def apply(self, patch: Patch | Declared, module: ModuleType | None) -> Exception | None:
        """Decide and apply one pending patch on a freshly imported module (``None``: from what
        is imported and what ``settle`` knows is absent) and record the outcome; a patch the
        catalog only declared is loaded first (its family imported). Returns a strict-mode error."""
        from verl_npu_autopatch.engine import decision

        config = self._slots.config
        assert config is not None, "hooks are registered only by activate()"
        with self._slots.lock:
            slot = self._slots[patch.name]
            if slot.record.state != "pending" or slot.claimed:
                return None
            slot.claimed = True
            absent = frozenset(self._absent)
        try:
            try:
                loaded = _loaded(slot)
            except Exception as exc:  # a family that cannot be imported: this patch's failure alone
                reason = f"loading its family raised {describe(exc)}"
                outcome = decision.Outcome("failed", reason, stage="load", error=exc)
            else:
                outcome = decision.run(
                    loaded, slot.variants, slot.record.versions, module, config, absent=absent, handover=self
                )
            return self._record_outcome(slot, outcome, module, config)
        finally:
            with self._slots.lock:
                slot.claimed = False

    def _record_outcome(
        self, slot: Slot, outcome: Outcome, module: ModuleType | None, config: Config
    ) -> Exception | None:
        """Keep what the pipeline decided in ``slot`` and its record. Returns a strict-mode error."""
        record, state, reason, error = slot.record, outcome.state, outcome.reason, outcome.error
        if outcome.target is not None:
            record.target = str(outcome.target)
        with self._slots.lock:
            slot.rejected = outcome.rejected
            if state == "yielded":
                slot.yielded = outcome.target
            if outcome.undo is not None:
                slot.undo = outcome.undo
        if state == "pending":
            return None  # another variant's module is still to come
        if state == "applied" and outcome.site is not None:
            try:
                self.remember(slot, outcome.site, reason, outcome.undo)
            except Exception as exc:  # as if the fix raised: its undo is kept for revert()
                state, reason, error = "failed", f"fix raised {describe(exc)}", exc
        self._slots.set_state(record, state, reason, error)
        if not config.strict:
            return None
        if state == "failed":
            where = outcome.target or (module.__name__ if module else record.name)
            failure = self._strict_error(f"patch {record.name} on {where}: {reason}")
            failure.__cause__ = error
            return failure
        if state == "unsupported":
            return self._strict_error(f"patch {record.name} on {record.target}: unsupported: {reason}")
        return None

    def remember(self, slot: Slot, site: Site, reason: str, undo: Undo | None = None) -> None:
        """Note where ``site.patch`` installed what, and watch its module for reloads."""
        from verl_npu_autopatch.engine import ownership

        installed = ownership.installation(site, reason, undo)
        with self._slots.lock:
            slot.footprint = installed
            if self._reexecutions is None:
                self._reexecutions = ownership.Reexecutions(self._watches, self._on_reload)
            reexecutions = self._reexecutions
        reexecutions.watch(installed.target.module)

    def recheck(self) -> None:
        """Re-check every applied (or displaced) patch against the live attribute and move its
        record to ``applied``, ``yielded`` or ``superseded`` accordingly. Never raises."""
        from verl_npu_autopatch.engine import ownership

        def recheck(slot: Slot, where: ownership.Footprint) -> tuple[RecordState, str]:
            return ownership.recheck(_patch_of(slot), slot.record.versions, where, self)

        for slot, where, (state, reason) in self._decide_each(lambda slot: slot.footprint, recheck):
            record = slot.record
            with self._slots.lock:
                if slot.footprint is not where or record.state not in ownership.RECHECKED_STATES:
                    continue  # reverted, yielded or re-applied meanwhile
                changed = (record.state, record.reason) != (state, reason)
            if changed:
                self._slots.set_state(record, state, reason)
        self._recheck_yields()

    def _recheck_yields(self) -> None:
        """Re-name the owner of each target yielded at apply time when another owner the
        detectors recognise took it since (verl assigning a class another of our families
        patched first). Never raises."""
        from verl_npu_autopatch.engine import ownership

        def named(slot: Slot, target: Target) -> str | None:
            return ownership.yielded_reason(_patch_of(slot), target, slot.record.versions, self)

        for slot, _, reason in self._decide_each(lambda slot: slot.yielded, named):
            record = slot.record
            with self._slots.lock:
                if record.state != "yielded":
                    slot.yielded = None
                    continue
                changed = reason is not None and reason != record.reason
            if changed and reason is not None:
                self._slots.set_state(record, "yielded", reason)

    def _decide_each(
        self, value_of: Callable[[Slot], Held | None], decide: Callable[[Slot, Held], Decided]
    ) -> Iterator[tuple[Slot, Held, Decided]]:
        """``(slot, value, decide(slot, value))`` for each slot whose ``value_of(slot)`` is set (read under
        the lock, decided outside it); a slot whose ``decide`` raises is logged and left out."""
        with self._slots.lock:
            pairs = [(slot, value) for slot in self._slots.values() if (value := value_of(slot)) is not None]
        for slot, value in pairs:
            try:
                decided = decide(slot, value)
            except Exception as exc:  # a detector bug must not break report()
                log.logger().debug("re-checking %s raised %s", slot.record.name, describe(exc), exc_info=True)
                continue
            yield slot, value, decided

    def _watches(self, module: str) -> bool:
        """Whether a reload of ``module`` concerns an applied or displaced patch."""
        with self._slots.lock:
            return any(s.footprint is not None and s.footprint.target.module == module for s in self._slots.values())

    def _on_reload(self, module: ModuleType, how: str) -> None:
        """``module`` was executed again (``importlib.reload``, or imported afresh after leaving
        ``sys.modules``): its targets hold upstream code again, so every patch applied (or
        displaced) there is decided and applied afresh. The undo of a fix on an earlier module
        object is kept for ``revert`` (it acts only while its value is still in place)."""
        from verl_npu_autopatch.engine import ownership

        with self._slots.lock:
            reloaded = [
                slot
                for slot in self._slots.values()
                if slot.footprint is not None
                and slot.footprint.target.module == module.__name__
                and slot.record.state in ownership.RECHECKED_STATES
            ]
            for slot in reloaded:
                slot.release(keep=True)  # its undo acts on the objects the re-execution replaced
                slot.record.state = "pending"
        for slot in reloaded:
            try:
                self.apply(_patch_of(slot), module)
            except Exception:  # apply records failures itself; this is a last guard for reload
                log.logger().debug("re-applying %s after reload raised", slot.record.name, exc_info=True)
            record = slot.record
            with self._slots.lock:
                where = slot.footprint if record.state == "applied" else None
                if where is not None:
                    where.reason = f"{where.reason}; again after {how}"
            if where is not None:
                self._slots.set_state(record, "applied", where.reason)

    # ----------------------------------------------------------------- hand-over
    def record(self, name: str) -> Record | None:
        """A copy of patch ``name``'s record as it stands, or ``None`` for an unknown name."""
        with self._slots.lock:
            slot = self._slots.get(name)
            if slot is None:
                return None
            return slot.record.copy()

    def note(self, name: str, text: str) -> None:
        """Add ``text`` to the reason of patch ``name`` while it is applied (e.g. why a target
        stays ours beside Liger-Kernel); kept when the record is re-checked."""
        with self._slots.lock:
            slot = self._slots.get(name)
            if slot is None or slot.record.state != "applied" or text in slot.record.reason:
                return
            record = slot.record
            reason = f"{record.reason}; {text}"
            if slot.footprint is not None:
                slot.footprint.reason = reason
        self._slots.set_state(record, "applied", reason)

    def reapply(self, name: str, when: Callable[[Any], bool]) -> bool:
        """Decide and apply patch ``name`` afresh when ``when(live value)`` holds for what another
        owner put over our installed value (verl <= 0.8 patching while its module is imported,
        after our hooks ran). The old undo is dropped (it acts only while our value is live);
        the new one restores that other owner's value. Returns whether ``name`` is applied now."""
        from verl_npu_autopatch.engine import ownership

        with self._slots.lock:
            slot = self._slots.get(name)
            where = None if slot is None else slot.footprint
            if slot is None or where is None or where.checks != "ours":
                return False
            found = ownership.lookup(where.module, where.target.qualname)
            if found is None or found[1] is where.value or not when(found[1]):
                return False
            slot.release()
            slot.record.state = "pending"
        self.apply(_patch_of(slot), where.module)
        return slot.record.state == "applied"

    def yield_to(self, name: str, owner: str) -> bool:
        """Hand patch ``name``'s target to ``owner``: undo it if applied, record ``yielded``.

        Returns whether the patch was applied before. Used for arbitration with e.g. Liger-Kernel.
        This runs inside the user's call (Liger's apply function): an undo that raises is logged
        and recorded (``failed``, as in ``revert``), never raised."""
        with self._slots.lock:
            slot = self._slots.get(name)
            if slot is None or slot.record.state not in ("pending", "applied"):
                return False
            undo = slot.release()
        if undo is not None:
            try:
                undo()
            except Exception as exc:  # logged at ERROR with its traceback
                self._slots.set_state(slot.record, "failed", f"handing to {owner}: undo raised {describe(exc)}", exc)
                return True
        self._slots.set_state(slot.record, "yielded", f"target handed to {owner}")
        return undo is not None

    # ----------------------------------------------------------------- revert
    def revert(self, name: str | None = None) -> list[str]:
        """Undo applied patches (all, one by name, or a group); returns the names reverted.

        Records are re-checked first: a patch another owner displaced (``superseded`` or
        ``yielded``) is left alone, so the live owner is never clobbered; the log says why."""
        self.recheck()
        done = []
        for slot in self._matching(name):
            record = slot.record
            with self._slots.lock:
                displaced = ""
                if slot.footprint is not None and record.state != "applied" and _on_live_module(slot.footprint):
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
                self._slots.set_state(record, "failed", f"revert raised {describe(exc)}")
                continue
            self._slots.set_state(record, "reverted", "reverted by revert()")
            done.append(record.name)
        self._revert_yields_to(done)
        return done

    def _revert_yields_to(self, reverted: list[str]) -> None:
        """A patch that yielded its target to one just reverted is not in effect either (that owner
        held the target, or carried this fix inside its own): its record says so, not the old owner."""
        with self._slots.lock:
            yielded = [s for s in self._slots.values() if s.record.state == "yielded"]
        for slot in yielded:
            owner = next((name for name in reverted if _names_owner(slot.record.reason, name)), None)
            if owner is not None:
                slot.yielded = None
                self._slots.set_state(slot.record, "reverted", f"reverted with {owner}, which held its target")

    def _matching(self, name: str | None) -> list[Slot]:
        with self._slots.lock:
            slots = list(self._slots.values())
        if name is None:
            return slots
        return [s for s in slots if s.patch is not None and (name == s.record.name or name in s.patch.groups)]


def describe(exc: BaseException) -> str:
    """``text.describe``, imported on first use (the inactive path never formats an exception)."""
    from verl_npu_autopatch.engine.text import describe

    return describe(exc)


def _names_owner(reason: str, name: str) -> bool:
    """Whether a ``yielded`` reason names patch ``name`` as the target's owner."""
    prefix = f"target owned by {name}"
    return reason == prefix or reason.startswith((f"{prefix} ", f"{prefix},", f"{prefix};"))


def _on_live_module(installed: ownership.Footprint) -> bool:
    """Whether the module the fix went in on is still the one imported: a displaced fix there is
    another owner's to keep; one left on a module gone from ``sys.modules`` is undone and unwatched."""
    return sys.modules.get(installed.target.module) is installed.module


def _patch_of(slot: Slot) -> Patch:
    """The patch of a slot that installed something (loaded: it was applied)."""
    patch = slot.patch
    assert patch is not None and not _declared(patch)
    return patch


def _loaded(slot: Slot) -> Patch:
    """The patch of ``slot``, loaded (and kept there) if the catalog only declared it."""
    patch = slot.patch
    assert patch is not None, "an entry point's record is never applied"
    if _declared(patch):
        slot.patch = patch = patch.load()
    return patch


def _declared(patch: Patch | Declared) -> TypeIs[Declared]:
    """Whether the catalog only declared ``patch`` (by its shape, not its class: a fresh copy of
    our modules, e.g. after ``mock.patch.dict(sys.modules)``, has classes of its own)."""
    return callable(getattr(patch, "load", None))
