"""The start-up module and its :data:`OBSERVER`, the process's one finder of ours (docs/internals.md).

The ``.pth`` line (``pth_line``) only puts a placeholder on ``sys.meta_path``; the first watched name
imports this module as ``_verl_npu_autopatch_startup`` (the wheel's root copy), under the global
import lock, and calls :func:`take_over`; the PEP 829 ``.start`` file calls :func:`install_observer`.
Standard library only, never raises, prints or writes. A watched package gets an
:class:`ActivatingLoader`: on a :func:`plainly_inactive` host it loads untouched; otherwise the
loader's work (``activation``) is imported then.
"""

import os
import sys
from _thread import get_ident

TYPE_CHECKING = False
if TYPE_CHECKING:  # without importing typing at run time
    from collections.abc import Iterable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any, Literal

    Mode = Literal["placeholder", "observing", "guarding", "resuming", "watching", "retired"]

#: Top-level packages whose first import activates the engine (every built-in target is under one;
#: the ``.pth`` line is rendered from it).
WATCHED = frozenset(
    {"vllm", "vllm_ascend", "transformers", "liger_kernel", "verl", "tensordict", "torch_npu", "megatron"}
)

#: The loader's work, named, never imported by a statement: nothing of the package loads until a
#: watched import needs it (``tests/unit/test_layout.py`` checks the name).
ACTIVATION = "verl_npu_autopatch.bootstrap.activation"

#: The on/off words of every boolean variable (any case, surrounding spaces ignored).
TRUE = frozenset({"1", "true", "yes", "on", "y", "t", "enable", "enabled"})
FALSE = frozenset({"0", "false", "no", "off", "n", "f", "disable", "disabled", "none", "never"})

#: The name this module is loaded under (also, if imported first, the package's copy of the file).
NAME = "_verl_npu_autopatch_startup"

#: Marks the ``.pth`` line's placeholders: one each time ``site`` reads it (twice in a venv, cpython#75723).
PLACEHOLDER = "verl_npu_autopatch_placeholder"

#: Variables that can make a host without ``torch_npu`` act or warn whatever their value, and the
#: switches, which can only when their value is not understood.
DECIDING = ("VERL_NPU_AUTOPATCH_DEVICE", "VERL_NPU_AUTOPATCH_LOG")
SWITCHES = ("VERL_NPU_AUTOPATCH", "VERL_NPU_AUTOPATCH_STRICT", "VERL_VLLM_ASCEND_GLM52_PATCH")


def flag(raw):
    """``True`` / ``False`` for an on/off word, ``None`` for anything else: the one parser of every switch."""
    value = raw.strip().lower()
    return True if value in TRUE else False if value in FALSE else None


def findable(name):
    """Whether top-level module ``name`` could be imported, asking the meta-path finders (not ours:
    a look-up is not an import to observe) without executing anything."""
    if name in sys.modules:
        return sys.modules.get(name) is not None  # None: its import is blocked (it raises ImportError)
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None)
        if find is None or is_hook(finder):
            continue
        try:
            if find(name, None) is not None:
                return True
        except KeyboardInterrupt:
            raise
        except BaseException:  # a finder that raises cannot answer (pytest.fail's is a BaseException); ask the next
            continue
    return False


def npu_stack_installed():
    """The Ascend software stack is present: ``torch_npu`` can be found."""
    return findable("torch_npu")


def plainly_inactive():
    """No engine is needed and no variable could change that or warn: ``torch_npu`` cannot be found,
    :data:`DECIDING` unset, :data:`SWITCHES` unset or understood. ``activation`` decides the rest."""
    try:
        environ = os.environ
        if any(environ.get(name, "").strip() for name in DECIDING):
            return False
        if any(environ.get(name, "").strip() and flag(environ.get(name, "")) is None for name in SWITCHES):
            return False
        return not npu_stack_installed()
    except Exception:  # cannot tell: activation reads the configuration and decides
        return False


