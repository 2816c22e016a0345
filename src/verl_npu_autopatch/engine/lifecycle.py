"""The engine's life cycle: activation, one wrapt post-import hook per target module, ``report``
and ``revert``; ``slots.Slots`` applies and keeps each patch. On a host without the NPU stack,
:func:`activate` decides "inactive" from the configuration alone, without wrapt, ``logging``,
``importlib.metadata`` or ``dataclasses``; anything heavier is imported on the active path only."""

from __future__ import annotations

import _thread
import sys

from verl_npu_autopatch.bootstrap.startup import OBSERVER
from verl_npu_autopatch.engine import environment, log
from verl_npu_autopatch.engine.config import Config, read_config
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

#: The longest an import waits for another thread's activation: a stall instead of a hang.
_WAIT_LIMIT_S = 300.0


class PatchError(RuntimeError):
    """Raised at a target's import in strict mode; names the patch, the target and the cause."""


class NullObserver:
    """The observer of every engine but the process-wide one: only that one touches the start-up hook."""

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
    """Owns one process's patch records; ``activate`` runs once, the rest is driven by imports.
    ``catalog`` and ``config`` default to the built-in catalog (plus entry points) and the
    environment. :attr:`slots` holds each patch's slot (their lock also guards the status and the
    hooked modules) and is the fixes' ``site.handover``."""

    def __init__(
        self,
        catalog: Sequence[Patch] | None = None,
        config: Config | None = None,
        observer: Observer | NullObserver | None = None,
    ) -> None:
        self._catalog = catalog
        self._given_config = config
        self.observer = observer or NullObserver()
        self.slots = Slots(config, PatchError)
        self._activation_lock = _thread.RLock()
        self.status: EngineStatus = "not-activated"
        self.reason = self.trigger = self.device = ""
        self.warnings: list[str] = []
        self._hooked: set[str] = set()  # modules with a post-import hook
        self._deferred: set[str] = set()  # modules still executing when their hook was due
        self._activator = 0
        self._observed = False  # the start-up hook was on sys.meta_path when activation began
        self._checked_names = False
        self._out_of_stack_at: int | None = None  # the stack depth an activation ran out of stack at

    def too_deep(self, depth: int | None = None) -> bool:
        """Whether ``depth`` (by default, this call's) is as deep as an activation that ran out of stack."""
        failed_at = self._out_of_stack_at
        return failed_at is not None and (stack_depth() if depth is None else depth) >= failed_at

    @property
    def records(self) -> dict[str, Record]:
        """``{patch name: its live record}``, in catalog order."""
        with self.slots.lock:
            return {name: slot.record for name, slot in self.slots.items()}

    @property
    def hand_over(self) -> HandOver:
        """What the fixes' ``site.handover`` is: records, notes, re-applying and yielding."""
        return self.slots

    # ----------------------------------------------------------------- activation
    def activate(self, trigger: str = "api") -> None:
        """Decide whether to act in this process and, if so, register every patch's hooks. Runs once
        (a concurrent call waits: :meth:`_enter`); meanwhile the observer guards other threads'
        imports. Never raises but ``PatchError`` in strict mode. Interrupted (re-raised) or out of
        stack (tried again only from a shallower one), it goes back to not activated (:meth:`_abandon`)."""
        depth, known = stack_depth(), len(sys.modules)
        if self.too_deep(depth) or not self._enter():
            return
        observer = self.observer
        try:
            if self.status != "not-activated":
                return
            self.status, self.trigger, self._activator = "activating", trigger, _thread.get_ident()
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
            drop_orphans(known)
            self._abandon(f"activation ran out of stack ({depth} frames deep); the next watched import activates")
        except BaseException as exc:
            if not isinstance(exc, Exception):  # Ctrl-C during a slow first import: activate again later
                self._abandon(f"activation interrupted ({type(exc).__name__}); the next watched import activates")
            raise
        finally:
            self._activation_lock.release()

    def _abandon(self, why: str = "") -> None:
        """Back to ``not-activated`` from an activation that cannot finish (interrupted, out of stack, or
        in a thread a fork left behind). Live fixes keep their slots; modules imported are hooked afresh."""
        slots = self.slots
        with slots.lock:
            self.status, self.reason, self.trigger, self.device, self.warnings = "not-activated", why, "", "", []
            for name in [name for name, slot in slots.items() if not slot.live()]:
                del slots[name]
            self._hooked -= self._deferred | {name for name in self._hooked if name in sys.modules}
            self._deferred.clear()
            self._activator, self._checked_names, slots.config = 0, False, self._given_config
        self.observer.resume_observing(self._observed)

    def after_fork(self) -> None:
        """In a fork's child: the locks may be held by threads not there; their activation is abandoned."""
        if self.status == "activating" and self._activator == _thread.get_ident():
            return
        self._activation_lock = _thread.RLock()
        self.slots.after_fork()
        if self.status == "activating":
            self._abandon()

    def _enter(self) -> bool:
        """Take the activation lock; give up if its holder waits for a module this thread imports
        (a deadlock), or after ``_WAIT_LIMIT_S`` (a wait the import system cannot see): a stall, never a hang."""
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
        slots = self.slots
        with slots.lock:
            kept = dict(slots)  # live fixes an interrupted activation left (_abandon)
            slots.clear()
        self.warnings += config.unknown_names(loaded.names())
        self._checked_names = True
        self._flush_warnings()
        for name, error, exc in loaded.errors:
            self._entry_point_record(name, "failed", error, exc)
        for name in loaded.skipped:
            reason = "turned off by VERL_NPU_AUTOPATCH_DISABLE; its module was not imported"
            self._entry_point_record(name, "disabled", reason)
        entry_points = ", ".join(loaded.entry_points) or "none"
        logger.debug("catalog: %d patches, entry points %s", len(loaded.patches), entry_points)
        unique, duplicates = loaded.unique()
        for text in duplicates:
            self.warnings.append(text)
            logger.warning("%s", text)
        tops = {t.module.partition(".")[0] for p in unique.values() for t in p.hooks}
        self.observer.guard(self._activator, tops)  # from now on guard only the target packages
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
        self._register(wanted)
        if config.strict and loaded.errors:
            name, error, exc = loaded.errors[0]
            raise PatchError(f"{name}: {error}") from exc

    # ----------------------------------------------------------------- post-import hooks
    def _register(self, wanted: Iterable[str]) -> None:
        """A wrapt hook on each module of ``wanted`` not hooked yet; one already imported is handled at
        once (strict-mode errors raised once all are hooked), one still executing is deferred."""
        import wrapt

        from verl_npu_autopatch.engine.decision import initializing

        with self.slots.lock:
            modules = [module for module in wanted if module not in self._hooked]
        errors = []
        for module in modules:
            if initializing(sys.modules.get(module)):
                with self.slots.lock:
                    self._deferred.add(module)
                    self._hooked.add(module)
                continue
            log.logger().debug("post-import hook on %s", module)
            try:
                wrapt.register_post_import_hook(self._on_import, module)
            except PatchError as error:
                errors.append(error)
            except Exception:  # another's object at that name in sys.modules (a proxy): its patches' records say why
                log.logger().debug("%s in sys.modules cannot be patched", module, exc_info=True)
            with self.slots.lock:  # one by one: an interrupted activation registers the rest later
                self._hooked.add(module)
        if errors:
            raise errors[0]

    def _on_import(self, module: ModuleType) -> None:
        """The post-import hook. Interrupted (Ctrl-C), the import under way fails: its retry is hooked."""
        try:
            self._catch_up()
            errors = self.slots.on_import(module)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # Ctrl-C, SystemExit
                from verl_npu_autopatch.engine.decision import initializing

                name = getattr(module, "__name__", "")
                if name and initializing(sys.modules.get(name)):
                    with self.slots.lock:
                        self._deferred.discard(name)
                        self._hooked.add(name)
                    self._hook_again(name, sys.modules[name])
            raise
        if errors:
            raise PatchError("; ".join(str(e) for e in errors)) from errors[0]

    def module_loaded(self, module: ModuleType) -> None:
        """A module finished executing outside wrapt's view (the package whose import activated the engine)."""
        with self.slots.lock:
            self._deferred.discard(module.__name__)
        self._on_import(module)

    def module_failed(self, module: ModuleType) -> None:
        """A deferred module raised while executing: hook its next import, as if it had never been imported."""
        name = module.__name__
        with self.slots.lock:
            if name not in self._deferred:
                return
            self._deferred.discard(name)
        self._hook_again(name, module)

    def _hook_again(self, name: str, module: object = None) -> None:
        """Hook the next import of ``name``, whose import failed."""
        import wrapt

        if module is not None and sys.modules.get(name) is module:
            del sys.modules[name]  # as the import system does next; wrapt hooks only what is not loaded
        log.logger().debug("post-import hook on %s (its import failed)", name)
        wrapt.register_post_import_hook(self._on_import, name)

    def _catch_up(self) -> None:
        """Handle the deferred modules that finished executing since; hook those whose import failed."""
        if not self._deferred:
            return
        from verl_npu_autopatch.engine.decision import initializing

        with self.slots.lock:
            ready = [m for m in self._deferred if m in sys.modules and not initializing(sys.modules[m])]
            failed = [m for m in self._deferred if m not in sys.modules]
            self._deferred.difference_update(ready + failed)
        for name in failed:
            self._hook_again(name)
        for name in ready:
            self._on_import(sys.modules[name])

    def pending_modules(self) -> list[str]:
        """Modules still awaited by pending patches, in catalog order (``doctor``)."""
        return self.slots.pending_modules()

    def settle(self, absent: Iterable[str] = ()) -> None:
        """Conclude pending patches once every target that can be imported was (``doctor``); ``absent``:
        modules that do not exist here."""
        self.slots.settle(absent, self._catch_up)

    # ----------------------------------------------------------------- records
    def _entry_point_record(self, name: str, state: RecordState, reason: str, exc: BaseException | None = None) -> None:
        """The record of an entry point that failed to load or was skipped."""
        from verl_npu_autopatch.engine.records import Record

        record = Record(name, (), "entry point", versions={})
        with self.slots.lock:
            self.slots[name] = Slot(None, record)
        self.slots.set_state(record, state, reason, exc)

    def check_names(self) -> None:
        """Inactive: warn about ENABLE/DISABLE names that match nothing (loads the catalog: ``report()`` only)."""
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

    def report(self) -> Report:
        """A snapshot of the records, each re-checked against the live attribute first."""
        from verl_npu_autopatch.engine.records import Report

        self.slots.recheck()
        with self.slots.lock:
            records = [slot.record.copy() for slot in self.slots.values()]
            return Report(self.status, self.reason, self.trigger, self.device, records, list(self.warnings))

    def revert(self, name: str | None = None) -> list[str]:
        """:meth:`~.slots.Slots.revert`; a name of no patch or group logs a warning with the closest names."""
        if name is not None and (not isinstance(name, str) or name not in (known := self._names())):
            from verl_npu_autopatch.engine.config import closest, shown

            text, hint = (shown(name), closest(name, known)) if isinstance(name, str) else (type(name).__name__, "")
            log.logger().warning("revert(%s): no patch or group has this name; %snothing reverted", text, hint)
            return []
        return self.slots.revert(name)

    def _names(self) -> set[str]:  # the patch and group names revert() knows: this engine's, else the catalog's
        from verl_npu_autopatch.engine import catalog

        with self.slots.lock:
            patches, records = [s.patch for s in self.slots.values() if s.patch is not None], set(self.slots)
        return records | catalog.names_and_groups(patches if records else self._catalog or catalog.declared())


