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
"""

import os
import sys

__version__ = "0.1.0"
__all__ = ["Patch", "Target", "activate", "report", "revert"]

#: Top-level packages whose first import activates the engine. ``tests`` check that every
#: built-in patch target lives under one of these.
WATCHED = frozenset({"vllm", "vllm_ascend", "transformers", "liger_kernel", "tensordict", "torch_npu", "megatron"})

_FALSY = frozenset({"0", "false", "no", "off"})

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
    """True when ``VERL_NPU_AUTOPATCH`` is falsy (``0``, ``false``, ``no``, ``off``, any case)."""
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
    Other or unknown device values go to the engine, which warns about bad ones."""
    device = os.environ.get("VERL_NPU_AUTOPATCH_DEVICE", "").strip().lower() or "auto"
    return device in ("auto", "none") and bool(device_decision(device)[1])


class Observer:
    """Meta-path finder that finds nothing itself; it only notices the first watched import.

    For a watched name it hands back the real spec with an :class:`Awakening` loader, so the
    engine is activated when the package actually *loads* (a bare ``importlib.util.find_spec``
    probe activates nothing) and not inside ``find_spec``, which runs under the interpreter's
    global import lock. Activation removes the observer.
    """

    verl_npu_autopatch_observer = True

    def __init__(self) -> None:
        self.watched = WATCHED

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.watched:
            return None
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = Awakening(spec.loader)
                return spec
        return None

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


class Awakening:
    """Loader wrapper for the watched package that woke the observer: activate the engine (unless
    this host is inert), run the real loader, then let the engine patch the package itself (wrapt
    never saw this import). Other attributes (``get_code``, ...) pass through to the real loader."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        global woken_inert
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        engine = None
        try:
            if _inert_here():
                woken_inert = woken_inert or module.__name__
                observer = installed_observer()
                if observer is not None:
                    observer.remove()
            else:
                from verl_npu_autopatch import engine

                engine.activate(trigger=module.__name__)
        except Exception:  # the engine records its own failures; never break the import
            engine = None
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
