"""The engine's life cycle: activation, hook registration, applying each patch as its target is
imported, and the in-process records (``report``, ``revert``).

Its other jobs live in private modules: target resolution (``_resolution``), the per-patch
decision pipeline (``_pipeline``, a function of its inputs), one slot per patch (``_slots``),
what was installed, its verification and hand-over (``_installed``), and logging (``_logging``).

The start-up module usually decides "inactive" on a host without the NPU stack before this
module is ever imported. When it is imported there anyway (``report()``, ``activate()``, the vLLM
plugin), :func:`activate` still decides that from the configuration alone, without importing
wrapt, ``logging``, ``importlib.metadata`` or ``dataclasses``; everything heavier is imported on
the active path only.
"""

from __future__ import annotations

import _thread
import sys

from verl_npu_autopatch import _activation, _environment, _gates, _logging
from verl_npu_autopatch._config import Config, read_config, startup
from verl_npu_autopatch._installed import Installed
from verl_npu_autopatch._logging import LOGGER_NAME

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from types import ModuleType

    from verl_npu_autopatch._pipeline import Outcome
    from verl_npu_autopatch._slots import Slot
    from verl_npu_autopatch.ownership import ReloadWatcher
    from verl_npu_autopatch.records import Record, Report
    from verl_npu_autopatch.spec import Patch

__all__ = ["LOGGER_NAME", "Engine", "PatchError", "activate", "engine", "report", "revert"]

#: The longest an import in another thread waits for an activation under way: far beyond any
#: real activation (even on an overloaded host), it only turns a wait the import system cannot
#: see into a stall instead of a hang.
_WAIT_LIMIT_S = 300.0


class PatchError(RuntimeError):
    """Raised at a target's import in strict mode; names the patch, the target and the cause."""


