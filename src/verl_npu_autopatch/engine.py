"""Activation, hook registration, guarded application and the in-process records.

The start-up module usually decides "inactive" on a host without the NPU stack before this
module is ever imported. When it is imported there anyway (``report()``, ``activate()``, the vLLM
plugin), :func:`activate` still decides that from the configuration alone, without importing
wrapt, ``logging``, ``importlib.metadata`` or ``dataclasses``; everything heavier is imported on
the active path only.
"""

from __future__ import annotations

import _thread
import sys

from verl_npu_autopatch import _activation, _environment, _gates
from verl_npu_autopatch._config import Config, read_config

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from types import ModuleType
    from typing import Any

    from verl_npu_autopatch.ownership import Installation, ReloadWatcher
    from verl_npu_autopatch.records import Record, Report
    from verl_npu_autopatch.spec import Patch, Site, Target, Undo

LOGGER_NAME = "verl_npu_autopatch"

#: Logging level of each record state (others: INFO, so ``VERL_NPU_AUTOPATCH_LOG=INFO`` shows
#: every decision with its reason).
_LOG_LEVELS = {"failed": 40, "superseded": 30, "unsupported": 30}


#: The longest an import in another thread waits for an activation under way: far beyond any
#: real activation (even on an overloaded host), it only turns a wait the import system cannot
#: see into a stall instead of a hang.
_WAIT_LIMIT_S = 300.0


class PatchError(RuntimeError):
    """Raised at a target's import in strict mode; names the patch, the target and the cause."""