def blocked_on_us(activator: int) -> bool:
    """Whether thread ``activator`` waits, through a chain of module locks, for one this thread holds
    (the import system's ``_blocking_on``): an import held for the activation must then go on."""
    try:
        blocking = getattr(sys.modules.get("_frozen_importlib"), "_blocking_on", None)
        me, seen = _thread.get_ident(), set()
        thread: int | None = activator
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
    except Exception:  # private CPython bookkeeping whose shape may change: then no deadlock is seen
        return False


def drop_orphans(known: int) -> None:
    """Forget each module imported since ``sys.modules`` held ``known`` entries whose package is gone:
    an import the stack ran out in left them behind, and the package's next import would not bind
    them (wrapt imports asyncio: the user's ``import asyncio`` raised ``NameError``)."""
    for name in list(sys.modules)[known:]:
        parts = str(name).split(".")  # another's key may be no string
        if any(".".join(parts[:end]) not in sys.modules for end in range(1, len(parts))):
            sys.modules.pop(name, None)


def stack_depth() -> int:
    """How many frames deep the caller is (an activation that ran out of stack is retried only from a shallower one)."""
    frame, depth = sys._getframe(1), 1
    while frame.f_back is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


# --------------------------------------------------------------------- process-wide engine
#: The process's engine, kept on its observer (kept by ``sys``: ``startup.ANCHOR``), so a reload or
#: a fresh copy of this module (``mock.patch.dict(sys.modules)``) has the same one, records and all.
_ENGINE: Engine = OBSERVER.engine or Engine(observer=OBSERVER)
OBSERVER.engine = _ENGINE


def engine() -> Engine:
    """The process-wide engine that the start-up hook and the vLLM plugin activate."""
    return _ENGINE


def activate(trigger: str = "api") -> None:
    """Activate the process-wide engine (idempotent), e.g. where ``.pth`` files are not processed."""
    _ENGINE.activate(trigger)


def report() -> Report:
    """What the process-wide engine decided so far, with the configuration warnings (also inactive)."""
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
