"""The activating loader's work, once a watched package starts loading on a host not plainly
inactive: decide from the configuration, wake the engine, patch the package itself. While the
engine activates, other threads' imports of the watched and target packages wait in their loader
and are patched as they finish: no target import completes unpatched once activation has begun
(docs/internals.md, "Activation and threads"). Imported by name from the start-up module (its
``ACTIVATION``), outside the global import lock. Standard library only.
"""

import _thread
import os
import sys

from verl_npu_autopatch.bootstrap.startup import NAME, OBSERVER, WATCHED, activating, real_spec, unframed
from verl_npu_autopatch.engine.config import read_config
from verl_npu_autopatch.engine.environment import device_decision

TYPE_CHECKING = False
if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

    from verl_npu_autopatch.bootstrap.startup import Observer as StartupObserver


def inactive_here() -> bool:
    """The configuration's device decision says inactive, and the engine has nothing to log (no
    warnings, ``VERL_NPU_AUTOPATCH_LOG`` unset)."""
    config = read_config()
    if config.warnings or os.environ.get("VERL_NPU_AUTOPATCH_LOG", "").strip():
        return False
    return bool(device_decision(config)[1])


def create_module(loader: "Any", spec: "ModuleSpec") -> "ModuleType | None":
    """Decide for a watched package before it is in ``sys.modules``: from then on other threads'
    imports are guarded, so none of its submodules gets past the engine."""
    if loader.waits_for is None:
        try:
            if OBSERVER.engine is not None and OBSERVER.engine.too_deep():
                loader.inactive = True  # where an activation ran out of stack: untouched, still resuming
            else:
                loader.inactive = inactive_here()
                OBSERVER.retire_inactive(spec.name) if loader.inactive else OBSERVER.wake(spec.name)
        except Exception:  # the decision is retried by exec_module (engine.activate); the import must go on
            pass
    create = getattr(loader.loader, "create_module", None)
    return create(spec) if create is not None else None


def exec_module(loader: "Any", module: "ModuleType") -> None:
    """Activate the engine (or wait for another thread's activation), run the real loader, then let
    the engine patch the module (wrapt never saw this import). If it raises, its next import is
    hooked, and this frame leaves the traceback."""
    module.__loader__ = loader.loader
    spec = getattr(module, "__spec__", None)
    if spec is not None:
        spec.loader = loader.loader
    lifecycle: ModuleType | None = None
    try:
        from verl_npu_autopatch.engine import lifecycle as imported

        imported.activate(trigger=loader.waits_for or module.__name__)
        lifecycle = imported
    except Exception as exc:  # the engine records its own failures; never break the import
        if _strict(exc):  # strict mode: raise at the watched import
            raise
        lifecycle = None
        OBSERVER.retire()  # e.g. an unimportable engine: do not hold other imports up
    try:
        loader.loader.exec_module(module)
    except BaseException as exc:  # the import fails: a retry must still be patched
        if lifecycle is not None:
            try:
                lifecycle.engine().module_failed(module)
            except Exception:  # the import's own exception is what the user must see
                pass
        unframed(exc, exec_module.__code__)
        raise
    if lifecycle is not None:
        try:
            lifecycle.engine().module_loaded(module)
        except Exception as exc:  # recorded and logged by the engine; outside strict mode the import succeeds
            if _strict(exc):  # strict mode: raise at the target's import
                raise


def _strict(exc: BaseException) -> bool:
    """Whether ``exc`` is strict mode's ``PatchError`` (its module is loaded whenever one could be raised)."""
    engine = sys.modules.get("verl_npu_autopatch.engine.lifecycle")
    return engine is not None and isinstance(exc, engine.PatchError)


def waits_for_activation(observer: "StartupObserver", fullname: str, path: "Any", target: "Any") -> "ModuleSpec | None":
    """The guarding or resuming observer's answer for a name outside the watched packages. Resuming:
    a watched package's module activates. Guarding: in other threads, the gated packages' modules
    (every module but the standard library's and ours while ``gated`` is ``None``) wait for the
    activation to end before they execute."""
    top = fullname.partition(".")[0]
    if observer.mode != "guarding":  # resuming: an activation was abandoned; a watched package's module activates
        spec = real_spec(fullname, path, target) if observer.mode == "resuming" and top in WATCHED else None
        return None if spec is None else activating(spec, None)
    gated = observer.gated
    is_held = top in gated if gated is not None else top not in ("verl_npu_autopatch", NAME)
    if is_held and _thread.get_ident() != observer.activator:
        spec = real_spec(fullname, path, target)
        if spec is not None and (gated is not None or not _standard_library(spec)):
            return activating(spec, observer.trigger or fullname)
    return None


def _standard_library(spec: "ModuleSpec") -> bool:
    """A built-in, frozen or standard-library module: never held up (the activation imports them)."""
    origin = spec.origin or ""
    if origin in ("built-in", "frozen") or type(spec.loader).__name__ in ("BuiltinImporter", "FrozenImporter"):
        return True
    stdlib = os.path.dirname(os.__file__) + os.sep
    return origin.startswith(stdlib) and "-packages" not in origin


def after_fork_in_child() -> None:
    """In a fork's child, an activation under way in another thread (not there) is abandoned:
    the child imports freely and its next watched import, or ``activate()``, activates."""
    try:
        engine = sys.modules.get("verl_npu_autopatch.engine.lifecycle")
        if engine is not None:
            engine.engine().after_fork()
        if OBSERVER.mode == "guarding" and OBSERVER.activator != _thread.get_ident():  # the engine's part was done
            status = "not-activated" if engine is None else engine.engine().status
            OBSERVER.resume_observing(True) if status == "not-activated" else OBSERVER.retire()
    except Exception:  # a fork handler must not raise in the child; it then imports unguarded
        pass
