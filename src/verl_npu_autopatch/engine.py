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

import verl_npu_autopatch
from verl_npu_autopatch import gates, probes
from verl_npu_autopatch.config import Config, read_config

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from types import ModuleType

    from verl_npu_autopatch.records import Record, Report
    from verl_npu_autopatch.spec import Patch, Site, Target, Undo

LOGGER_NAME = "verl_npu_autopatch"

#: Logging level of each record state (others: DEBUG).
_LOG_LEVELS = {"failed": 40, "unsupported": 30, "applied": 20, "fixed-upstream": 20, "yielded": 20, "reverted": 20}


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
        self._claimed: set[str] = set()
        self._hooked: set[str] = set()
        self._absent: set[str] = set()
        self._deferred: set[str] = set()
        self._closed = False

    # ----------------------------------------------------------------- activation
    def activate(self, trigger: str = "api") -> None:
        """Decide whether to act in this process and, if so, register every patch's hooks.

        Runs once; a concurrent call waits until the first is done, later calls return at once.
        Never raises (strict mode aside). Never called with the interpreter's import lock held
        (the start-up observer activates from its loader, not from ``find_spec``), so imports made
        here cannot deadlock with another thread's import.
        """
        with self._activation_lock:
            if self.status != "not-activated":
                return
            self.status = "activating"
            self.trigger = trigger
            config = self._config = self._config or read_config()
            self.warnings = list(config.warnings)
            self.device, inert = gates.device_decision(config)
            if inert:
                self.status, self.reason = "inactive", inert
                self._flush_warnings()
                return
            try:
                self._activate(config)
            except PatchError:
                raise  # strict mode: a patch on a target imported before activation failed
            except Exception as exc:  # a bug here must not break the user's import
                self.status, self.reason = "failed", f"activation failed: {exc!r}"
                self._logger().exception("verl-npu-autopatch activation failed")
                if config.strict:
                    raise

    def _activate(self, config: Config) -> None:
        logger = self._logger()
        if config.log_level:
            logger.setLevel(config.log_level)
        from verl_npu_autopatch import catalog
        from verl_npu_autopatch.records import Record

        patches, load_errors = (list(self._catalogue), []) if self._catalogue is not None else catalog.load()
        self.warnings += config.unknown_names(catalog.names_and_groups(patches))
        self._flush_warnings()
        for name, error in load_errors:
            self._record_load_error(name, error)
        unique: dict[str, Patch] = {}
        for patch in patches:
            if patch.name in unique:
                self.warnings.append(f"duplicate patch name {patch.name!r}: the second one is ignored")
                logger.warning("%s", self.warnings[-1])
            else:
                unique[patch.name] = patch
        plans = {name: gates.plan(patch, config) for name, patch in unique.items()}
        with self._lock:
            self.status, self.reason = "active", f"activated by {self.trigger}"
            for name, plan in plans.items():
                self.patches[name] = unique[name]
                targets = plan.variants or unique[name].targets
                self.records[name] = Record(name, unique[name].groups, " | ".join(map(str, targets)), "pending")
                self.records[name].versions = plan.versions
                if plan.variants:
                    self._variants[name] = plan.variants
        for name, plan in plans.items():
            self._set(self.records[name], plan.state, plan.reason)
        self._register_hooks()

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
                if patch.device == "npu-device" and config.device != "npu" and not probes.npu_device_visible():
                    return self._finish(record, "gated", "needs a visible NPU device", config, patch)
                from verl_npu_autopatch.patching import describe, marked_by

                for detector in patch.yields_to:
                    owner = detector(site)
                    if owner:
                        return self._finish(record, "yielded", f"target owned by {owner}", config, patch)
                if marked_by(site.value) == patch.name:
                    return self._finish(record, "applied", f"already in place ({describe(site.value)})", config, patch)
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
                return self._finish(
                    record, "applied", _installed_reason(self._variants[patch.name], target, rejected), config, patch
                )
        except Exception as exc:
            where = target or (module.__name__ if module else patch.name)
            reason = f"{stage} raised {type(exc).__name__}: {exc}"
            self._logger().error("patch %s on %s failed: %s", patch.name, where, reason, exc_info=True)
            self._set(record, "failed", reason)
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
        import inspect

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
            owner, found = live, True
            parts = target.qualname.split(".")
            for part in parts[:-1]:
                owner = getattr(owner, part, None)
                if owner is None:
                    found = False
                    break
            value = inspect.getattr_static(owner, parts[-1], None) if found else None
            if value is None:
                missing.append(f"{target} ({_describe_missing(live, parts)})")
                continue
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

    # ----------------------------------------------------------------- records
    def _set(self, record: Record, state: str, reason: str) -> None:
        with self._lock:
            record.state, record.reason = state, reason
        self._logger().log(_LOG_LEVELS.get(state, 10), "%s: %s (%s)", record.name, state, reason)

    def _record_load_error(self, name: str, error: str) -> None:
        from verl_npu_autopatch.records import Record

        record = self.records[name] = Record(name, (), "entry point", versions={})
        self._set(record, "failed", error)

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
        from verl_npu_autopatch.records import Record, Report

        with self._lock:
            records = [Record(**{**r.__dict__, "versions": dict(r.versions)}) for r in self.records.values()]
            return Report(self.status, self.reason, self.trigger, self.device, records, list(self.warnings))

    def _matching(self, name: str | None) -> list[str]:
        if name is None:
            return list(self.records)
        return [n for n, p in self.patches.items() if name == n or name in p.groups]

    def revert(self, name: str | None = None) -> list[str]:
        """Undo applied patches (all, one by name, or a group); returns the names reverted."""
        done = []
        for patch_name in self._matching(name):
            with self._lock:
                undo = self._undo.pop(patch_name, None)
            if undo is None:
                continue
            record = self.records[patch_name]
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
        for record in pending:
            self._set(record, "disabled", reason)

    def yield_to(self, name: str, owner: str) -> bool:
        """Hand patch ``name``'s target to ``owner``: undo it if applied, record ``yielded``.

        Returns whether the patch was applied before. Used for arbitration with e.g. Liger-Kernel.
        """
        with self._lock:
            record = self.records.get(name)
            if record is None or record.state not in ("pending", "applied"):
                return False
            undo = self._undo.pop(name, None)
        if undo is not None:
            undo()
        self._set(record, "yielded", f"target handed to {owner}")
        return undo is not None


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
    """Activate the process-wide engine (idempotent). Use it where ``.pth`` files are not
    processed: ``python -S``, embedded interpreters, code on ``PYTHONPATH`` only."""
    observer = verl_npu_autopatch.installed_observer()
    if observer is not None:
        observer.remove()  # activation is done (or decided against): nothing left to observe
    _ENGINE.activate(trigger)


def report() -> Report:
    """What the process-wide engine decided so far, patch by patch."""
    if _ENGINE.status == "not-activated" and verl_npu_autopatch.woken_inert:
        _ENGINE.activate(verl_npu_autopatch.woken_inert)  # the start-up hook found it inert; say why
    return _ENGINE.report()


def revert(name: str | None = None) -> list[str]:
    """Undo applied patches: all of them, one by name, or a group."""
    return _ENGINE.revert(name)