class Engine:
    """Owns one process's patch records. ``activate`` runs once; the rest is driven by imports.

    ``catalogue`` and ``config`` default to the built-in catalogue (plus entry points) and the
    environment; tests pass their own.
    """

    def __init__(self, catalogue: Sequence[Patch] | None = None, config: Config | None = None) -> None:
        self._catalogue = catalogue
        self._config = config
        self._lock = _thread.RLock()  # records and claims; held only briefly, never across imports
        self._activation_lock = _thread.RLock()
        self.status = "not-activated"
        self.reason = ""
        self.trigger = ""
        self.device = ""
        self.warnings: list[str] = []
        self.patches: dict[str, Patch] = {}
        self.records: dict[str, Record] = {}
        self._variants: dict[str, tuple[Target, ...]] = {}
        self._undo: dict[str, Undo] = {}
        self._installed: dict[str, Installation] = {}  # applied patch -> where it installed what
        self._yields: dict[str, Target] = {}  # patch yielded at apply time -> the target it left alone
        self._watcher: ReloadWatcher | None = None
        self._claimed: set[str] = set()
        self._hooked: set[str] = set()
        self._absent: set[str] = set()
        self._deferred: set[str] = set()
        self._closed = False
        self._activator = 0
        self._checked_names = False

    # ----------------------------------------------------------------- activation
    def activate(self, trigger: str = "api") -> None:
        """Decide whether to act in this process and, if so, register every patch's hooks.

        Runs once; a concurrent call waits until the first is done, later calls return at once.
        While it runs, the process-wide engine has the start-up observer guard imports (see
        ``_activation.guard``), so a target imported meanwhile by another thread waits and
        is patched before its import completes. Never raises, except ``PatchError`` in strict
        mode. Never called with the interpreter's import lock held (the start-up observer
        activates from its loader, not from ``find_spec``).
        """
        if not self._enter():
            return
        try:
            if self.status != "not-activated":
                return
            self.status = "activating"
            self.trigger = trigger
            self._activator = _thread.get_ident()
            config = self._config = self._config or read_config()
            self.warnings = list(config.warnings)
            self._configure_logging(config)
            self.device, inert = _environment.device_decision(config)
            if inert:
                self.status, self.reason = "inactive", inert
                self._flush_warnings()
                if config.log_level:
                    self._logger().info("engine inactive: %s", inert)
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
                self._logger().error("verl-npu-autopatch %s", self.reason, exc_info=exc)
                if config.strict:
                    raise PatchError(f"verl-npu-autopatch {self.reason} (strict mode)") from exc
            finally:
                if self is _ENGINE:
                    _activation.stop_observing()
        finally:
            self._activation_lock.release()

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
        self._logger().warning("waited %g s for the activation in another thread; going on unguarded", _WAIT_LIMIT_S)
        return False

    def _configure_logging(self, config: Config) -> None:
        """``VERL_NPU_AUTOPATCH_LOG``: set our logger's level and, when neither it nor the root
        logger has a handler, log to stderr with a ``verl-npu-autopatch:`` prefix."""
        if not config.log_level:
            return
        import logging

        logger = self._logger()
        logger.setLevel(config.log_level)
        if not logger.handlers and not logging.getLogger().handlers:
            logger.addHandler(_stderr_handler())

    def _activate(self, config: Config) -> None:
        logger = self._logger()
        import wrapt  # missing or broken: activation fails here, before anything is recorded

        from verl_npu_autopatch import catalog
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
            tops = {t.module.partition(".")[0] for p in unique.values() for t in p.targets}
            _activation.guard(self._activator, tops)
        plans = {name: _gates.plan(patch, config) for name, patch in unique.items()}
        with self._lock:
            self.status, self.reason = "active", f"activated by {self.trigger}"
            for name, plan in plans.items():
                self.patches[name] = unique[name]
                targets = plan.variants or unique[name].targets
                self.records[name] = Record(name, unique[name].groups, " | ".join(map(str, targets)), "pending")
                self.records[name].versions = plan.versions
                if plan.variants:
                    self._variants[name] = plan.variants
        logger.info("engine active (%s); device %s", self.reason, self.device)
        for name, plan in plans.items():
            self._set(self.records[name], plan.state, plan.reason)
        self._register_hooks()
        if config.strict and loaded.errors:
            name, error, exc = loaded.errors[0]
            raise PatchError(f"{name}: {error}") from exc

    def _register_hooks(self) -> None:
        """One wrapt post-import hook per target module. A module already imported is handled at
        once; one still executing (another thread's, or the package whose import woke us) is
        handled when it finishes: see :meth:`module_loaded` and :meth:`_catch_up`."""
        import wrapt

        with self._lock:
            wanted = dict.fromkeys(t.module for variants in self._variants.values() for t in variants)
            modules = [module for module in wanted if module not in self._hooked]
            self._hooked.update(modules)
        errors = []
        for module in modules:
            if _initializing(sys.modules.get(module)):
                with self._lock:
                    self._deferred.add(module)
                continue
            self._logger().debug("post-import hook on %s", module)
            try:
                wrapt.register_post_import_hook(self._on_import, module)
            except PatchError as error:
                errors.append(error)
        if errors:
            raise errors[0]

    # ----------------------------------------------------------------- application
    def module_loaded(self, module: ModuleType) -> None:
        """A target module finished executing outside wrapt's view (the package whose import
        activated the engine): apply its pending patches now. Raises only in strict mode."""
        with self._lock:
            self._deferred.discard(module.__name__)
        self._on_import(module)

    def _catch_up(self) -> None:
        """Apply patches on deferred modules that have finished executing since."""
        with self._lock:
            ready = [m for m in self._deferred if m in sys.modules and not _initializing(sys.modules[m])]
            self._deferred.difference_update(ready)
        for name in ready:
            self._on_import(sys.modules[name])

    def _on_import(self, module: ModuleType) -> None:
        """wrapt post-import hook: apply every pending patch that targets ``module``."""
        if self._closed:
            return
        if self._deferred:
            self._catch_up()
        errors = []
        for name in [
            n for n, variants in list(self._variants.items()) if any(t.module == module.__name__ for t in variants)
        ]:
            error = self._apply(self.patches[name], module)
            if error is not None:
                errors.append(error)
        if errors:
            raise PatchError("; ".join(str(e) for e in errors)) from errors[0]

    def pending_modules(self) -> list[str]:
        """Modules still awaited by pending patches, in catalogue order."""
        with self._lock:
            modules = [
                t.module
                for name, record in self.records.items()
                if record.state == "pending"
                for t in self._variants.get(name, ())
            ]
        return list(dict.fromkeys(modules))

    def settle(self, absent: Iterable[str] = ()) -> None:
        """Conclude pending patches once every target that can be imported was (``doctor``):
        ``absent`` names modules that do not exist here; a patch none of whose variants can be
        found any more becomes ``unsupported``."""
        with self._lock:
            self._absent.update(absent)
            pending = [n for n, r in self.records.items() if r.state == "pending" and n in self._variants]
        self._catch_up()
        for name in pending:
            self._apply(self.patches[name], None)

    def _apply(self, patch: Patch, module: ModuleType | None) -> Exception | None:
        """Gate, check and fix one patch on a freshly imported module. Returns a strict-mode error."""
        with self._lock:
            record = self.records[patch.name]
            if record.state != "pending" or patch.name in self._claimed:
                return None
            self._claimed.add(patch.name)
        try:
            return self._apply_claimed(patch, record, module)
        finally:
            with self._lock:
                self._claimed.discard(patch.name)

    def _apply_claimed(self, patch: Patch, record: Record, module: ModuleType | None) -> Exception | None:
        config = self._config
        assert config is not None, "hooks are registered only by activate()"
        stage, target = "resolve", None
        rejected: dict[Target, str] = {}  # variants present whose check said unsupported
        try:
            while True:  # variant by variant: an unsupported variant hands over to the next one present
                stage = "resolve"
                site, missing = self._resolve(patch, record, module, rejected)
                if site is None:
                    if missing is None:
                        return None  # another variant's module is still to come
                    return self._finish(record, "unsupported", missing, config, patch)
                target = site.target
                record.target = str(target)
                stage = "gate"
                if patch.device == "npu-device" and config.device != "npu" and not _environment.npu_device_visible():
                    return self._finish(record, "gated", "needs a visible NPU device", config, patch)
                from verl_npu_autopatch import ownership
                from verl_npu_autopatch.patching import describe, marked_by

                owner = ownership.detect(patch, site)
                yielded = f"target owned by {owner}" if owner else ownership.enclosing_owner(patch, site)
                if yielded:
                    with self._lock:
                        self._yields[patch.name] = target
                    return self._finish(record, "yielded", yielded, config, patch)
                if marked_by(site.value) == patch.name:
                    reason = f"already in place ({describe(site.value)})"
                    self._remember(site, reason)
                    return self._finish(record, "applied", reason, config, patch)
                stage = "check"
                verdict = patch.check(site) if patch.check is not None else None
                if verdict is not None and verdict.action == "unsupported":
                    rejected[target] = verdict.reason
                    continue
                if verdict is not None and verdict.action != "apply":
                    return self._finish(record, verdict.action, verdict.reason, config, patch)
                stage = "fix"
                undo = patch.fix(site)
                with self._lock:
                    self._undo[patch.name] = undo
                applied = _installed_reason(self._variants[patch.name], target, rejected)
                if verdict is not None and verdict.reason:  # e.g. which other owner's callable the fix replaces
                    applied = f"{applied}; {verdict.reason}"
                self._remember(site, applied, undo)
                return self._finish(record, "applied", applied, config, patch)
        except Exception as exc:
            where = target or (module.__name__ if module else patch.name)
            reason = f"{stage} raised {type(exc).__name__}: {exc}"
            self._set(record, "failed", reason, exc)
            if config.strict:
                error = PatchError(f"patch {patch.name} on {where}: {reason}")
                error.__cause__ = exc
                return error
            return None

    def _resolve(
        self, patch: Patch, record: Record, module: ModuleType | None, rejected: dict[Target, str]
    ) -> tuple[Site | None, str | None]:
        """The first variant found in the live modules and not ``rejected`` by its check, or
        ``(None, why-unsupported)`` once every variant was imported without it or rejected, or
        ``(None, None)`` while some are still to come."""
        from verl_npu_autopatch import ownership
        from verl_npu_autopatch.spec import Site

        missing, waiting = [], False
        for target in self._variants[patch.name]:
            if target in rejected:
                continue
            live = sys.modules.get(target.module)
            if module is not None and target.module == module.__name__:
                live = module
            if live is None:
                if target.module in self._absent or _known_absent(target.module):
                    missing.append(f"{target} (module {target.module} does not exist)")
                else:
                    waiting = True
                continue
            parts = target.qualname.split(".")
            found = ownership.lookup(live, target.qualname)
            if found is None:
                missing.append(f"{target} ({_describe_missing(live, parts)})")
                continue
            owner, value = found
            return Site(patch, target, live, owner, parts[-1], value, dict(record.versions), self), None
        if waiting:
            return None, None
        if not missing:  # every variant present was rejected: their checks say why
            return None, " | ".join(rejected.values())
        why = "expected " + " or ".join(str(t) for t in self._variants[patch.name]) + "; found " + "; ".join(missing)
        return None, " | ".join([*rejected.values(), why])

    def _finish(self, record: Record, state: str, reason: str, config: Config, patch: Patch) -> Exception | None:
        self._set(record, state, reason)
        if config.strict and state == "unsupported":
            return PatchError(f"patch {patch.name} on {record.target}: unsupported: {reason}")
        return None

    # ----------------------------------------------------------------- ownership
    def _remember(self, site: Site, reason: str, undo: Undo | None = None) -> None:
        """Note where ``site.patch`` installed what, and watch its module for reloads."""
        from verl_npu_autopatch import ownership

        installed = ownership.installation(site, reason, undo)
        with self._lock:
            self._installed[site.patch.name] = installed
            if self._closed:
                return
            if self._watcher is None:
                self._watcher = ownership.ReloadWatcher(self._watches, self._on_reload)
            watcher = self._watcher
        watcher.install()

    def verify(self) -> None:
        """Re-check every applied (or displaced) patch against the live attribute and move its
        record to ``applied``, ``yielded`` or ``superseded`` accordingly. Never raises."""
        from verl_npu_autopatch import ownership

        with self._lock:
            installed = list(self._installed.items())
        for name, where in installed:
            record = self.records[name]
            try:
                state, reason = ownership.verify(self.patches[name], record.versions, where, self)
            except Exception as exc:  # a detector bug must not break report()
                self._logger().debug("verifying %s raised %r", name, exc, exc_info=True)
                continue
            with self._lock:
                if self._installed.get(name) is not where or record.state not in ownership.VERIFIED_STATES:
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
            yields = list(self._yields.items())
        for name, target in yields:
            record = self.records[name]
            try:
                reason = ownership.yielded_reason(self.patches[name], target, record.versions, self)
            except Exception as exc:  # a detector bug must not break report()
                self._logger().debug("verifying %s raised %r", name, exc, exc_info=True)
                continue
            with self._lock:
                if record.state != "yielded":
                    self._yields.pop(name, None)
                    continue
                changed = reason is not None and reason != record.reason
            if changed:
                self._set(record, "yielded", reason)

    def _watches(self, module: str) -> bool:
        """Whether a reload of ``module`` concerns an applied or displaced patch."""
        with self._lock:
            return not self._closed and any(w.target.module == module for w in self._installed.values())

    def _on_reload(self, module: ModuleType) -> None:
        """``importlib.reload`` re-executed ``module``: its targets hold upstream code again, so
        every patch applied (or displaced) there is decided and applied afresh."""
        from verl_npu_autopatch import ownership

        with self._lock:
            if self._closed:
                return
            names = [
                name
                for name, where in self._installed.items()
                if where.target.module == module.__name__ and self.records[name].state in ownership.VERIFIED_STATES
            ]
            for name in names:
                del self._installed[name]
                self._undo.pop(name, None)  # it acts on the classes the reload replaced
                self.records[name].state = "pending"
        for name in names:
            try:
                self._apply(self.patches[name], module)
            except Exception:  # _apply records failures itself; this is a last guard for reload
                self._logger().debug("re-applying %s after reload raised", name, exc_info=True)
            record = self.records[name]
            with self._lock:
                where = self._installed.get(name) if record.state == "applied" else None
                if where is not None:
                    where.reason = f"{where.reason}; again after importlib.reload"
            if where is not None:
                self._set(record, "applied", where.reason)

    # ----------------------------------------------------------------- records
    def _set(self, record: Record, state: str, reason: str, exc: BaseException | None = None) -> None:
        """Record a decision and log it once (``exc``: its traceback goes with the line)."""
        with self._lock:
            record.state, record.reason = state, reason
        self._logger().log(_LOG_LEVELS.get(state, 20), "%s: %s (%s)", record.name, state, reason, exc_info=exc)

    def _record_load_error(self, name: str, error: str, exc: BaseException | None = None) -> None:
        from verl_npu_autopatch.records import Record

        record = self.records[name] = Record(name, (), "entry point", versions={})
        self._set(record, "failed", error, exc)

    def _record_skipped(self, name: str) -> None:
        from verl_npu_autopatch.records import Record

        record = self.records[name] = Record(name, (), "entry point", versions={})
        self._set(record, "disabled", "turned off by VERL_NPU_AUTOPATCH_DISABLE; its module was not imported")

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
            logger = self._logger()
            for text in dict.fromkeys(self.warnings):
                logger.warning("%s", text)

    @staticmethod
    def _logger():
        import logging

        return logging.getLogger(LOGGER_NAME)

    # ----------------------------------------------------------------- public helpers
    def report(self) -> Report:
        """A snapshot of the records, each re-verified against the live attribute first."""
        from verl_npu_autopatch.records import Record, Report

        self.verify()
        with self._lock:
            records = [Record(**{**r.__dict__, "versions": dict(r.versions)}) for r in self.records.values()]
            return Report(self.status, self.reason, self.trigger, self.device, records, list(self.warnings))

    def _matching(self, name: str | None) -> list[str]:
        if name is None:
            return list(self.records)
        return [n for n, p in self.patches.items() if name == n or name in p.groups]

    def revert(self, name: str | None = None) -> list[str]:
        """Undo applied patches (all, one by name, or a group); returns the names reverted.

        Records are re-verified first: a patch another owner displaced (``superseded`` or
        ``yielded``) is left alone, so the live owner is never clobbered; the log says why."""
        self.verify()
        done = []
        for patch_name in self._matching(name):
            record = self.records[patch_name]
            with self._lock:
                if patch_name in self._installed and record.state != "applied":
                    displaced = f"{record.state}: {record.reason}"
                else:
                    displaced = ""
                    undo = self._undo.pop(patch_name, None)
                    self._installed.pop(patch_name, None)
            if displaced:
                self._logger().info("%s: not reverted, the live target is not ours (%s)", patch_name, displaced)
                continue
            if undo is None:
                continue
            try:
                undo()
            except Exception as exc:
                self._logger().error("reverting %s failed", patch_name, exc_info=True)
                self._set(record, "failed", f"revert raised {type(exc).__name__}: {exc}")
                continue
            self._set(record, "reverted", "reverted by revert()")
            done.append(patch_name)
        return done

    def close(self, reason: str = "engine closed") -> None:
        """Stop acting: patches still pending become ``disabled`` and later imports are ignored
        (wrapt hooks cannot be unregistered). Applied patches stay; ``revert()`` undoes them."""
        with self._lock:
            self._closed = True
            pending = [r for r in self.records.values() if r.state == "pending"]
            watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.remove()
        for record in pending:
            self._set(record, "disabled", reason)

    def note(self, name: str, text: str) -> None:
        """Add ``text`` to the reason of patch ``name`` while it is applied (e.g. why a target
        stays ours beside Liger-Kernel); kept when the record is re-verified."""
        with self._lock:
            record = self.records.get(name)
            if record is None or record.state != "applied" or text in record.reason:
                return
            reason = f"{record.reason}; {text}"
            where = self._installed.get(name)
            if where is not None:
                where.reason = reason
        self._set(record, "applied", reason)

    def reapply(self, name: str, when: Callable[[Any], bool]) -> bool:
        """Decide and apply patch ``name`` afresh when ``when(live value)`` holds for what another
        owner put over our installed value (verl <= 0.8 patching while its module is imported,
        after our hooks ran). The old undo is dropped (it acts only while our value is live);
        the new one restores that other owner's value. Returns whether ``name`` is applied now."""
        from verl_npu_autopatch import ownership

        with self._lock:
            where, record = self._installed.get(name), self.records.get(name)
            if where is None or record is None or self._closed or where.untouched:
                return False
            found = ownership.lookup(where.module, where.target.qualname)
            if found is None or found[1] is where.value or not when(found[1]):
                return False
            del self._installed[name]
            self._undo.pop(name, None)
            record.state = "pending"
        self._apply(self.patches[name], where.module)
        return self.records[name].state == "applied"

    def yield_to(self, name: str, owner: str) -> bool:
        """Hand patch ``name``'s target to ``owner``: undo it if applied, record ``yielded``.

        Returns whether the patch was applied before. Used for arbitration with e.g. Liger-Kernel.
        """
        with self._lock:
            record = self.records.get(name)
            if record is None or record.state not in ("pending", "applied"):
                return False
            undo = self._undo.pop(name, None)
            self._installed.pop(name, None)
        if undo is not None:
            undo()
        self._set(record, "yielded", f"target handed to {owner}")
        return undo is not None


