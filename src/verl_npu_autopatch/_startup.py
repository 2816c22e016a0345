"""verl-npu-autopatch's start-up hook: the one module every interpreter imports.

The wheel ships this file twice: at its root as ``_verl_npu_autopatch_startup`` (what the ``.pth``
line imports, so start-up imports one module and not the package) and here, for the package shipped
alone (Ray ``py_modules``, ``PYTHONPATH``), where ``activate()`` still needs a guarding observer.

``verl_npu_autopatch.pth`` (and the PEP 829 ``verl_npu_autopatch.start``) call
:func:`install_observer` at start-up. So this module holds only what must run then, uses only what
``python -c pass`` has already loaded (``os``, ``sys``), defines no class and imports nothing at
module level: it never raises, prints or writes. It is its own observer: the module object itself
sits on ``sys.meta_path`` (a module-level :func:`find_spec` is a finder, and putting the module
there costs no class and no instance).

Its ``find_spec`` ignores every import except the first import of a watched top-level package.
For that one it hands back the real spec with an *activating loader*; what that loader does (the
inert-host decision, guard mode, activating the engine) lives in ``verl_npu_autopatch._activation``
and is imported from the loader, when the package loads, never from ``find_spec``, which runs
under the interpreter's global import lock (see docs/index.md, "Activation and threads").
"""

import os
import sys

#: Top-level packages whose first import activates the engine. ``tests`` check that every
#: built-in patch target lives under one of these.
WATCHED = frozenset(
    {"vllm", "vllm_ascend", "transformers", "liger_kernel", "verl", "tensordict", "torch_npu", "megatron"}
)

#: The on/off words of every boolean variable (any case, surrounding spaces ignored).
TRUE = frozenset({"1", "true", "yes", "on", "y", "t", "enable", "enabled"})
FALSE = frozenset({"0", "false", "no", "off", "n", "f", "disable", "disabled", "none", "never"})

#: Marks this module as the observer on ``sys.meta_path``.
verl_npu_autopatch_observer = True

#: Guard state, set by ``verl_npu_autopatch._activation.guard`` while the engine activates.
gated = WATCHED
activator = None
trigger = ""


def flag(raw):
    """``True`` / ``False`` for an on/off word of :data:`TRUE` / :data:`FALSE`, ``None`` for
    anything else: the one parser of every boolean variable."""
    value = raw.strip().lower()
    return True if value in TRUE else False if value in FALSE else None


def switched_off():
    """``VERL_NPU_AUTOPATCH`` says off (``0``, ``false``, ``no``, ``off``, ``none``, ... any case)."""
    return flag(os.environ.get("VERL_NPU_AUTOPATCH", "")) is False


def observe(fullname, path=None, target=None):
    """``find_spec`` while observing: ``None`` for every name outside :data:`WATCHED` (one
    frozenset lookup); for a watched one, its real spec with an activating loader."""
    if fullname not in WATCHED:
        return None
    spec = real_spec(fullname, path, target)
    return None if spec is None else activating(spec, None)


#: What the import system calls: :func:`observe`, or the guarding ``find_spec`` of
#: ``verl_npu_autopatch._activation`` while the engine activates.
find_spec = observe


def activating(spec, waits_for):
    """``spec`` with its loader wrapped in an activating loader (``waits_for``: ``None`` for a
    watched package, which decides; else the watched package whose activation the module waits
    for)."""
    loader = spec.loader
    if loader is None and spec.submodule_search_locations is not None:
        loader = _namespace_loader(spec)  # a namespace package (no __init__.py)
    if loader is not None and hasattr(loader, "exec_module"):
        spec.loader = _activating_loader_class()(loader, waits_for)
    return spec


def real_spec(fullname, path, target):
    """The spec the other finders on ``sys.meta_path`` give ``fullname``."""
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None)
        if find is None or getattr(finder, "verl_npu_autopatch_observer", False):
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


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


_ActivatingLoader = None


def _activating_loader_class():
    """The activating loader's class, made at the first watched import (under the import lock,
    so without importing anything): it hands ``create_module`` and ``exec_module`` to
    ``verl_npu_autopatch._activation``, imported there, outside the lock."""
    global _ActivatingLoader
    if _ActivatingLoader is None:

        class ActivatingLoader:
            """Wraps a watched package's (or, during activation, a guarded module's) loader;
            other attributes (``get_code``, ...) pass through to the real loader."""

            def __init__(self, loader, waits_for=None):
                self.loader = loader
                self.waits_for = waits_for
                self.inert = False
                self.broken = False  # the package cannot be imported: load as if we were not here

            def __getattr__(self, name):
                return getattr(self.loader, name)

            def create_module(self, spec):
                try:
                    from verl_npu_autopatch import _activation
                except Exception:
                    uninstall_observer()
                    self.broken = True
                    create = getattr(self.loader, "create_module", None)
                    return create(spec) if create is not None else None
                return _activation.create_module(self, spec)

            def exec_module(self, module):
                if self.broken:
                    module.__loader__ = self.loader
                    if getattr(module, "__spec__", None) is not None:
                        module.__spec__.loader = self.loader
                    return self.loader.exec_module(module)
                from verl_npu_autopatch import _activation

                return _activation.exec_module(self, module)

        _ActivatingLoader = ActivatingLoader
    return _ActivatingLoader


def installed_observer():
    """The observer on ``sys.meta_path`` (this module), or ``None``."""
    for finder in sys.meta_path:
        if getattr(finder, "verl_npu_autopatch_observer", False):
            return finder
    return None


def uninstall_observer():
    """Leave ``sys.meta_path`` (activation is over, or decided against) and go back to observing."""
    global find_spec, gated, activator, trigger
    try:
        sys.meta_path.remove(sys.modules[__name__])
    except (ValueError, KeyError):
        pass
    find_spec, gated, activator, trigger = observe, WATCHED, None, ""


def install_observer():
    """Put this module on ``sys.meta_path`` as the observer: the entry point of the ``.pth`` line
    and the PEP 829 ``.start`` file. Idempotent, silent."""
    try:
        if switched_off() or installed_observer() is not None:
            return
        if any(name in sys.modules for name in WATCHED):
            return  # too late to observe: ``activate()`` or the vLLM plugin takes over
        sys.meta_path.insert(0, sys.modules[__name__])
    except Exception:
        pass