class Engine(Installed):
    """Owns one process's patch records. ``activate`` runs once; the rest is driven by imports.

    ``catalogue`` and ``config`` default to the built-in catalogue (plus entry points) and the
    environment; tests pass their own. Each patch has one :class:`~._slots.Slot`; the engine
    itself passes as ``site.engine``, the :class:`~verl_npu_autopatch.handover.HandOver` of
    patch families that arbitrate with other patches.
    """

    def __init__(self, catalogue: Sequence[Patch] | None = None, config: Config | None = None) -> None:
        self._catalogue = catalogue
        self._given_config = self._config = config
        self._lock = _thread.RLock()  # records and claims; held only briefly, never across imports
        self._activation_lock = _thread.RLock()
        self.status = "not-activated"
        self.reason = ""
        self.trigger = ""
        self.device = ""
        self.warnings: list[str] = []
        self._slots: dict[str, Slot] = {}
        self._watcher: ReloadWatcher | None = None
        self._hooked: set[str] = set()  # modules with a post-import hook
        self._absent: set[str] = set()  # modules ``settle`` was told do not exist
        self._deferred: set[str] = set()  # modules still executing when their hook was due
        self._activator = 0
        self._observed = False  # the start-up hook was on sys.meta_path when activation began
        self._checked_names = False

    @property
    def records(self) -> dict[str, Record]:
        """``{patch name: its live record}``, in catalogue order."""
        with self._lock:
            return {name: slot.record for name, slot in self._slots.items()}

    @property
    def patches(self) -> dict[str, Patch]:
        """``{patch name: patch}`` of the patches loaded, in catalogue order."""
        with self._lock:
            return {name: slot.patch for name, slot in self._slots.items() if slot.patch is not None}

    # ----------------------------------------------------------------- activation
    def activate(self, trigger: str = "api") -> None:
        """Decide whether to act in this process and, if so, register every patch's hooks.

        Runs once; a concurrent call waits until the first is done, later calls return at once.
        While it runs, the process-wide engine has the start-up observer guard imports (see
        ``_activation.guard``), so a target imported meanwhile by another thread waits and
        is patched before its import completes. Never raises, except ``PatchError`` in strict
        mode. Never called with the interpreter's import lock held (the start-up observer
        activates from its loader, not from ``find_spec``). Interrupted (``KeyboardInterrupt``,
        ``SystemExit``), it goes back to not activated and re-raises: a later watched import or
        call activates again.
        """
        if not self._enter():
            return
        try:
            if self.status != "not-activated":
                return
            self.status = "activating"
            self.trigger = trigger
            self._activator = _thread.get_ident()
            self._observed = startup.hooked()
            config = self._config = self._config or read_config()
            self.warnings = list(config.warnings)
            _logging.configure(config)
            self.device, inert = _environment.device_decision(config)
            if inert:
                self.status, self.reason = "inactive", inert
                self._flush_warnings()
                if config.log_level:
                    _logging.logger().info("engine inactive: %s", inert)
                if self is _ENGINE:
                    _activation.stop_observing()
                return
            if self is _ENGINE:
                _activation.guard(self._activator)
            try:
                self._activate(config)
            except PatchError:
                raise  # strict mode
            except Exception as exc:  # a bug or a broken install must not break the user's import
                self.status, self.reason = "failed", f"activation failed: {type(exc).__name__}: {exc}"
                _logging.logger().error("verl-npu-autopatch %s", self.reason, exc_info=exc)
                if config.strict:
                    raise PatchError(f"verl-npu-autopatch {self.reason} (strict mode)") from exc
            finally:
                if self is _ENGINE:
                    _activation.stop_observing()
        except BaseException as exc:
            if not isinstance(exc, Exception):  # Ctrl-C during a slow first import: activate again later
                self._abandon()
            raise
        finally:
            self._activation_lock.release()

    def _abandon(self) -> None:
        """An activation that cannot finish (interrupted, or under way in a thread a fork left
        behind): back to ``not-activated``, and, where the start-up hook was in place, observing
        again. Hooks already registered stay (they act only on pending records); a fix already
        installed is found in place when the engine activates again."""
        with self._lock:
            self.status, self.reason, self.trigger, self.device = "not-activated", "", "", ""
            self.warnings, self._slots, self._config = [], {}, self._given_config
            self._hooked -= self._deferred
            self._deferred.clear()
            self._activator, self._checked_names = 0, False
        if self is _ENGINE:
            _activation.observe_again(self._observed)

    def after_fork(self) -> None:
        """In the child of ``os.fork()`` (``_activation`` registers the handler): the locks may be
        held by threads that do not exist here; an activation under way in one of them is
        abandoned. An activation in the thread that forked goes on."""
        if self.status == "activating" and self._activator == _thread.get_ident():
            return
        self._lock, self._activation_lock = _thread.RLock(), _thread.RLock()
        if self.status == "activating":
            self._abandon()

    def _enter(self) -> bool:
        """Take the activation lock, waiting for an activation under way in another thread.
        Gives up (``False``) if that thread waits for a module this thread is importing, which
        would otherwise deadlock, or after ``_WAIT_LIMIT_S`` (a wait the import system cannot
        see, e.g. a plugin joining a thread that imports): a stall, never a hang."""
        lock = self._activation_lock
        for _ in range(int(_WAIT_LIMIT_S / 0.05)):
            if lock.acquire(timeout=0.05):
                return True
            if _blocked_on_us(self._activator):
                return False
        _logging.logger().warning("waited %g s for the activation in another thread; going on unguarded", _WAIT_LIMIT_S)
        return False

    def _activate(self, config: Config) -> None:
        logger = _logging.logger()
        import wrapt  # missing or broken: activation fails here, before anything is recorded

        from verl_npu_autopatch import catalog
        from verl_npu_autopatch._slots import Slot
        from verl_npu_autopatch.records import Record

        problem = _environment.wrapt_problem()
        if problem:  # an old wrapt registers hooks that may never fire
            raise RuntimeError(problem)
        logger.debug("wrapt %s from %s", _environment.distribution_version("wrapt"), getattr(wrapt, "__file__", "?"))

        if self._catalogue is not None:
            loaded = catalog.Catalogue(list(self._catalogue))
        else:
            loaded = catalog.load(config.disable)
        patches = loaded.patches
        self.warnings += config.unknown_names(loaded.names())
        self._checked_names = True
        self._flush_warnings()
        for name, error, exc in loaded.errors:
            self._record_load_error(name, error, exc)
        for name in loaded.skipped:
            self._record_skipped(name)
        logger.debug("catalogue: %d patches, entry points %s", len(patches), ", ".join(loaded.entry_points) or "none")
        unique: dict[str, Patch] = {}
        for patch in patches:
            if patch.name in unique:
                self.warnings.append(f"duplicate patch name {patch.name!r}: the second one is ignored")
                logger.warning("%s", self.warnings[-1])
            else:
                unique[patch.name] = patch
        if self is _ENGINE:  # from now on guard only the target packages
            tops = {t.module.partition(".")[0] for p in unique.values() for t in p.hooks}
            _activation.guard(self._activator, tops)
        plans = {name: _gates.plan(patch, config) for name, patch in unique.items()}
        with self._lock:
            self.status, self.reason = "active", f"activated by {self.trigger}"
            for name, plan in plans.items():
                patch = unique[name]
                targets = " | ".join(map(str, plan.variants or patch.hooks))
                record = Record(name, patch.groups, targets, "pending", versions=plan.versions)
                self._slots[name] = Slot(patch, record, plan.variants)
        logger.info("engine active (%s); device %s", self.reason, self.device)
        for name, plan in plans.items():
            self._set(self._slots[name].record, plan.state, plan.reason)
        self._register_hooks()
        if config.strict and loaded.errors:
            name, error, exc = loaded.errors[0]
            raise PatchError(f"{name}: {error}") from exc

    def _register_hooks(self) -> None:
        """One wrapt post-import hook per target module. A module already imported is handled at
        once; one still executing (another thread's, or the package whose import woke us) is
        handled when it finishes: see :meth:`module_loaded` and :meth:`_catch_up`."""
        import wrapt

        from verl_npu_autopatch._resolution import initializing

        with self._lock:
            wanted = dict.fromkeys(t.module for slot in self._slots.values() for t in slot.variants)
            modules = [module for module in wanted if module not in self._hooked]
        errors = []
        for module in modules:
            if initializing(sys.modules.get(module)):
                with self._lock:
                    self._deferred.add(module)
                    self._hooked.add(module)
                continue
            _logging.logger().debug("post-import hook on %s", module)
            try:
                wrapt.register_post_import_hook(self._on_import, module)
            except PatchError as error:
                errors.append(error)
            with self._lock:  # one by one: an interrupted activation registers the rest later
                self._hooked.add(module)
        if errors:
            raise errors[0]

    # ----------------------------------------------------------------- application
    def module_loaded(self, module: ModuleType) -> None:
        """A target module finished executing outside wrapt's view (the package whose import
        activated the engine): apply its pending patches now. Raises only in strict mode."""
        with self._lock:
            self._deferred.discard(module.__name__)
        self._on_import(module)

    def module_failed(self, module: ModuleType) -> None:
        """A target module deferred at hook registration raised while executing (its import
        fails, and may be retried): hook its next import, as if it had never been imported."""
        name = module.__name__
        with self._lock:
            if name not in self._deferred:
                return
            self._deferred.discard(name)
        if sys.modules.get(name) is module:
            del sys.modules[name]  # as the import system does next; wrapt hooks only what is not loaded
        self._hook_later([name])

    def _hook_later(self, names: list[str]) -> None:
        """Post-import hooks on deferred modules whose import failed (no longer in ``sys.modules``)."""
        if not names:
            return  # e.g. ``settle`` on an engine that never activated: wrapt is not needed
        import wrapt

        for name in names:
            _logging.logger().debug("post-import hook on %s (its import failed)", name)
            wrapt.register_post_import_hook(self._on_import, name)

    def _catch_up(self) -> None:
        """Apply patches on deferred modules that have finished executing since, and hook those
        whose import failed meanwhile."""
        from verl_npu_autopatch._resolution import initializing

        with self._lock:
            ready = [m for m in self._deferred if m in sys.modules and not initializing(sys.modules[m])]
            failed = [m for m in self._deferred if m not in sys.modules]
            self._deferred.difference_update(ready + failed)
        self._hook_later(failed)
        for name in ready:
            self._on_import(sys.modules[name])

    def _on_import(self, module: ModuleType) -> None:
        """wrapt post-import hook: apply every pending patch that targets ``module``."""
        if self._deferred:
            self._catch_up()
        with self._lock:
            patches = [
                slot.patch for slot in self._slots.values() if any(t.module == module.__name__ for t in slot.variants)
            ]
        errors = [error for error in (self._apply(patch, module) for patch in patches) if error is not None]
        if errors:
            raise PatchError("; ".join(str(e) for e in errors)) from errors[0]

    def pending_modules(self) -> list[str]:
        """Modules still awaited by pending patches, in catalogue order (``doctor``)."""
        with self._lock:
            modules = [
                t.module for slot in self._slots.values() if slot.record.state == "pending" for t in slot.variants
            ]
        return list(dict.fromkeys(modules))

    def settle(self, absent: Iterable[str] = ()) -> None:
        """Conclude pending patches once every target that can be imported was (``doctor``):
        ``absent`` names modules that do not exist here; a patch none of whose variants can be
        found any more becomes ``unsupported``."""
        with self._lock:
            self._absent.update(absent)
            pending = [s.patch for s in self._slots.values() if s.record.state == "pending" and s.variants]
        self._catch_up()
        for patch in pending:
            self._apply(patch, None)

    def _apply(self, patch: Patch, module: ModuleType | None) -> Exception | None:
        """Decide and apply one pending patch on a freshly imported module (``None``: from what
        is imported and what ``settle`` knows is absent) and record the outcome. Returns a
        strict-mode error."""
        from verl_npu_autopatch import _pipeline

        config = self._config
        assert config is not None, "hooks are registered only by activate()"
        with self._lock:
            slot = self._slots[patch.name]
            if slot.record.state != "pending" or slot.claimed:
                return None
            slot.claimed = True
            absent = frozenset(self._absent)
        try:
            outcome = _pipeline.run(
                patch, slot.variants, slot.record.versions, module, config, absent=absent, engine=self
            )
            return self._record_outcome(slot, outcome, module, config)
        finally:
            with self._lock:
                slot.claimed = False

    def _record_outcome(
        self, slot: Slot, outcome: Outcome, module: ModuleType | None, config: Config
    ) -> Exception | None:
        """Keep what the pipeline decided in ``slot`` and its record. Returns a strict-mode error."""
        record, state, reason, error = slot.record, outcome.state, outcome.reason, outcome.error
        if outcome.target is not None:
            record.target = str(outcome.target)
        with self._lock:
            slot.rejected = outcome.rejected
            if state == "yielded":
                slot.yielded = outcome.target
            if outcome.undo is not None:
                slot.undo = outcome.undo
        if state == "pending":
            return None  # another variant's module is still to come
        if state == "applied" and outcome.site is not None:
            try:
                self._remember(slot, outcome.site, reason, outcome.undo)
            except Exception as exc:  # as if the fix raised: its undo is kept for revert()
                state, reason, error = "failed", f"fix raised {type(exc).__name__}: {exc}", exc
        self._set(record, state, reason, error)
        if not config.strict:
            return None
        if state == "failed":
            where = outcome.target or (module.__name__ if module else record.name)
            failure = PatchError(f"patch {record.name} on {where}: {reason}")
            failure.__cause__ = error
            return failure
        if state == "unsupported":
            return PatchError(f"patch {record.name} on {record.target}: unsupported: {reason}")
        return None

    # ----------------------------------------------------------------- records
    def _set(self, record: Record, state: str, reason: str, exc: BaseException | None = None) -> None:
        """Record a decision and log it once (``exc``: its traceback goes with the line)."""
        with self._lock:
            record.state, record.reason = state, reason
        _logging.logger().log(_logging.level_of(state), "%s: %s (%s)", record.name, state, reason, exc_info=exc)

    def _record_without_patch(self, name: str, state: str, reason: str, exc: BaseException | None = None) -> None:
        """The record of an entry point that failed to load or was skipped."""
        from verl_npu_autopatch._slots import Slot
        from verl_npu_autopatch.records import Record

        record = Record(name, (), "entry point", versions={})
        self._slots[name] = Slot(None, record)
        self._set(record, state, reason, exc)

    def _record_load_error(self, name: str, error: str, exc: BaseException | None = None) -> None:
        self._record_without_patch(name, "failed", error, exc)

    def _record_skipped(self, name: str) -> None:
        reason = "turned off by VERL_NPU_AUTOPATCH_DISABLE; its module was not imported"
        self._record_without_patch(name, "disabled", reason)

    def check_names(self) -> None:
        """On a host where the engine stayed inactive, warn about ENABLE/DISABLE names that match
        nothing (this loads the catalogue, so it runs only for ``report()`` and ``doctor``)."""
        config = self._config
        if self._checked_names or config is None or not (config.enable or config.disable):
            return
        self._checked_names = True
        try:
            from verl_npu_autopatch import catalog

            found = config.unknown_names(catalog.load(config.disable).names())
        except Exception:
            return
        with self._lock:
            self.warnings += found

    def _flush_warnings(self) -> None:
        if self.warnings:
            logger = _logging.logger()
            for text in dict.fromkeys(self.warnings):
                logger.warning("%s", text)

    # ----------------------------------------------------------------- public helpers
    def report(self) -> Report:
        """A snapshot of the records, each re-verified against the live attribute first."""
        from verl_npu_autopatch.records import Report

        self.verify()
        with self._lock:
            records = [self.record(name) for name in self._slots]
            return Report(self.status, self.reason, self.trigger, self.device, records, list(self.warnings))

    def _matching(self, name: str | None) -> list[Slot]:
        with self._lock:
            slots = list(self._slots.values())
        if name is None:
            return slots
        return [s for s in slots if s.patch is not None and (name == s.record.name or name in s.patch.groups)]

    def revert(self, name: str | None = None) -> list[str]:
        """Undo applied patches (all, one by name, or a group); returns the names reverted.

        Records are re-verified first: a patch another owner displaced (``superseded`` or
        ``yielded``) is left alone, so the live owner is never clobbered; the log says why."""
        self.verify()
        done = []
        for slot in self._matching(name):
            record = slot.record
            with self._lock:
                displaced = ""
                if slot.installed is not None and record.state != "applied":
                    displaced = f"{record.state}: {record.reason}"
                else:
                    undo = slot.release()
            if displaced:
                _logging.logger().info("%s: not reverted, the live target is not ours (%s)", record.name, displaced)
                continue
            if undo is None:
                continue
            try:
                undo()
            except Exception as exc:
                _logging.logger().error("reverting %s failed", record.name, exc_info=True)
                self._set(record, "failed", f"revert raised {type(exc).__name__}: {exc}")
                continue
            self._set(record, "reverted", "reverted by revert()")
            done.append(record.name)
        return done


