"""verl-npu-autopatch: Ascend-NPU runtime fixes for verl, applied in every Python process.

This module is also the start-up hook: ``verl_npu_autopatch.pth`` (and the PEP 829
``verl_npu_autopatch.start``) call :func:`install` in every interpreter. So it uses only what
``python -c pass`` has already loaded (``os``, ``sys``; not even ``typing`` or ``__future__``),
never raises, prints or writes, and resolves the public names lazily. One module, not a package
plus a start-up submodule: each module import at start-up costs about 0.2 ms.

:func:`install` puts one :class:`Observer` at the front of ``sys.meta_path``. It ignores every
import except the first import of a watched top-level package; that import's loader
(:class:`Awakening`) decides, still with the standard library only, whether this host needs the
engine at all (``torch_npu`` findable, or ``VERL_NPU_AUTOPATCH_DEVICE=npu``), and only then
imports and activates it.

While the engine activates, the observer *guards* imports (:func:`guard`): every watched package
and every submodule of a watched (or target) package that another thread imports waits in its
loader until the hooks are registered, and is patched as it finishes loading. So no target import
completes unpatched once activation has begun. The observer leaves ``sys.meta_path`` when
activation is over (see docs/index.md, "Activation and threads").
"""

import os
import sys

__version__ = "0.1.0"
__all__ = ["Patch", "Target", "activate", "report", "revert"]

#: Top-level packages whose first import activates the engine. ``tests`` check that every
#: built-in patch target lives under one of these.
WATCHED = frozenset(
    {"vllm", "vllm_ascend", "transformers", "liger_kernel", "verl", "tensordict", "torch_npu", "megatron"}
)

#: Values of ``VERL_NPU_AUTOPATCH`` (any case) that switch the package off.
_FALSY = frozenset({"0", "false", "no", "off", "n", "f", "disable", "disabled", "none", "never"})

#: The watched package whose import found this host inert without importing the engine.
woken_inert = ""

