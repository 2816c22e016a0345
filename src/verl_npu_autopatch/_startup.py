"""The start-up module: the observer on ``sys.meta_path`` (see docs/index.md, "How it works").

Nothing imports it at interpreter start. The ``verl_npu_autopatch.pth`` line puts a placeholder on
``sys.meta_path``; the first watched name imports this module (as ``_verl_npu_autopatch_startup``,
the wheel's root copy of this file, holding the global import lock) and calls :func:`take_over`.
The PEP 829 ``.start`` file (Python 3.15+) calls :func:`install_observer`; the package shipped
alone uses this file through ``_config.startup``. Standard library only (``os``, ``sys``, already
loaded); never raises, prints or writes. The module object itself is the observer: its
:func:`find_spec` hands a watched package's real spec back with an :class:`ActivatingLoader`.
When the package loads, outside the global lock, that loader lets it load untouched on a host
that is plainly inert (:func:`plainly_inert`: no ``torch_npu`` and no configuration that could
say otherwise), importing nothing; otherwise its work (``_activation``) is imported then.
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

#: The name this module is loaded under (by the placeholder, the ``.start`` file, or
#: ``_config`` for the package's own copy): one observer per process.
NAME = "_verl_npu_autopatch_startup"

#: Marks the start-up line's placeholders on ``sys.meta_path``: one each time ``site`` reads the
#: ``.pth`` (twice in a venv, cpython#75723); :func:`take_over` replaces the first, drops the rest.
PLACEHOLDER = "verl_npu_autopatch_placeholder"

#: Marks this module as the observer on ``sys.meta_path``.
verl_npu_autopatch_observer = True

#: Guard state, set by ``verl_npu_autopatch._activation.guard`` while the engine activates.
gated = WATCHED
activator = None
trigger = ""

#: The observer's work in this process is over: it left ``sys.meta_path`` after an activation,
#: or after deciding against one (a ``.pth`` processed again later puts no observer back).
#: Like :data:`woken_inert`, kept by an ``importlib.reload`` of this module.
done = globals().get("done", False)

#: The watched package whose import found this host inert (the engine, asked later, says why).
woken_inert = globals().get("woken_inert", "")

#: Variables that can make a host without ``torch_npu`` act, or make the configuration warn,
#: whatever their value (``_config.read_config``); the on/off switches among them only when their
#: value is not understood (:data:`SWITCHES`).
DECIDING = ("VERL_NPU_AUTOPATCH_DEVICE", "VERL_NPU_AUTOPATCH_LOG")
SWITCHES = ("VERL_NPU_AUTOPATCH", "VERL_NPU_AUTOPATCH_STRICT", "VERL_VLLM_ASCEND_GLM52_PATCH")


def flag(raw):
    """``True`` / ``False`` for an on/off word of :data:`TRUE` / :data:`FALSE`, ``None`` for
    anything else: the one parser of every boolean variable."""
    value = raw.strip().lower()
    return True if value in TRUE else False if value in FALSE else None


def switched_off():
    """``VERL_NPU_AUTOPATCH`` says off (``0``, ``false``, ``no``, ``off``, ``none``, ... any case)."""
    return flag(os.environ.get("VERL_NPU_AUTOPATCH", "")) is False


def findable(name):
    """Whether top-level module ``name`` could be imported, asking the meta-path finders directly
    (``importlib.util.find_spec`` without importing ``importlib.util``; nothing is executed), but
    our own start-up hooks: a look-up is not an import to observe."""
    if name in sys.modules:
        return True
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None)
        if find is None or is_hook(finder):
            continue
        try:
            if find(name, None) is not None:
                return True
        except Exception:  # a finder that raises cannot answer; the next one is asked
            continue
    return False


def npu_stack_installed():
    """The Ascend software stack is present: ``torch_npu`` can be found."""
    return findable("torch_npu")


def plainly_inert():
    """This host needs no engine, and nothing needs the configuration read to say so: ``torch_npu``
    cannot be found and no variable could change that decision or warn (:data:`DECIDING` unset,
    :data:`SWITCHES` unset or understood). The default configuration on such a host is inert by
    ``_environment.device_decision``; every other case is decided there, by
    ``_activation.inert_here``."""
    try:
        environ = os.environ
        if any(environ.get(name, "").strip() for name in DECIDING):
            return False
        for name in SWITCHES:
            raw = environ.get(name, "")
            if raw.strip() and flag(raw) is None:
                return False
        return not npu_stack_installed()
    except Exception:  # cannot tell: the configuration is read by _activation, which decides
        return False


def fall_inert(name):
    """The import of watched package ``name`` found this host inert: remember it and stop observing."""
    global woken_inert
    woken_inert = woken_inert or name
    uninstall_observer()


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
        spec.loader = ActivatingLoader(loader, waits_for)
    return spec


def real_spec(fullname, path, target):
    """The spec the finders after the start-up hook on ``sys.meta_path`` give ``fullname``.
    Those in front of it were asked already; one of them that asks the finders after itself
    (APM agents, coverage tools) would ask the hook again, without end."""
    finders = list(sys.meta_path)
    first = next((index for index, finder in enumerate(finders) if is_hook(finder)), -1)
    for finder in finders[first + 1 :]:
        find = getattr(finder, "find_spec", None)
        if find is None or is_hook(finder):
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
    except Exception:  # an import system without that class: the namespace package loads as usual
        return None


class ActivatingLoader:
    """Wraps a watched package's (or, during activation, a guarded module's) loader; other
    attributes (``get_code``, ...) pass through to the real loader."""

    def __init__(self, loader, waits_for=None):
        self.loader = loader
        self.waits_for = waits_for
        self.inert = False  # this host needs no engine: load as if we were not here
        self.broken = False  # the package cannot be imported: likewise

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        """For a watched package, decide whether this host is inert (:func:`plainly_inert` with
        the standard library alone, else ``_activation``), before the module is in
        ``sys.modules``."""
        if self.waits_for is None and plainly_inert():
            self.inert = True
            fall_inert(spec.name)
        else:
            try:
                from verl_npu_autopatch import _activation
            except Exception:  # a broken install: the observer leaves, the package loads untouched
                uninstall_observer()
                self.broken = True
            else:
                return _activation.create_module(self, spec)
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        """Run the real loader (through ``_activation`` unless inert or broken). If the package
        raises, this frame leaves the traceback (3.11+; the exception is unchanged)."""
        try:
            if self.inert or self.broken:
                module.__loader__ = self.loader
                if getattr(module, "__spec__", None) is not None:
                    module.__spec__.loader = self.loader
                return self.loader.exec_module(module)
            from verl_npu_autopatch import _activation

            return _activation.exec_module(self, module)
        except BaseException as exc:
            unframed(exc, ActivatingLoader.exec_module.__code__)
            raise


def unframed(exc, code):
    """Take the frame running ``code`` off the head of ``exc``'s traceback, so that a failing
    upstream import shows only its own frames; a bare ``raise`` after it keeps the rest of the
    exception as it is (Python 3.10 re-raises the traceback it caught, frame included)."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is code:
        exc.__traceback__ = tb.tb_next


