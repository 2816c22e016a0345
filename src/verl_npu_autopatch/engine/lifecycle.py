"""The engine's life cycle: activation, hook registration, applying each patch as its target is
imported, and the in-process records (``report``, ``revert``). Its other jobs: ``decision`` (one
patch's decision, from its gates to its fix), ``log``, and the objects it holds, ``slots.Slots``
(the patches' slots), ``hooks.Hooks`` and ``applied.AppliedFixes`` (what was installed:
re-check, hand-over, revert; it acts on the slots); the start-up observer it drives, or a
:class:`NullObserver`.

Imported on a host without the NPU stack (``report()``, ``activate()``, the vLLM plugin),
:func:`activate` decides "inactive" from the configuration alone, without wrapt, ``logging``,
``importlib.metadata`` or ``dataclasses``; everything heavier is imported on the active path only.
"""

from __future__ import annotations

import _thread

from verl_npu_autopatch.bootstrap.startup import OBSERVER
from verl_npu_autopatch.engine import environment, log
from verl_npu_autopatch.engine.applied import AppliedFixes
from verl_npu_autopatch.engine.config import Config, read_config
from verl_npu_autopatch.engine.hooks import Hooks, blocked_on_us, stack_depth
from verl_npu_autopatch.engine.log import LOGGER_NAME
from verl_npu_autopatch.engine.slots import Slot, Slots

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from types import ModuleType

    from verl_npu_autopatch.authoring.handover import HandOver
    from verl_npu_autopatch.authoring.spec import Patch
    from verl_npu_autopatch.bootstrap.startup import Observer
    from verl_npu_autopatch.engine.records import EngineStatus, Record, RecordState, Report


__all__ = ["LOGGER_NAME", "Engine", "NullObserver", "PatchError", "activate", "engine", "report", "revert"]

#: The longest an import in another thread waits for an activation under way: far beyond any
#: real activation (even on an overloaded host), it only turns a wait the import system cannot
#: see into a stall instead of a hang.
_WAIT_LIMIT_S = 300.0


class PatchError(RuntimeError):
    """Raised at a target's import in strict mode; names the patch, the target and the cause."""


class NullObserver:
    """An observer that does nothing: no start-up hook, nothing to guard, never woken inactive. The
    process's observer (``startup.OBSERVER``) is the process-wide engine's alone; every other
    engine (tests, tools) gets this one, so it never touches the process's start-up hook."""

    inactive_trigger = ""

    def hooked(self) -> bool:
        return False

    def guard(self, activator: int, packages: Iterable[str] | None = None) -> None:
        pass

    def retire(self) -> None:
        pass

    def resume_observing(self, hooked: bool) -> None:
        pass