class Observer:
    """The start-up observer, one per process (:data:`OBSERVER`). Its :attr:`mode`:

    - ``placeholder``: off ``sys.meta_path``, the ``.pth`` line's placeholder stands in for it;
    - ``observing``: on ``sys.meta_path``; a watched package gets an activating loader;
    - ``guarding``: the engine activates; other threads' modules of the gated packages wait for it;
    - ``resuming``: an activation was abandoned; a module of a watched package activates too;
    - ``watching``: activation is over; it stays for its fixes' modules' re-executions
      (``importlib.reload``, a fresh import), which wrapt's once-per-name hooks miss;
    - ``retired``: off ``sys.meta_path`` for good, unless an abandoned activation resumes it.

    In every mode a name in :attr:`again` (a module a fix went in on) is first offered to the watchers.
    """

    __slots__ = ("activator", "again", "at_fork", "engine", "gated", "inactive_trigger", "mode", "trigger", "watchers")

    verl_npu_autopatch_observer = True  # marks it on sys.meta_path (is_hook)

    def __init__(self) -> None:
        self.mode: Mode = "placeholder"
        self.gated: frozenset[str] | None = WATCHED  # guarding: the packages held (None: all)
        self.activator: int | None = None  # the thread that activates
        self.trigger = ""  # the watched package whose import began the activation
        self.inactive_trigger = ""  # the watched package whose import found this host inactive
        self.engine: Any = None  # the process-wide engine, kept with the observer (ANCHOR)
        self.at_fork = False  # the fork handler is registered (once per process)
        self.again: frozenset[str] = frozenset()  # modules whose re-execution the watchers answer
        self.watchers: list[Any] = []  # each with ``names`` and ``spec(fullname, path, target)``

    def find_spec(
        self, fullname: str, path: "Sequence[str] | None" = None, target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        """A watcher's spec for a re-executed patched module; a watched package's real spec with an
        activating loader; else ``None``, unless guarding or resuming (``waits_for_activation``)."""
        if fullname in self.again:
            for watcher in list(self.watchers):
                spec = watcher.spec(fullname, path, target) if fullname in watcher.names else None
                if spec is not None:
                    return spec
        if self.mode == "watching":
            return None
        if fullname in WATCHED:
            spec = real_spec(fullname, path, target)
            return None if spec is None else activating(spec, None)
        if self.mode == "observing":
            return None
        work = sys.modules.get(ACTIVATION)
        return None if work is None else work.waits_for_activation(self, fullname, path, target)

    def watch(self, watcher: "Any", name: str) -> None:
        """Have ``watcher`` answer re-executions of module ``name``: on ``sys.meta_path`` from now on."""
        if not any(w is watcher for w in self.watchers):
            self.watchers = [*self.watchers, watcher]
        self.again = self.again | {name}
        if not self.on_meta_path():
            sys.meta_path.insert(0, self)
            if self.mode == "retired":
                self.mode = "watching"

    def on_meta_path(self) -> bool:
        return any(finder is self for finder in sys.meta_path)

    def hooked(self) -> bool:
        """The start-up hook is in place: this observer, or the placeholder standing in for it."""
        return any(is_hook(finder) for finder in sys.meta_path)

    def take_over(
        self, fullname: str, path: "Sequence[str] | None" = None, target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        """The placeholder's ``find_spec`` for the first watched name: observe from now on (unless
        switched off or done: the placeholders just leave) and answer for ``fullname``."""
        self.start()
        return (self.find_spec if self.on_meta_path() else real_spec)(fullname, path, target)

    def start(self) -> None:
        """Observe unless switched off or done, else drop the placeholders (also the PEP 829 ``.start``
        entry point). Idempotent, silent."""
        try:
            if flag(os.environ.get("VERL_NPU_AUTOPATCH", "")) is False or self.mode in ("retired", "watching"):
                _leave_meta_path(_placeholder)
            else:
                self.observe()
        except Exception:  # start-up code never raises; the process runs unobserved
            pass

    def observe(self) -> None:
        """On ``sys.meta_path`` once, in the first placeholder's place (an import iterating over the
        list sees one or the other), else first; the placeholders leave."""
        if not self.on_meta_path():
            index = next((i for i, finder in enumerate(sys.meta_path) if _placeholder(finder)), None)
            if index is None:
                sys.meta_path.insert(0, self)
            else:
                sys.meta_path[index] = self
        _leave_meta_path(_placeholder)
        if self.mode not in ("guarding", "resuming"):
            self.mode = "observing"

    def wake(self, trigger: str) -> None:
        """Watched package ``trigger`` starts loading in this thread: guard (unless already guarding)."""
        if self.on_meta_path() and self.mode != "guarding":
            self.trigger = trigger
            self.guard(get_ident())

    def guard(self, activator: int, packages: "Iterable[str] | None" = None) -> None:
        """Activation began on thread ``activator``: guard every module until the catalog is known
        (``packages`` is ``None``), then the watched packages plus ``packages``."""
        try:
            _activation_module()  # the guarding rule and the fork handler live there: loaded first
            if not OBSERVER.at_fork and hasattr(os, "register_at_fork"):
                OBSERVER.at_fork = True  # once per process, when a first activation begins
                os.register_at_fork(after_in_child=_after_fork_in_child)
            self.observe()
            self.activator = activator
            self.gated = None if packages is None else WATCHED | frozenset(packages)
            self.mode = "guarding"
        except Exception:  # unguarded is the worst case; an import must never fail here
            pass

    def retire(self) -> None:
        """Activation is over or decided against: ``watching`` while fixes went in, else off ``sys.meta_path``."""
        self.gated, self.activator, self.trigger = WATCHED, None, ""
        if self.again and self.on_meta_path():
            self.mode = "watching"
            return
        try:
            _leave_meta_path(lambda finder: finder is self)
        except Exception:  # start-up code never raises; the observer then answers None for good
            pass
        self.mode = "retired"

    def retire_inactive(self, name: str) -> None:
        """The import of watched package ``name`` found this host inactive: remember it and retire."""
        self.inactive_trigger = self.inactive_trigger or name
        self.retire()

    def resume_observing(self, hooked: bool) -> None:
        """An activation was abandoned: stop guarding; if the start-up hook was in place (``hooked``),
        the next import of a watched package, or of one of its modules, activates."""
        self.retire()
        if self.mode == "retired":
            self.mode = "placeholder"
        if hooked:
            self.mode = "resuming"
            self.observe()


def _after_fork_in_child():
    getattr(sys.modules.get(ACTIVATION), "after_fork_in_child", lambda: None)()


def activating(spec, waits_for):
    """``spec`` with an activating loader (``waits_for``: ``None`` for a watched package, which
    decides; else the watched package whose activation the module waits for)."""
    loader = spec.loader
    if loader is None and spec.submodule_search_locations is not None:
        loader = _namespace_loader(spec)  # a namespace package (no __init__.py)
    if loader is not None and hasattr(loader, "exec_module"):
        spec.loader = ActivatingLoader(loader, waits_for)
    return spec


def real_spec(fullname, path, target):
    """The spec from the finders after ours on ``sys.meta_path``: those before were asked already,
    and one that chains (APM agents, coverage) would ask us again. A finder wrapping ours (Cirq's
    import test wraps each one) that asks us again in this look-up gets ``None``, as if we were absent."""
    asking = (get_ident(), fullname)
    if asking in _ASKING:
        return None
    _ASKING.add(asking)
    try:
        finders = list(sys.meta_path)
        first = next((index for index, finder in enumerate(finders) if is_hook(finder)), -1)
        for finder in finders[first + 1 :]:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None or is_hook(finder) else find(fullname, path, target)
            if spec is not None:
                return spec
        return None
    finally:
        _ASKING.discard(asking)


#: ``(thread, name)`` of each :func:`real_spec` look-up under way.
_ASKING: "set[tuple[int, str]]" = set()


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


def _activation_module():
    """:data:`ACTIVATION`, imported from this file's own package under its module lock, never from a
    namesake found first on ``sys.path`` (a user's script ``verl_npu_autopatch.py``)."""
    package = ACTIVATION.partition(".")[0]
    try:
        bootstrap = sys.modules["_frozen_importlib"]
        with bootstrap._ModuleLockManager(package):
            if package not in sys.modules:
                home = os.path.dirname(__file__)  # the wheel's root, or bootstrap/ in the package
                for _ in range(__name__.count(".")):  # verl_npu_autopatch.bootstrap.startup: up two
                    home = os.path.dirname(home)
                finder = sys.modules["_frozen_importlib_external"].PathFinder
                bootstrap._load_unlocked(finder.find_spec(package, [home]))
    except Exception:  # the import system's private names changed: the import below finds it on sys.path
        pass
    __import__(ACTIVATION)  # waits for another thread importing it
    return sys.modules[ACTIVATION]


class ActivatingLoader:
    """Wraps a watched package's (or a guarded module's) loader; other attributes pass through."""

    def __init__(self, loader, waits_for=None):
        self.loader = loader
        self.waits_for = waits_for
        self.inactive = False  # this host needs no engine: load as if we were not here
        self.broken = False  # the package cannot be imported: likewise

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        """Decide, for a watched package, whether this host is inactive, before the module is in ``sys.modules``."""
        if self.waits_for is None and plainly_inactive():
            self.inactive = True
            OBSERVER.retire_inactive(spec.name)
        else:
            try:
                work = _activation_module()
            except Exception:  # a broken install: the observer leaves, the package loads untouched
                OBSERVER.retire()
                self.broken = True
            else:
                return work.create_module(self, spec)
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        """Run the real loader (through ``activation`` unless inactive or broken); if the package
        raises, this frame leaves the traceback."""
        try:
            if self.inactive or self.broken:
                module.__loader__ = self.loader
                if getattr(module, "__spec__", None) is not None:
                    module.__spec__.loader = self.loader
                return self.loader.exec_module(module)
            return _activation_module().exec_module(self, module)
        except BaseException as exc:
            unframed(exc, ActivatingLoader.exec_module.__code__)
            raise


def unframed(exc, code):
    """Take the frame running ``code`` off the head of ``exc``'s traceback: a failing upstream import
    shows only its own frames (Python 3.10 re-raises the traceback it caught, frame included)."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is code:
        exc.__traceback__ = tb.tb_next


def is_hook(finder):
    """``finder`` is the observer or a placeholder (finders that look a name up for us skip both)."""
    return _marked(finder, "verl_npu_autopatch_observer") or _marked(finder, PLACEHOLDER)


def _placeholder(finder):
    return _marked(finder, PLACEHOLDER)


def _marked(finder, name):
    try:
        return getattr(finder, name, False) is True
    except Exception:  # another's finder whose __getattr__ raises more than AttributeError: not ours
        return False


def _leave_meta_path(leaving):
    """Drop the finders ``leaving`` picks, by a new list: removing from the one another thread's
    import iterates over would make it skip the next finder ("No module named ...")."""
    if any(leaving(finder) for finder in sys.meta_path):
        sys.meta_path = [finder for finder in sys.meta_path if not leaving(finder)]


#: The process's one observer (and its engine) is kept by ``sys``, which never leaves: it survives
#: this module leaving ``sys.modules`` and a fresh copy executing (``mock.patch.dict``, ``reload``).
ANCHOR = "_verl_npu_autopatch_observer"
OBSERVER: Observer = getattr(sys, ANCHOR, None) or Observer()
setattr(sys, ANCHOR, OBSERVER)
take_over, install_observer = OBSERVER.take_over, OBSERVER.start

# One module object under both names: the root module registers itself under the package's name;
# the package's copy, imported first, is the one module under the root's (a race's winner is kept).
if __name__ == NAME:
    sys.modules.setdefault("verl_npu_autopatch.bootstrap.startup", sys.modules[NAME])
else:
    sys.modules[__name__] = sys.modules.setdefault(NAME, sys.modules[__name__])