_LAZY = {
    "activate": "verl_npu_autopatch.engine",
    "report": "verl_npu_autopatch.engine",
    "revert": "verl_npu_autopatch.engine",
    "Patch": "verl_npu_autopatch.spec",
    "Target": "verl_npu_autopatch.spec",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'verl_npu_autopatch' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def switched_off() -> bool:
    """True when ``VERL_NPU_AUTOPATCH`` means off (``0``, ``false``, ``no``, ``off``, ``disable(d)``,
    ``none``, ..., any case)."""
    return os.environ.get("VERL_NPU_AUTOPATCH", "").strip().lower() in _FALSY


def findable(name: str) -> bool:
    """Whether top-level module ``name`` could be imported, asking the meta-path finders directly
    (``importlib.util.find_spec`` without importing ``importlib.util``; nothing is executed)."""
    if name in sys.modules:
        return True
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None or getattr(finder, "verl_npu_autopatch_observer", False):
            continue
        try:
            if find_spec(name, None) is not None:
                return True
        except Exception:
            continue
    return False


def device_decision(device: str) -> tuple:
    """``(device, inert reason)`` for a ``VERL_NPU_AUTOPATCH_DEVICE`` value (``auto``, ``npu`` or
    ``none``); the reason is empty when the engine should act."""
    if device == "none":
        return "none", "VERL_NPU_AUTOPATCH_DEVICE=none"
    if device == "npu":
        return "npu (forced)", ""
    if findable("torch_npu"):
        return "npu (torch_npu installed)", ""
    return "none (torch_npu not installed)", "no NPU stack: torch_npu is not installed (VERL_NPU_AUTOPATCH_DEVICE=auto)"


def _inert_here() -> bool:
    """The engine has nothing to do in this process, decided with the standard library only.
    Other or unknown device values go to the engine, which warns about bad ones; so does a set
    ``VERL_NPU_AUTOPATCH_LOG`` (the engine logs why it stays inactive)."""
    if os.environ.get("VERL_NPU_AUTOPATCH_LOG", "").strip():
        return False
    device = os.environ.get("VERL_NPU_AUTOPATCH_DEVICE", "").strip().lower() or "auto"
    return device in ("auto", "none") and bool(device_decision(device)[1])


class Observer:
    """Meta-path finder that finds nothing itself; it only notices the first watched import.

    For a watched name it hands back the real spec with an :class:`Awakening` loader, so the
    engine is activated when the package actually *loads* (a bare ``importlib.util.find_spec``
    probe activates nothing) and not inside ``find_spec``, which runs under the interpreter's
    global import lock. During activation :func:`guard` switches it to :meth:`guarding`; the
    engine removes it when activation is over.
    """

    verl_npu_autopatch_observer = True

    def __init__(self) -> None:
        self.watched = WATCHED
        self.gated = WATCHED
        self.activator = None
        self.trigger = ""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.watched:
            return None
        return self.awaken(fullname, path, target)

    def guarding(self, fullname, path=None, target=None):
        """``find_spec`` while the engine activates. Watched packages get an :class:`Awakening`
        loader as always. For threads other than the activating one, so do the modules of the
        gated packages (the watched ones and the other target packages) or, while the catalogue
        is not loaded yet (``gated is None``), every module outside the standard library and
        this package: their loader waits for the activation to end before the module executes."""
        if fullname in self.watched:
            return self.awaken(fullname, path, target)
        top = fullname.partition(".")[0]
        gated = self.gated
        if (gated is None and top != __name__) or (gated is not None and top in gated):
            import _thread

            if _thread.get_ident() != self.activator:
                spec = self.real_spec(fullname, path, target)
                if spec is not None and (gated is not None or not _standard_library(spec)):
                    return _wrapped(spec, self.trigger or fullname)
        return None

    def awaken(self, fullname, path, target):
        """The real spec of a watched package, its loader wrapped in an :class:`Awakening`."""
        spec = self.real_spec(fullname, path, target)
        return None if spec is None else _wrapped(spec, None)

    def real_spec(self, fullname, path, target):
        """The spec the finders after this one give ``fullname``."""
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None or getattr(finder, "verl_npu_autopatch_observer", False):
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def _wrapped(spec, trigger):
    """``spec`` with its loader wrapped in an :class:`Awakening` (``trigger``: ``None`` for a
    watched package, else the watched package whose import began the activation it awaits)."""
    loader = spec.loader
    if loader is None and spec.submodule_search_locations is not None:
        loader = _namespace_loader(spec)  # a namespace package (no __init__.py)
    if loader is not None and hasattr(loader, "exec_module"):
        spec.loader = Awakening(loader, trigger)
    return spec


def _standard_library(spec) -> bool:
    """Whether ``spec`` is a built-in, frozen or standard-library module (never held up: the
    activating thread imports such modules)."""
    origin = spec.origin or ""
    if origin in ("built-in", "frozen") or type(spec.loader).__name__ in ("BuiltinImporter", "FrozenImporter"):
        return True
    stdlib = os.path.dirname(os.__file__) + os.sep
    return origin.startswith(stdlib) and "-packages" not in origin


def _namespace_loader(spec):
    """The loader the import system itself gives a namespace package, or ``None``."""
    try:
        external = sys.modules["_frozen_importlib_external"]
        cls = getattr(external, "NamespaceLoader", None) or external._NamespaceLoader
        loader = cls.__new__(cls)
        loader._path = spec.submodule_search_locations
        return loader
    except Exception:
        return None


class Awakening:
    """Loader wrapper for a watched package (or, during activation, a guarded module): activate
    the engine unless this host is inert (waiting for an activation under way in another thread),
    run the real loader, then let the engine patch the module itself (wrapt never saw this
    import). Other attributes (``get_code``, ...) pass through to the real loader.

    For a watched package the decision is made in :meth:`create_module`, before the module is
    visible in ``sys.modules``: from then on other threads' imports are guarded, so none of the
    package's submodules can be imported past the engine while it loads."""

    def __init__(self, loader, trigger=None) -> None:
        self.loader = loader
        self.trigger = trigger  # None: a watched package, which decides; else it waits
        self.inert = False

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        if self.trigger is None:
            try:
                self.inert = _inert_here()
                if self.inert:
                    stop_observing()
                else:
                    _begin_guard(spec.name)
            except Exception:
                pass
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        global woken_inert
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        engine = None
        try:
            if self.inert:
                woken_inert = woken_inert or module.__name__
            else:
                from verl_npu_autopatch import engine

                engine.activate(trigger=self.trigger or module.__name__)
        except Exception as exc:  # the engine records its own failures; never break the import
            if type(exc).__name__ == "PatchError":  # strict mode: raise at the watched import
                raise
            engine = None
            stop_observing()  # e.g. an unimportable engine: do not hold other imports up
        self.loader.exec_module(module)
        if engine is not None:
            try:
                engine.engine().module_loaded(module)
            except Exception as exc:
                if type(exc).__name__ == "PatchError":  # strict mode: raise at the target's import
                    raise


def installed_observer():
    """The observer on ``sys.meta_path``, or ``None``."""
    for finder in sys.meta_path:
        if getattr(finder, "verl_npu_autopatch_observer", False):
            return finder
    return None


def guard(activator: int, packages=None) -> None:
    """Activation began on thread ``activator``: put the observer (a new one where the start-up
    hook did not run) in guarding mode, for every module outside the standard library until the
    catalogue is known (``packages`` is ``None``), then for the watched packages plus
    ``packages`` (the other target packages)."""
    try:
        observer = installed_observer()
        if observer is None:
            observer = Observer()
            sys.meta_path.insert(0, observer)
        observer.activator = activator
        observer.gated = None if packages is None else WATCHED | frozenset(packages)
        observer.find_spec = observer.guarding
    except Exception:
        pass


def _begin_guard(trigger: str) -> None:
    """A watched package starts loading in this thread: guard imports from now on (unless an
    activation already does), until the engine takes over."""
    observer = installed_observer()
    if observer is not None and "find_spec" not in observer.__dict__:
        import _thread

        observer.trigger = trigger
        guard(_thread.get_ident())


def stop_observing() -> None:
    """Activation is over (or decided against): nothing is left to observe."""
    observer = installed_observer()
    if observer is not None:
        observer.remove()


def install() -> None:
    """Entry point of the ``.pth`` line and the PEP 829 ``.start`` file. Idempotent, silent."""
    try:
        if switched_off() or installed_observer() is not None:
            return
        if any(name in sys.modules for name in WATCHED):
            return  # too late to observe: ``activate()`` or the vLLM plugin takes over
        sys.meta_path.insert(0, Observer())
    except Exception:
        pass
