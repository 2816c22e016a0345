"""Start-up hook run by ``verl_npu_autopatch.pth`` / ``.start`` in every interpreter.

Standard library only, and only what ``python -c pass`` has already loaded. It installs one
observer at the front of ``sys.meta_path``; the observer ignores every import except the first
import of a watched top-level package, which wakes the engine up. Nothing here raises, prints or
writes.
"""

import os
import sys

#: Top-level packages whose first import activates the engine. ``tests`` check that every
#: built-in patch target lives under one of these.
WATCHED = frozenset({"vllm", "vllm_ascend", "transformers", "liger_kernel"})

_FALSY = frozenset({"0", "false", "no", "off"})


def switched_off() -> bool:
    """True when ``VERL_NPU_AUTOPATCH`` is falsy (``0``, ``false``, ``no``, ``off``, any case)."""
    return os.environ.get("VERL_NPU_AUTOPATCH", "").strip().lower() in _FALSY


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
    """Loader wrapper for the watched package that woke the observer: activate the engine, run
    the real loader, then let the engine patch the package itself (wrapt never saw this import).
    Other attributes (``get_code``, ``is_package``, ...) pass through to the real loader."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        engine = None
        try:
            from verl_npu_autopatch import engine

            engine.activate(trigger=module.__name__)
        except Exception:  # the engine records its own failures; never break the import
            pass
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
