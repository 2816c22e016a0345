"""What the engine installed: remembered per slot, re-verified against the live attribute
(``ownership.verify``), applied again after ``importlib.reload``, and handed over between
patches (the :class:`~verl_npu_autopatch.handover.HandOver` interface)."""

from __future__ import annotations

from verl_npu_autopatch import _logging

TYPE_CHECKING = False
if TYPE_CHECKING:  # ``ownership`` is imported on first use: the inert path never needs it
    import _thread
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

    from verl_npu_autopatch import ownership
    from verl_npu_autopatch._slots import Slot
    from verl_npu_autopatch.records import Record
    from verl_npu_autopatch.spec import Patch, Site, Undo

__all__ = ["Installed"]


class Installed:
    """The engine's ownership and hand-over half (a mixin of ``engine.Engine``)."""

    _lock: _thread.RLock
    _slots: dict[str, Slot]
    _watcher: ownership.ReloadWatcher | None

    if TYPE_CHECKING:  # provided by engine.Engine

        def _apply(self, patch: Patch, module: ModuleType | None) -> Exception | None: ...
        def _set(self, record: Record, state: str, reason: str, exc: BaseException | None = None) -> None: ...

    def _remember(self, slot: Slot, site: Site, reason: str, undo: Undo | None = None) -> None:
        """Note where ``site.patch`` installed what, and watch its module for reloads."""
        from verl_npu_autopatch import ownership

        installed = ownership.installation(site, reason, undo)
        with self._lock:
            slot.installed = installed
            if self._watcher is None:
                self._watcher = ownership.ReloadWatcher(self._watches, self._on_reload)
            watcher = self._watcher
        watcher.put_first()

    def verify(self) -> None:
        """Re-check every applied (or displaced) patch against the live attribute and move its
        record to ``applied``, ``yielded`` or ``superseded`` accordingly. Never raises."""
        from verl_npu_autopatch import ownership

        with self._lock:
            installed = [(slot, slot.installed) for slot in self._slots.values() if slot.installed is not None]
        for slot, where in installed:
            record = slot.record
            try:
                state, reason = ownership.verify(slot.patch, record.versions, where, self)
            except Exception as exc:  # a detector bug must not break report()
                _logging.logger().debug("verifying %s raised %r", record.name, exc, exc_info=True)
                continue
            with self._lock:
                if slot.installed is not where or record.state not in ownership.VERIFIED_STATES:
                    continue  # reverted, yielded or re-applied meanwhile
                changed = (record.state, record.reason) != (state, reason)
            if changed:
                self._set(record, state, reason)
        self._verify_yields()

    def _verify_yields(self) -> None:
        """Re-name the owner of each target yielded at apply time when another owner the
        detectors recognise took it since (verl assigning a class another of our families
        patched first). Never raises."""
        from verl_npu_autopatch import ownership

        with self._lock:
            yields = [(slot, slot.yielded) for slot in self._slots.values() if slot.yielded is not None]
        for slot, target in yields:
            record = slot.record
            try:
                reason = ownership.yielded_reason(slot.patch, target, record.versions, self)
            except Exception as exc:  # a detector bug must not break report()
                _logging.logger().debug("verifying %s raised %r", record.name, exc, exc_info=True)
                continue
            with self._lock:
                if record.state != "yielded":
                    slot.yielded = None
                    continue
                changed = reason is not None and reason != record.reason
            if changed:
                self._set(record, "yielded", reason)

    def _watches(self, module: str) -> bool:
        """Whether a reload of ``module`` concerns an applied or displaced patch."""
        with self._lock:
            return any(s.installed is not None and s.installed.target.module == module for s in self._slots.values())

    def _on_reload(self, module: ModuleType) -> None:
        """``importlib.reload`` re-executed ``module``: its targets hold upstream code again, so
        every patch applied (or displaced) there is decided and applied afresh."""
        from verl_npu_autopatch import ownership

        with self._lock:
            slots = [
                slot
                for slot in self._slots.values()
                if slot.installed is not None
                and slot.installed.target.module == module.__name__
                and slot.record.state in ownership.VERIFIED_STATES
            ]
            for slot in slots:
                slot.release()  # its undo acts on the classes the reload replaced
                slot.record.state = "pending"
        for slot in slots:
            try:
                self._apply(slot.patch, module)
            except Exception:  # _apply records failures itself; this is a last guard for reload
                _logging.logger().debug("re-applying %s after reload raised", slot.record.name, exc_info=True)
            record = slot.record
            with self._lock:
                where = slot.installed if record.state == "applied" else None
                if where is not None:
                    where.reason = f"{where.reason}; again after importlib.reload"
            if where is not None:
                self._set(record, "applied", where.reason)

    # ----------------------------------------------------------------- hand-over
    def record(self, name: str) -> Record | None:
        """A copy of patch ``name``'s record as it stands, or ``None`` for an unknown name."""
        from verl_npu_autopatch.records import Record

        with self._lock:
            slot = self._slots.get(name)
            if slot is None:
                return None
            return Record(**{**slot.record.__dict__, "versions": dict(slot.record.versions)})

    def note(self, name: str, text: str) -> None:
        """Add ``text`` to the reason of patch ``name`` while it is applied (e.g. why a target
        stays ours beside Liger-Kernel); kept when the record is re-verified."""
        with self._lock:
            slot = self._slots.get(name)
            record = None if slot is None else slot.record
            if record is None or record.state != "applied" or text in record.reason:
                return
            reason = f"{record.reason}; {text}"
            if slot.installed is not None:
                slot.installed.reason = reason
        self._set(record, "applied", reason)

    def reapply(self, name: str, when: Callable[[Any], bool]) -> bool:
        """Decide and apply patch ``name`` afresh when ``when(live value)`` holds for what another
        owner put over our installed value (verl <= 0.8 patching while its module is imported,
        after our hooks ran). The old undo is dropped (it acts only while our value is live);
        the new one restores that other owner's value. Returns whether ``name`` is applied now."""
        from verl_npu_autopatch import ownership

        with self._lock:
            slot = self._slots.get(name)
            where = None if slot is None else slot.installed
            if where is None or where.checks != "ours":
                return False
            found = ownership.lookup(where.module, where.target.qualname)
            if found is None or found[1] is where.value or not when(found[1]):
                return False
            slot.release()
            slot.record.state = "pending"
        self._apply(slot.patch, where.module)
        return slot.record.state == "applied"

    def yield_to(self, name: str, owner: str) -> bool:
        """Hand patch ``name``'s target to ``owner``: undo it if applied, record ``yielded``.

        Returns whether the patch was applied before. Used for arbitration with e.g. Liger-Kernel.
        This runs inside the user's call (Liger's apply function): an undo that raises is logged
        and recorded (``failed``, as in ``revert``), never raised."""
        with self._lock:
            slot = self._slots.get(name)
            if slot is None or slot.record.state not in ("pending", "applied"):
                return False
            undo = slot.release()
        if undo is not None:
            try:
                undo()
            except Exception as exc:  # logged at ERROR with its traceback
                self._set(slot.record, "failed", f"handing to {owner}: undo raised {type(exc).__name__}: {exc}", exc)
                return True
        self._set(slot.record, "yielded", f"target handed to {owner}")
        return undo is not None