class Engine:
    """Owns one process's patch records. ``activate`` runs once; the rest is driven by imports.

    ``catalog`` and ``config`` default to the built-in catalog (plus entry points) and the environment; tests
    pass their own. ``observer`` is the process's start-up observer, given to the process-wide engine alone (by
    default a :class:`NullObserver`). Each patch has one :class:`~.slots.Slot` in :attr:`slots` (their lock
    also guards the status); its :class:`~.applied.AppliedFixes` is the fixes' ``site.engine`` (:attr:`hand_over`).
    """

    def __init__(
        self,
        catalog: Sequence[Patch] | None = None,
        config: Config | None = None,
        observer: Observer | NullObserver | None = None,
    ) -> None:
        self._catalog = catalog
        self._given_config = config
        self._observer = observer or NullObserver()
        self.slots = Slots(config)
        self._activation_lock = _thread.RLock()
        self.status: EngineStatus = "not-activated"
        self.reason = ""
        self.trigger = ""
        self.device = ""
        self.warnings: list[str] = []
        self._hooks = Hooks(self._on_import, PatchError)
        self._installed = AppliedFixes(self.slots, PatchError)
        self._activator = 0
        self._observed = False  # the start-up hook was on sys.meta_path when activation began
        self._checked_names = False
        self._out_of_stack_at: int | None = None  # the stack depth an activation ran out of stack at

    @property
    def observer(self) -> Observer | NullObserver:
        """The start-up observer this engine drives (a ``NullObserver`` but for the process's)."""
        return self._observer

    def too_deep(self, depth: int | None = None) -> bool:
        """Whether ``depth`` (by default, this call's) is as deep as an activation that ran out of stack."""
        failed_at = self._out_of_stack_at
        return failed_at is not None and (stack_depth() if depth is None else depth) >= failed_at

    @property
    def records(self) -> dict[str, Record]:
        """``{patch name: its live record}``, in catalog order."""
        return self.slots.records()

    # ----------------------------------------------------------------- activation
    def activate(self, trigger: str = "api") -> None:
        """Decide whether to act in this process and, if so, register every patch's hooks.

        Runs once; a concurrent call waits until the first is done, later calls return at once.
        While it runs, the process-wide engine has the start-up observer guard imports (see
        ``bootstrap.activation``), so a target imported meanwhile by another thread waits and
        is patched before its import completes. Never raises, except ``PatchError`` in strict
        mode. Never called with the interpreter's import lock held (the start-up observer
        activates from its loader, not from ``find_spec``). Interrupted (``KeyboardInterrupt``,
        ``SystemExit``: re-raised) or out of stack (``RecursionError``; then tried again only
        from a shallower stack), it goes back to not activated (:meth:`_abandon`)."""
        depth = stack_depth()
        if self.too_deep(depth) or not self._enter():
            return
        observer = self._observer
        try:
            if self.status != "not-activated":
                return
            self.status = "activating"
            self.trigger = trigger
            self._activator = _thread.get_ident()
            self._observed = observer.hooked()
            config = self.slots.config = self.slots.config or read_config()
            self.warnings = list(config.warnings)
            log.configure(config)
            self.device, inactive = environment.device_decision(config)
            if inactive:
                self.status, self.reason = "inactive", inactive
                self._flush_warnings()
                if config.log_level:
                    log.logger().info("engine inactive: %s", inactive)
                observer.retire()
                return
            observer.guard(self._activator)
            try:
                self._activate(config)
            except (PatchError, RecursionError):
                raise  # strict mode; out of stack (below)
            except Exception as exc:  # a bug or a broken install must not break the user's import
                from verl_npu_autopatch.engine.text import describe  # (not on the inactive path)

                self.status, self.reason = "failed", f"activation failed: {describe(exc)}"
                log.logger().error("verl-npu-autopatch %s", self.reason, exc_info=exc)
                if config.strict:
                    raise PatchError(f"verl-npu-autopatch {self.reason} (strict mode)") from exc
            finally:
                observer.retire()
            if config.report_dir:  # VERL_NPU_AUTOPATCH_REPORT_DIR: imported only when asked for
                from verl_npu_autopatch.engine.report_file import attach

                attach(self, config.report_dir)
        except RecursionError:  # a first import deep in the stack, which fits without us: retried shallower
            self._out_of_stack_at = depth
            self._abandon(f"activation ran out of stack ({depth} frames deep); the next watched import activates")
        except BaseException as exc:
            if not isinstance(exc, Exception):  # Ctrl-C during a slow first import: activate again later
                self._abandon(f"activation interrupted ({type(exc).__name__}); the next watched import activates")
            raise
        finally:
            self._activation_lock.release()

    def _abandon(self, why: str = "") -> None:
        """An activation that cannot finish (interrupted, out of stack, or under way in a thread a
        fork left behind): back to ``not-activated`` (resuming, where the start-up hook was in
        place). Live fixes keep their slots; modules imported already are hooked afresh."""
        slots = self.slots
        with slots.lock:
            self.status, self.reason, self.trigger, self.device, self.warnings = "not-activated", why, "", "", []
            for name in [name for name, slot in slots.items() if not slot.live()]:
                del slots[name]
            self._hooks.forget_imported()
            self._activator, self._checked_names, slots.config = 0, False, self._given_config
        self._observer.resume_observing(self._observed)

    def after_fork(self) -> None:
        """In the child of ``os.fork()`` (``activation`` registers the handler): the locks may be
        held by threads not there; an activation under way in one is abandoned, not in this one."""
        if self.status == "activating" and self._activator == _thread.get_ident():
            return
        self._activation_lock = _thread.RLock()
        self.slots.after_fork()
        self._hooks.after_fork()
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
            if blocked_on_us(self._activator):
                return False
        log.logger().warning("waited %g s for the activation in another thread; going on unguarded", _WAIT_LIMIT_S)
        return False

    def _activate(self, config: Config) -> None:
        logger = log.logger()
        import wrapt  # missing or broken: activation fails here, before anything is recorded

        from verl_npu_autopatch.engine import catalog, decision
        from verl_npu_autopatch.engine.records import Record

        problem = environment.wrapt_problem()
        if problem:  # an old wrapt registers hooks that may never fire
            raise RuntimeError(problem)
        logger.debug("wrapt %s from %s", environment.distribution_version("wrapt"), getattr(wrapt, "__file__", "?"))

        given = self._catalog
        loaded = catalog.load_declared(config.disable) if given is None else catalog.Catalog([*given])
        slots, kept = self.slots, dict(self.slots)  # live fixes an interrupted activation left (_abandon)
        slots.clear()
        self.warnings += config.unknown_names(loaded.names())
        self._checked_names = True
        self._flush_warnings()
        for name, error, exc in loaded.errors:
            self._entry_point_record(name, "failed", error, exc)
        for name in loaded.skipped:
            reason = "turned off by VERL_NPU_AUTOPATCH_DISABLE; its module was not imported"
            self._entry_point_record(name, "disabled", reason)
        patches = loaded.patches
        logger.debug("catalog: %d patches, entry points %s", len(patches), ", ".join(loaded.entry_points) or "none")
        unique, duplicates = loaded.unique()
        for text in duplicates:
            self.warnings.append(text)
            logger.warning("%s", text)
        tops = {t.module.partition(".")[0] for p in unique.values() for t in p.hooks}
        self._observer.guard(self._activator, tops)  # from now on guard only the target packages
        findable: dict[str, bool] = {}
        plans = {name: decision.plan(patch, config, findable) for name, patch in unique.items()}
        with slots.lock:
            self.status, self.reason = "active", f"activated by {self.trigger}"
            for name, plan in plans.items():
                patch = unique[name]
                targets = " | ".join(map(str, plan.variants or patch.hooks))
                record = Record(name, patch.groups, targets, "pending", versions=plan.versions)
                slots[name] = kept.get(name) or Slot(patch, record, plan.variants)
            slots.update((name, slot) for name, slot in kept.items() if name not in slots)
            wanted = dict.fromkeys(t.module for slot in slots.values() for t in slot.variants)
        logger.info("engine active (%s); device %s", self.reason, self.device)
        for name, plan in plans.items():
            if name not in kept:
                slots.set_state(slots[name].record, plan.state, plan.reason)
        self._hooks.register(wanted)
        if config.strict and loaded.errors:
            name, error, exc = loaded.errors[0]
            raise PatchError(f"{name}: {error}") from exc

    # ----------------------------------------------------------------- application
    def module_loaded(self, module: ModuleType) -> None:
        """A target module finished executing outside wrapt's view (the package whose import
        activated the engine): apply its pending patches now. Raises only in strict mode."""
        self._hooks.loaded(module.__name__)
        self._hooks.notify(module)

    def module_failed(self, module: ModuleType) -> None:
        """A target module deferred at hook registration raised while executing (its import
        fails, and may be retried): hook its next import, as if it had never been imported."""
        self._hooks.failed(module)

    def _on_import(self, module: ModuleType) -> None:
        """wrapt post-import hook: apply every pending patch that targets ``module``."""
        self._hooks.catch_up()
        errors = self._installed.on_import(module)
        if errors:
            raise PatchError("; ".join(str(e) for e in errors)) from errors[0]

    def pending_modules(self) -> list[str]:
        """Modules still awaited by pending patches, in catalog order (``doctor``)."""
        return self._installed.pending_modules()

    def settle(self, absent: Iterable[str] = ()) -> None:
        """Conclude pending patches once every target that can be imported was (``doctor``): ``absent`` names
        modules that do not exist here; a patch none of whose variants can be found any more becomes ``unsupported``."""
        self._installed.settle(absent, self._hooks.catch_up)

    # ----------------------------------------------------------------- records
    def _entry_point_record(self, name: str, state: RecordState, reason: str, exc: BaseException | None = None) -> None:
        """The record of an entry point that failed to load or was skipped."""
        from verl_npu_autopatch.engine.records import Record

        record = Record(name, (), "entry point", versions={})
        self.slots[name] = Slot(None, record)
        self.slots.set_state(record, state, reason, exc)

    def check_names(self) -> None:
        """On a host where the engine stayed inactive, warn about ENABLE/DISABLE names that match
        nothing (this loads the catalog, so it runs only for ``report()`` and ``doctor``)."""
        config = self.slots.config
        if self._checked_names or config is None or not (config.enable or config.disable):
            return
        self._checked_names = True
        try:
            from verl_npu_autopatch.engine import catalog

            found = config.unknown_names(catalog.load_declared(config.disable).names())
        except Exception as exc:  # a broken catalog fails activation itself; these warnings are extra
            from verl_npu_autopatch.engine.text import describe

            log.logger().debug("checking the ENABLE/DISABLE names raised %s", describe(exc), exc_info=True)
            return
        with self.slots.lock:
            self.warnings += found

    def _flush_warnings(self) -> None:
        for text in dict.fromkeys(self.warnings):
            log.logger().warning("%s", text)

    # ----------------------------------------------------------------- public helpers
    def report(self) -> Report:
        """A snapshot of the records, each re-checked against the live attribute first."""
        from verl_npu_autopatch.engine.records import Report

        self._installed.recheck()
        with self.slots.lock:
            records = [record for name in self.slots if (record := self._installed.record(name)) is not None]
            return Report(self.status, self.reason, self.trigger, self.device, records, list(self.warnings))

    def revert(self, name: str | None = None) -> list[str]:
        """Undo applied patches (all, one by name, or a group; :meth:`~.applied.AppliedFixes.revert`);
        a name of no patch or group reverts nothing and logs one warning with the closest names."""
        if name is not None and (not isinstance(name, str) or name not in (known := self._names())):
            from verl_npu_autopatch.engine.config import closest, shown

            text, hint = (shown(name), closest(name, known)) if isinstance(name, str) else (type(name).__name__, "")
            log.logger().warning("revert(%s): no patch or group has this name; %snothing reverted", text, hint)
            return []
        return self._installed.revert(name)

    def _names(self) -> set[str]:  # the patch and group names revert() knows: this engine's, else the catalog's
        from verl_npu_autopatch.engine import catalog

        with self.slots.lock:
            patches, records = [s.patch for s in self.slots.values() if s.patch is not None], set(self.slots)
        return records | catalog.names_and_groups(patches if records else self._catalog or catalog.declared())

    @property
    def hand_over(self) -> HandOver:
        """What the fixes' ``site.engine`` is: the records, notes, re-applying and yielding of
        patches that arbitrate (:class:`~.applied.AppliedFixes`)."""
        return self._installed


# --------------------------------------------------------------------- process-wide engine
#: The process's engine, kept on its observer (kept by ``sys``: ``startup.ANCHOR``), so a reload or
#: a fresh copy of this module (``mock.patch.dict(sys.modules)``) has the same one, records and all.
#: It alone has the process's observer guard imports while it activates (the composition root).
_ENGINE: Engine = OBSERVER.engine or Engine(observer=OBSERVER)
OBSERVER.engine = _ENGINE


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
        if _ENGINE.observer.inactive_trigger:
            _ENGINE.activate(_ENGINE.observer.inactive_trigger)  # the start-up hook found it inactive; say why
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
