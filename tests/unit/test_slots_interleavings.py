"""The slots' lock against what runs beside it: hand-over calls that run user code, and a revert or a
re-check that another thread's decision interleaves with (found by review of the engine's merge)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import FrameType

import pytest

from verl_npu_autopatch.authoring.patching import mark, set_attribute
from verl_npu_autopatch.authoring.spec import Patch, Site, Target
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.lifecycle import Engine

BOX = "class Box:\n    def value(self):\n        return 1\n"


def plus_one(name: str, module: str, **kwargs) -> Patch:
    def fix(site: Site):
        original = site.value
        return set_attribute(site.owner, site.attribute, mark(lambda self: original(self) + 1, site.patch.name))

    return Patch(name, "adds one", (Target.parse(f"{module}:Box.value"),), fix, device="any", **kwargs)


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    names = [f"interleaving_target_{index}" for index in range(2)]
    for name in names:
        (tmp_path / f"{name}.py").write_text(BOX)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield names
    for name in names:
        sys.modules.pop(name, None)


def test_reapply_asks_when_without_the_slots_lock_and_rechecks_after(modules: list[str]) -> None:
    # ``when`` is the caller's code: it may import a module whose post-import hook needs the slots'
    # lock in another thread (a deadlock while the lock was held around it)
    engine = Engine([plus_one("unit.a", modules[0])], Config(device="npu"))
    engine.activate("unit")
    module = importlib.import_module(modules[0])
    module.Box.value = lambda self: 10
    held: list[bool] = []

    def when(value: object) -> bool:
        held.append(engine.slots.lock._is_owned())
        return True

    assert engine.hand_over.reapply("unit.a", when) is True
    assert held == [False] and module.Box().value() == 11

    module.Box.value = lambda self: 20

    def handing_over(value: object) -> bool:  # the slot changes between the look-up and the re-apply
        engine.hand_over.yield_to("unit.a", "someone")
        return True

    assert engine.hand_over.reapply("unit.a", handing_over) is False
    assert engine.report()["unit.a"].state == "yielded" and module.Box().value() == 20


def test_displaced_records_are_rechecked_before_the_yields_that_read_them(modules: list[str]) -> None:
    def detector(site: Site) -> str:
        record = site.handover.record("unit.b") if site.handover is not None else None
        return f"someone (unit.b is {record.state if record else None})"

    first = plus_one("unit.a", modules[0], yields_to=(detector,))
    engine = Engine([first, plus_one("unit.b", modules[1])], Config(device="npu"))
    engine.activate("unit")
    second = importlib.import_module(modules[1])
    importlib.import_module(modules[0])
    assert engine.report()["unit.a"].reason == "target owned by someone (unit.b is applied)"
    second.Box.value = lambda self: 42  # another owner takes unit.b's target
    report = engine.report()
    assert report["unit.b"].state == "superseded"
    assert report["unit.a"].reason == "target owned by someone (unit.b is superseded)"


def test_revert_reads_what_was_installed_under_the_lock(modules: list[str]) -> None:
    # revert() decides "displaced: the live owner's" from the slot's footprint; read before the lock,
    # a re-apply finishing meanwhile (then wrapped by another owner) was undone and called reverted
    engine = Engine([plus_one("unit.a", modules[0])], Config(device="npu"))
    engine.activate("unit")
    module = importlib.import_module(modules[0])
    slots = engine.slots
    slot = slots["unit.a"]
    module.Box.value = lambda self: 5
    with slots.lock:  # as reapply() leaves it: released, pending, about to apply afresh
        slot.release()
        slot.record.state = "pending"

    def meanwhile() -> None:  # another thread: the re-apply ends, another owner wraps our fix
        slots.apply("unit.a", module)
        ours = module.Box.__dict__["value"]
        module.Box.value = lambda self: ours(self) * 10
        assert engine.report()["unit.a"].state == "superseded"

    fired: list[int] = []

    def tracer(frame: FrameType, event: str, arg: object):
        if frame.f_code is not type(slots).revert.__code__:
            return None

        def line(frame: FrameType, event: str, arg: object):
            names = frame.f_locals
            if event == "line" and not fired and "record" in names and "displaced" not in names:
                fired.append(frame.f_lineno)  # the loop's first slot, before its decision
                meanwhile()
            return line

        return line

    sys.settrace(tracer)
    try:
        done = engine.revert()
    finally:
        sys.settrace(None)
    assert fired and done == []
    assert engine.report()["unit.a"].state == "superseded" and module.Box().value() == 60