def installed_observer():
    """The observer on ``sys.meta_path`` (this module), or ``None``."""
    for finder in sys.meta_path:
        if getattr(finder, "verl_npu_autopatch_observer", False):
            return finder
    return None


def hooked():
    """The start-up hook is in place: the observer, or the placeholder waiting for a watched
    import."""
    return any(is_hook(finder) for finder in sys.meta_path)


def _placeholder(finder):
    return getattr(finder, PLACEHOLDER, False) is True


def is_hook(finder):
    """``finder`` is ours: the observer or the start-up line's placeholder (finders that look
    up a name for us skip both)."""
    return getattr(finder, "verl_npu_autopatch_observer", False) is True or _placeholder(finder)


def drop_placeholders():
    """Take the start-up line's placeholders off ``sys.meta_path``."""
    _leave_meta_path(_placeholder)


def _leave_meta_path(leaving):
    """The finders ``leaving(finder)`` picks off ``sys.meta_path``, as a new list instead of
    removing from the old one: an import running in another thread iterates over the old list,
    and removing from it would make that import skip the finder after the removed one (even the
    last, ``PathFinder``: "No module named ...")."""
    if any(leaving(finder) for finder in sys.meta_path):
        sys.meta_path = [finder for finder in sys.meta_path if not leaving(finder)]


def _nothing_to_observe():
    """Switched off, or the observer's work in this process is over (:data:`done`).

    A watched package already in ``sys.modules`` does not count: one imported before the hook
    was in place (another ``.pth``), or put there by hand, is patched at activation like any
    target imported before it, and the next watched import still activates."""
    return switched_off() or done


def put_first():
    """This module on ``sys.meta_path`` (once), in the place of the start-up line's placeholder
    (replaced in place, so imports iterating over the list meanwhile see one finder or the
    other), else at the front."""
    if installed_observer() is None:
        me = sys.modules[__name__]
        for index, finder in enumerate(sys.meta_path):
            if _placeholder(finder):
                sys.meta_path[index] = me
                break
        else:
            sys.meta_path.insert(0, me)
    drop_placeholders()


def take_over(fullname, path=None, target=None):
    """``find_spec`` of the start-up line's placeholder for a watched name (the first watched
    import of the process), called under the global import lock: this module takes the
    placeholder's place and observes from now on (unless :func:`_nothing_to_observe`, when the
    placeholder just leaves) and answers for ``fullname``."""
    try:
        if _nothing_to_observe():
            drop_placeholders()
        else:
            put_first()
    except Exception:  # start-up code never raises; the import then goes on unobserved
        pass
    return (find_spec if installed_observer() is not None else real_spec)(fullname, path, target)


def uninstall_observer():
    """Leave ``sys.meta_path`` for good (activation is over, or decided against); what is left
    of the module observes again, should an activation put it back (``_activation.guard``)."""
    global find_spec, gated, activator, trigger, done
    try:
        me = sys.modules[__name__]
        _leave_meta_path(lambda finder: finder is me)
    except Exception:  # start-up code never raises; the observer then answers None for good
        pass
    find_spec, gated, activator, trigger, done = observe, WATCHED, None, "", True


def install_observer():
    """Put this module on ``sys.meta_path`` as the observer: the entry point of the PEP 829
    ``.start`` file (Python 3.15+). Idempotent, silent."""
    try:
        me = sys.modules.setdefault(NAME, sys.modules[__name__])
        if me is not sys.modules[__name__]:
            return me.install_observer()
        if not _nothing_to_observe():
            put_first()
    except Exception:  # start-up code never raises, prints or writes; the process runs unpatched
        pass
