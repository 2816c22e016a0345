"""The engine's post-import hooks: one wrapt hook per target module, and the modules that were
still executing when their hook was due (another thread's, or the package whose import woke the
engine), handled when they finish, or hooked again when their import failed; and what the engine reads of
the import system while it activates: its deadlock bookkeeping (:func:`blocked_on_us`) and the
depth of the stack (:func:`stack_depth`)."""

from __future__ import annotations

import _thread
import sys

from verl_npu_autopatch.engine import log

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from types import ModuleType

__all__ = ["Hooks", "blocked_on_us", "stack_depth"]


class Hooks:
    """Which modules have a post-import hook calling ``on_import``, and which were deferred.

    ``strict_error`` is the exception type ``on_import`` raises in strict mode (the engine's
    ``PatchError``): registering a hook on a module already imported runs it at once."""

    def __init__(self, on_import: Callable[[ModuleType], None], strict_error: type[Exception]) -> None:
        self._on_import = on_import
        self._strict_error = strict_error
        self._lock = _thread.RLock()  # held only briefly, never across imports
        self._hooked: set[str] = set()  # modules with a post-import hook
        self._deferred: set[str] = set()  # modules still executing when their hook was due

    def after_fork(self) -> None:
        """In the child of ``os.fork()``: the lock may be held by a thread that is not there."""
        self._lock = _thread.RLock()

    def register(self, wanted: Iterable[str]) -> None:
        """Hook every module of ``wanted`` not hooked yet. A module already imported is handled
        at once; one still executing is deferred (see :meth:`loaded` and :meth:`catch_up`)."""
        import wrapt

        from verl_npu_autopatch.engine.decision import initializing

        with self._lock:
            modules = [module for module in wanted if module not in self._hooked]
        errors = []
        for module in modules:
            if initializing(sys.modules.get(module)):
                with self._lock:
                    self._deferred.add(module)
                    self._hooked.add(module)
                continue
            log.logger().debug("post-import hook on %s", module)
            try:
                wrapt.register_post_import_hook(self.notify, module)
            except self._strict_error as error:
                errors.append(error)
            with self._lock:  # one by one: an interrupted activation registers the rest later
                self._hooked.add(module)
        if errors:
            raise errors[0]

    def notify(self, module: ModuleType) -> None:
        """The post-import hook: ``on_import(module)``; interrupted (Ctrl-C while a fix goes in),
        the import under way fails, and its retry is hooked (:meth:`interrupted`)."""
        try:
            self._on_import(module)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # not a strict-mode PatchError: Ctrl-C, SystemExit
                self.interrupted(module)
            raise

    def forget_imported(self) -> None:
        """An activation was abandoned: the deferred modules and those imported already (whose
        hook fired, or ran at registration) are to be hooked afresh; hooks still waiting stay."""
        with self._lock:
            self._hooked -= self._deferred | {name for name in self._hooked if name in sys.modules}
            self._deferred.clear()

    def interrupted(self, module: ModuleType) -> None:
        """Applying the fixes of ``module`` was interrupted (``KeyboardInterrupt``): if its import
        is under way, that import fails now; hook its retry. (A module imported already is hooked
        afresh by the next activation: :meth:`forget_imported`.)"""
        from verl_npu_autopatch.engine.decision import initializing

        name = getattr(module, "__name__", "")
        if not name or not initializing(sys.modules.get(name)):
            return
        with self._lock:
            self._deferred.discard(name)
            self._hooked.add(name)
        del sys.modules[name]  # as the import system does next; wrapt hooks only what is not loaded
        self._hook_later([name])

    def loaded(self, name: str) -> None:
        """Deferred module ``name`` finished executing; the engine handles it now."""
        with self._lock:
            self._deferred.discard(name)

    def failed(self, module: ModuleType) -> None:
        """A module deferred at registration raised while executing (its import fails, and may
        be retried): hook its next import, as if it had never been imported."""
        name = module.__name__
        with self._lock:
            if name not in self._deferred:
                return
            self._deferred.discard(name)
        if sys.modules.get(name) is module:
            del sys.modules[name]  # as the import system does next; wrapt hooks only what is not loaded
        self._hook_later([name])

    def _hook_later(self, names: list[str]) -> None:
        """Post-import hooks on deferred modules whose import failed (no longer in ``sys.modules``)."""
        if not names:
            return  # e.g. ``settle`` on an engine that never activated: wrapt is not needed
        import wrapt

        for name in names:
            log.logger().debug("post-import hook on %s (its import failed)", name)
            wrapt.register_post_import_hook(self.notify, name)

    def catch_up(self) -> None:
        """Handle deferred modules that have finished executing since, and hook those whose
        import failed meanwhile."""
        if not self._deferred:
            return
        from verl_npu_autopatch.engine.decision import initializing

        with self._lock:
            ready = [m for m in self._deferred if m in sys.modules and not initializing(sys.modules[m])]
            failed = [m for m in self._deferred if m not in sys.modules]
            self._deferred.difference_update(ready + failed)
        self._hook_later(failed)
        for name in ready:
            self._on_import(sys.modules[name])


def blocked_on_us(activator: int) -> bool:
    """Whether thread ``activator`` waits, through a chain of module locks, for one this thread
    holds (read from the import system's own deadlock bookkeeping, ``_blocking_on``; ``False``
    where it is not there): an import held for the activation must then go on, or deadlock."""
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


def stack_depth() -> int:
    """How many frames deep the caller is (an activation that ran out of stack is retried only
    from a shallower one)."""
    frame, depth = sys._getframe(1), 1
    while frame.f_back is not None:
        frame, depth = frame.f_back, depth + 1
    return depth
