"""The start-up observer as an object (in-process): its modes, one start-up module per process, and
the engine driving the observer it is given (the process-wide one the live ``OBSERVER``, any
other a null observer)."""

from __future__ import annotations

import _thread
import sys
import threading
from collections.abc import Iterable
from typing import Any

import pytest

from verl_npu_autopatch.bootstrap import startup
from verl_npu_autopatch.engine import lifecycle as engine
from verl_npu_autopatch.engine.config import Config


class RecordingObserver(engine.NullObserver):
    """Does nothing, like the null observer, but records what the engine asks of it."""

    def __init__(self, hooked: bool = True) -> None:
        self.calls: list[tuple[object, ...]] = []
        self._hooked = hooked

    def hooked(self) -> bool:
        self.calls.append(("hooked",))
        return self._hooked

    def guard(self, activator: int, packages: Iterable[str] | None = None) -> None:
        self.calls.append(("guard", activator, None if packages is None else sorted(packages)))

    def retire(self) -> None:
        self.calls.append(("retire",))


def test_one_start_up_module_and_one_observer_in_this_process() -> None:
    # the runner has the wheel installed: one module object under the root's name and the package's
    assert sys.modules["verl_npu_autopatch.bootstrap.startup"] is sys.modules[startup.NAME]
    assert engine.engine().observer is startup.OBSERVER  # the composition root's injection


def test_an_engine_drives_the_observer_it_is_given() -> None:
    live = startup.OBSERVER.mode
    observer = RecordingObserver()
    active = engine.Engine([], Config(device="npu"), observer=observer)
    active.activate("api")
    me = _thread.get_ident()
    assert active.status == "active" and active.observer is observer
    # guard everything, then (catalog known, here empty) the watched packages only; retire at the end
    assert observer.calls == [("hooked",), ("guard", me, None), ("guard", me, []), ("retire",)]
    inactive = RecordingObserver()
    engine.Engine([], Config(device="none"), observer=inactive).activate("api")
    assert inactive.calls == [("hooked",), ("retire",)]
    assert startup.OBSERVER.mode == live  # the process's observer was never touched


def test_an_engine_given_no_observer_gets_a_null_one(monkeypatch: pytest.MonkeyPatch) -> None:
    live = startup.OBSERVER.mode
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = list(sys.meta_path)
    plain = engine.Engine([], Config(device="npu"))
    plain.activate("api")
    assert type(plain.observer) is engine.NullObserver and plain.status == "active"
    assert sys.meta_path == before and startup.OBSERVER.mode == live


def test_the_observer_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not startup.is_hook(f)])
    observer = startup.Observer()
    assert observer.mode == "placeholder" and not observer.on_meta_path()
    observer.observe()
    assert observer.mode == "observing" and sys.meta_path[0] is observer and observer.hooked()
    assert observer.find_spec("json") is None  # a miss: no guarding
    observer.retire()
    assert observer.mode == "retired" and not observer.on_meta_path()
    observer.take_over("vllm")  # a .pth processed again after the observer left: nothing comes back
    assert observer.mode == "retired" and not observer.on_meta_path()
    observer.resume_observing(hooked=False)  # an abandoned activation without the start-up hook
    assert observer.mode == "placeholder" and not observer.on_meta_path()
    observer.resume_observing(hooked=True)  # resuming: a watched package's module activates too
    assert observer.mode == "resuming" and observer.on_meta_path()
    assert observer.find_spec("json") is None
    observer.retire_inactive("transformers")
    assert (observer.mode, observer.inactive_trigger, observer.on_meta_path()) == ("retired", "transformers", False)


def test_the_guarding_mode_holds_other_threads_modules_of_the_gated_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not startup.is_hook(f)])
    observer = startup.Observer()
    observer.guard(_thread.get_ident(), ["pytest"])  # this thread activates; pytest is a target package
    try:
        assert observer.mode == "guarding" and sys.meta_path[0] is observer
        assert observer.find_spec("pytest") is None  # the activating thread is never held
        seen: list[Any] = []
        worker = threading.Thread(
            target=lambda: seen.extend([observer.find_spec("pytest"), observer.find_spec("json")])
        )
        worker.start()
        worker.join()
        held, other = seen
        assert type(held.loader).__name__ == "ActivatingLoader" and held.loader.waits_for == "pytest"
        assert other is None  # not a gated package
    finally:
        observer.retire()
    assert observer.mode == "retired" and not observer.on_meta_path()


def test_guarding_loads_the_module_that_holds_its_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    # an activation by activate() runs no activating loader, so nothing has loaded the module the
    # start-up module hands its work to (ACTIVATION), where the guarding rule lives: guard() loads it,
    # or other threads' imports of target packages would go through unheld
    import verl_npu_autopatch

    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not startup.is_hook(f)])
    monkeypatch.delitem(sys.modules, startup.ACTIVATION)
    monkeypatch.delattr(verl_npu_autopatch, "_activation", raising=False)
    observer = startup.Observer()
    observer.guard(_thread.get_ident(), ["pytest"])
    try:
        assert startup.ACTIVATION in sys.modules
        seen: list[Any] = []
        worker = threading.Thread(target=lambda: seen.append(observer.find_spec("pytest")))
        worker.start()
        worker.join()
        assert seen[0] is not None and seen[0].loader.waits_for == "pytest"
    finally:
        observer.retire()