def _blocked_on_us(activator: int) -> bool:
    """Whether thread ``activator`` waits, through a chain of module locks, for one this thread
    holds (read from the import system's own deadlock bookkeeping, ``_blocking_on``; ``False``
    where it is not there)."""
    try:
        blocking = getattr(sys.modules.get("_frozen_importlib"), "_blocking_on", None)
        me, seen, thread = _thread.get_ident(), set(), activator
        while blocking and thread not in seen:
            seen.add(thread)
            locks = blocking.get(thread)
            if locks is None:
                return False
            owners = [getattr(lock, "owner", None) for lock in (locks if isinstance(locks, list) else [locks])]
            if me in owners:
                return True
            thread = next((owner for owner in owners if owner is not None), None)
        return False
    except Exception:
        return False


# --------------------------------------------------------------------- process-wide engine
#: The process's engine; an ``importlib.reload`` of this module keeps it, records and all.
_ENGINE: Engine = globals().get("_ENGINE") or Engine()


def engine() -> Engine:
    """The process-wide engine that the start-up hook and the vLLM plugin activate."""
    return _ENGINE


def activate(trigger: str = "api") -> None:
    """Activate the process-wide engine (idempotent; the engine removes the start-up observer
    when done). Use it where ``.pth`` files are not processed: ``python -S``, embedded
    interpreters, code on ``PYTHONPATH`` only."""
    _ENGINE.activate(trigger)


def report() -> Report:
    """What the process-wide engine decided so far, patch by patch, with the configuration
    warnings (also on hosts where it stays inactive)."""
    if _ENGINE.status == "not-activated":
        if startup.woken_inert:
            _ENGINE.activate(startup.woken_inert)  # the start-up hook found it inert; say why
        elif not read_config().enabled:
            _ENGINE.activate("report()")  # say that it is switched off
    if _ENGINE.status == "not-activated":
        found = _ENGINE.report()
        found.warnings = list(read_config().warnings)
        return found
    if _ENGINE.status == "inactive":
        _ENGINE.check_names()
    return _ENGINE.report()


def revert(name: str | None = None) -> list[str]:
    """Undo applied patches: all of them, one by name, or a group."""
    return _ENGINE.revert(name)