def _stderr_handler() -> object:
    """A stderr handler with a ``verl-npu-autopatch:`` prefix that steps aside once the
    application configures the root logger (whose handlers then show our records)."""
    import logging

    class StderrHandler(logging.StreamHandler):
        def emit(self, record: logging.LogRecord) -> None:
            if not logging.getLogger().handlers:
                super().emit(record)

    handler = StderrHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("verl-npu-autopatch: %(levelname)s: %(message)s"))
    return handler


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


def _installed_reason(variants: tuple[Target, ...], target: Target, rejected: dict[Target, str]) -> str:
    """``fix installed``; after a passed-over variant, also which variant and why the others were
    passed over (the record's ``target`` always names the variant applied)."""
    if not rejected:
        return "fix installed"
    position = f"variant {variants.index(target) + 1} of {len(variants)}"
    return f"fix installed on {position} ({target}); passed over: " + " | ".join(rejected.values())


def _initializing(module: ModuleType | None) -> bool:
    """Whether ``module`` is in ``sys.modules`` but still executing."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _known_absent(module: str) -> bool:
    """Whether submodule ``module`` cannot exist: its parent package finished importing and has
    no such submodule (asking the finders executes nothing)."""
    parent = module.rpartition(".")[0]
    package = sys.modules.get(parent) if parent else None
    if package is None or _initializing(package):
        return False
    try:
        import importlib.util

        return importlib.util.find_spec(module) is None
    except Exception:
        return False


def _describe_missing(module: ModuleType, parts: list[str]) -> str:
    owner: object = module
    for depth, part in enumerate(parts):
        if not hasattr(owner, part):
            where = ".".join(parts[:depth]) or module.__name__
            kind = type(owner).__name__
            return f"{where} ({kind}) has no attribute {part!r}"
        owner = getattr(owner, part)
    return "attribute is None"


# --------------------------------------------------------------------- process-wide engine
_ENGINE = Engine()


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
        if _activation.woken_inert:
            _ENGINE.activate(_activation.woken_inert)  # the start-up hook found it inert; say why
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
