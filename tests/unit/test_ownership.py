"""Records verified against the live attribute: ``superseded`` / ``yielded`` after the fact,
enclosing callables (``Reach.via``), honest ``revert()``, and ``importlib.reload``. Private
engines on throw-away modules, in process."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import itertools
import logging
import sys
import types
from pathlib import Path

import pytest

from verl_npu_autopatch.authoring.patching import chain, describe, mark, marked_by, set_attribute
from verl_npu_autopatch.authoring.spec import Patch, Reach, Target
from verl_npu_autopatch.cli.doctor import doctor_exit_code
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.lifecycle import Engine
from verl_npu_autopatch.engine.ownership import reached_through_target

_counter = itertools.count()

SOURCE = """
class Experts:
    def forward(self, x):
        return x + 1


class Block:
    def __init__(self):
        self.experts = Experts()

    def forward(self, x):
        return self.experts.forward(x) * 10


def helper(x):
    return x
"""


@pytest.fixture
def module_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh importable module ``own_target_N`` (an experts class reached through a block)."""
    name = f"own_target_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def other_owner(x):
    """Stands in for another package's replacement (verl's, say)."""
    return -1


def other_block_forward(self, x):
    """Another package's block forward that no longer calls ``self.experts``."""
    return x * 10


def recognise_other(site) -> str | None:
    return f"other ({describe(site.value)})" if site.value in (other_owner, other_block_forward) else None


def plus_hundred(site):
    original = site.value
    return set_attribute(site.owner, site.attribute, mark(lambda self, x: original(self, x) + 100, site.patch.name))


def experts_patch(module: str, **kwargs) -> Patch:
    return Patch(
        "own.experts",
        "adds a hundred to the experts",
        (Target(module, "Experts.forward"),),
        plus_hundred,
        device="any",
        **kwargs,
    )


def engine_for(*patches: Patch) -> Engine:
    engine = Engine(list(patches), Config(device="npu"))
    engine.activate("unit")
    return engine


def test_applied_then_replaced_by_an_unknown_owner_is_superseded(module_name: str) -> None:
    engine = engine_for(experts_patch(module_name))
    module = importlib.import_module(module_name)
    assert engine.report()["own.experts"].state == "applied"
    assert module.Block().forward(1) == 1020
    module.Experts.forward = lambda self, x: x  # someone else, after us
    record = engine.report()["own.experts"]
    assert record.state == "superseded"
    assert (
        record.reason
        == f"replaced by {__name__}.test_applied_then_replaced_by_an_unknown_owner_is_superseded.<locals>.<lambda>"
    )
    assert doctor_exit_code({"status": "active", "records": [record.to_dict()]}) == 1


def test_a_detector_raising_on_another_owners_proxy_leaves_it_superseded(module_name: str) -> None:
    # verl's detector read `__globals__` of the proxy, whose __getattr__ raised: the re-check gave
    # up and the record stayed `applied` while the proxy ran
    class Proxy:
        def __getattr__(self, name: str) -> None:
            raise RuntimeError(f"the proxy has no {name}")

        def __call__(self, this: object, x: int) -> int:
            return -x

    def reads_globals(site) -> str | None:
        return "verl" if getattr(site.value, "__globals__", {}).get("__name__") == "verl" else None

    engine = engine_for(experts_patch(module_name, yields_to=(reads_globals,)))
    module = importlib.import_module(module_name)
    assert engine.report()["own.experts"].state == "applied"
    module.Experts.forward = Proxy()
    assert module.Experts.forward(None, 1) == -1
    record = engine.report()["own.experts"]
    assert (record.state, record.reason) == ("superseded", f"replaced by {__name__}.Proxy")


def test_replaced_by_a_recognised_owner_is_yielded_and_revert_leaves_it(
    module_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_for(experts_patch(module_name, yields_to=(recognise_other,)))
    module = importlib.import_module(module_name)
    module.Experts.forward = other_owner
    record = engine.report()["own.experts"]
    assert (record.state, record.reason) == ("yielded", f"target owned by other ({__name__}.other_owner)")
    with caplog.at_level(logging.INFO, logger="verl_npu_autopatch"):
        assert engine.revert() == []
    assert module.Experts.__dict__["forward"] is other_owner  # the live owner is not clobbered
    assert engine.report()["own.experts"].state == "yielded"
    assert "own.experts: not reverted, the live target is not ours (yielded: target owned by other" in caplog.text


def test_revert_of_a_superseded_patch_changes_nothing(module_name: str) -> None:
    engine = engine_for(experts_patch(module_name))
    module = importlib.import_module(module_name)
    theirs = module.Experts.forward = lambda self, x: 0
    assert engine.revert("own.experts") == []
    assert module.Experts.__dict__["forward"] is theirs
    assert engine.report()["own.experts"].state == "superseded"


def test_our_value_back_in_place_is_applied_again(module_name: str) -> None:
    engine = engine_for(experts_patch(module_name))
    module = importlib.import_module(module_name)
    ours = module.Experts.__dict__["forward"]
    module.Experts.forward = lambda self, x: 0
    assert engine.report()["own.experts"].state == "superseded"
    module.Experts.forward = ours
    assert (engine.report()["own.experts"].state, engine.report()["own.experts"].reason) == ("applied", "fix installed")
    assert engine.revert() == ["own.experts"]
    assert module.Block().forward(1) == 20


def test_enclosing_callable_taken_after_us(module_name: str) -> None:
    via = (Target(module_name, "Block.forward"),)
    engine = engine_for(experts_patch(module_name, reach=Reach(via=via), yields_to=(recognise_other,)))
    module = importlib.import_module(module_name)
    assert engine.report()["own.experts"].state == "applied"
    module.Block.forward = other_block_forward  # no longer calls self.experts: ours never runs
    record = engine.report()["own.experts"]
    assert record.state == "yielded"
    assert (
        record.reason == f"target owned by other ({__name__}.other_block_forward) (only reached through Block.forward)"
    )
    assert marked_by(module.Experts.__dict__["forward"]) == "own.experts"  # installed, but not what runs


def test_enclosing_callable_taken_by_an_unknown_owner(module_name: str) -> None:
    engine = engine_for(experts_patch(module_name, reach=Reach(via=(Target(module_name, "Block.forward"),))))
    module = importlib.import_module(module_name)
    module.Block.forward = other_block_forward
    record = engine.report()["own.experts"]
    assert record.state == "superseded"
    assert record.reason == f"only reached through Block.forward, now {__name__}.other_block_forward"


def test_enclosing_callable_owned_before_us_is_yielded_at_apply(module_name: str) -> None:
    module = importlib.import_module(module_name)
    module.Block.forward = other_block_forward  # the other owner came first
    patch = experts_patch(
        module_name, reach=Reach(via=(Target(module_name, "Block.forward"),)), yields_to=(recognise_other,)
    )
    engine = engine_for(patch)  # the module is already imported: decided at activation
    record = engine.report()["own.experts"]
    assert (record.state, record.reason) == (
        "yielded",
        f"target owned by other ({__name__}.other_block_forward) (only reached through Block.forward)",
    )
    assert "forward" in vars(module.Experts) and marked_by(module.Experts.forward) is None


def test_reload_applies_the_fix_again(module_name: str) -> None:
    engine = engine_for(experts_patch(module_name))
    module = importlib.import_module(module_name)
    old_experts = module.Experts
    assert importlib.reload(module) is module
    assert module.Experts is not old_experts
    assert module.Block().forward(1) == 1020  # fixed on the re-executed class
    record = engine.report()["own.experts"]
    assert (record.state, record.reason) == ("applied", "fix installed; again after importlib.reload")
    assert module.__loader__ is module.__spec__.loader and type(module.__loader__).__name__ == "SourceFileLoader"
    assert engine.revert() == ["own.experts"]
    assert module.Block().forward(1) == 20


def test_module_replaced_in_sys_modules_is_superseded(module_name: str) -> None:
    engine = engine_for(experts_patch(module_name))
    importlib.import_module(module_name)
    sys.modules[module_name] = types.ModuleType(module_name)
    record = engine.report()["own.experts"]
    assert (record.state, record.reason) == ("superseded", "module reloaded")


def test_reload_the_watcher_does_not_see_is_superseded(module_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finder put ahead of our reload watcher answers the reload: the fix is not applied again,
    and the record says the module was reloaded."""
    engine = engine_for(experts_patch(module_name))
    module = importlib.import_module(module_name)
    monkeypatch.setattr(sys, "meta_path", [importlib.machinery.PathFinder, *sys.meta_path])
    importlib.reload(module)
    assert module.Block().forward(1) == 20
    record = engine.report()["own.experts"]
    assert (record.state, record.reason) == ("superseded", "module reloaded")
    assert engine.revert() == []


def test_a_declared_dict_entry_may_sit_on_a_class() -> None:
    from verl_npu_autopatch.authoring.patching import ABSENT
    from verl_npu_autopatch.engine.ownership import site_value

    module = types.ModuleType("site_value_target")
    module.TABLE = {"a": 1}
    module.Registry = type("Registry", (), {"_mapping": {"b": 2}})
    assert site_value(module, "TABLE[a]") == 1 and site_value(module, "Registry._mapping[b]") == 2
    assert site_value(module, "Registry._mapping[c]") is ABSENT and site_value(module, "Missing[a]") is ABSENT


def test_a_fix_reached_only_through_its_target_is_displaced_by_another_owner_there(module_name: str) -> None:
    """A fix that installs elsewhere (``helper``) but runs only through the target's upstream value
    (``reached_through_target``): another owner's value there displaces it, one of ours does not."""

    def fix(site):
        ours = mark(lambda x: x + 1, site.patch.name)
        return reached_through_target(set_attribute(site.module, "helper", ours))

    engine = engine_for(
        Patch("own.through", "helper, through forward", (Target(module_name, "Experts.forward"),), fix, device="any")
    )
    module = importlib.import_module(module_name)
    upstream = module.Experts.__dict__["forward"]
    assert (engine.report()["own.through"].state, module.helper(1)) == ("applied", 2)
    module.Experts.forward = mark(lambda self, x: x, "another.patch")  # one of ours: the fix still runs through it
    assert engine.report()["own.through"].state == "applied"
    module.Experts.forward = other_owner
    record = engine.report()["own.through"]
    assert (record.state, record.reason) == ("superseded", f"replaced by {__name__}.other_owner")
    module.Experts.forward = upstream
    assert (engine.report()["own.through"].state, engine.revert()) == ("applied", ["own.through"])
    assert module.helper(1) == 1


def test_a_further_declared_site_taken_by_a_recognised_owner_is_yielded(module_name: str) -> None:
    """``Reach.secondary``: the fix's value there replaced by one of our other patches keeps the record
    applied; by an owner a detector recognises, ``yielded`` naming the site."""

    def fix(site):
        undo = plus_hundred(site)
        return chain(set_attribute(site.module, "helper", mark(lambda x: -x, site.patch.name)), undo)

    patch = experts_patch(
        module_name, reach=Reach(secondary=(Target(module_name, "helper"),)), yields_to=(recognise_other,)
    )
    patch = dataclasses.replace(patch, fix=fix)
    engine = engine_for(patch)
    module = importlib.import_module(module_name)
    assert engine.report()["own.experts"].state == "applied"
    module.helper = mark(lambda x: x, "another.patch")
    assert engine.report()["own.experts"].state == "applied"
    module.helper = other_owner
    record = engine.report()["own.experts"]
    assert (record.state, record.reason) == (
        "yielded",
        f"target owned by other ({__name__}.other_owner) (also changes {module_name}:helper)",
    )


def test_an_enclosing_callable_holding_another_of_our_fixes_keeps_the_record(module_name: str) -> None:
    engine = engine_for(experts_patch(module_name, reach=Reach(via=(Target(module_name, "Block.forward"),))))
    module = importlib.import_module(module_name)
    original = module.Block.forward
    module.Block.forward = mark(lambda self, x: original(self, x), "another.patch")
    assert (engine.report()["own.experts"].state, module.Block().forward(1)) == ("applied", 1020)


def test_yielded_through_an_enclosing_callable_names_its_next_owner(module_name: str) -> None:
    def later_block_forward(self, x):
        return x

    def recognise(site) -> str | None:
        return {other_block_forward: "verl", later_block_forward: "liger"}.get(site.value)

    module = importlib.import_module(module_name)
    module.Block.forward = other_block_forward
    via = (Target(module_name, "Block.forward"),)
    engine = engine_for(experts_patch(module_name, reach=Reach(via=via), yields_to=(recognise,)))
    assert engine.report()["own.experts"].reason == "target owned by verl (only reached through Block.forward)"
    module.Block.forward = later_block_forward
    record = engine.report()["own.experts"]
    assert (record.state, record.reason) == ("yielded", "target owned by liger (only reached through Block.forward)")


def test_reverting_the_owner_a_patch_yielded_to_reverts_the_yielded_record(module_name: str) -> None:
    def recognise_first(site) -> str | None:
        return "own.experts" if marked_by(site.value) == "own.experts" else None

    second = dataclasses.replace(experts_patch(module_name), name="own.second", yields_to=(recognise_first,))
    engine = engine_for(experts_patch(module_name), second)
    module = importlib.import_module(module_name)
    assert engine.report()["own.second"].reason == "target owned by own.experts"
    assert engine.revert("own.experts") == ["own.experts"]
    record = engine.report()["own.second"]
    assert (record.state, record.reason) == ("reverted", "reverted with own.experts, which held its target")
    assert module.Block().forward(1) == 20


def test_a_note_stays_with_the_record_when_our_value_comes_back(module_name: str) -> None:
    engine = engine_for(experts_patch(module_name))
    module = importlib.import_module(module_name)
    engine.hand_over.note("own.experts", "kept beside liger")
    engine.hand_over.note("own.experts", "kept beside liger")  # once
    ours = module.Experts.__dict__["forward"]
    module.Experts.forward = other_owner
    assert engine.report()["own.experts"].state == "superseded"
    engine.hand_over.note("own.experts", "not while superseded")
    module.Experts.forward = ours
    record = engine.report()["own.experts"]
    assert (record.state, record.reason) == ("applied", "fix installed; kept beside liger")


def _foreign_forward(self, x):
    """Another owner's experts forward."""
    return -1


class _Unprintable:
    def __str__(self) -> str:
        raise ValueError("no text")


def _raising(site) -> str | None:
    if site.value is _foreign_forward:
        raise RuntimeError("a detector's bug")
    return None


def _unprintable(site) -> object:
    return _Unprintable() if site.value is _foreign_forward else None


@pytest.mark.parametrize("detector", [_raising, _unprintable], ids=["raises", "unprintable-answer"])
def test_a_detector_failing_at_recheck_does_not_keep_the_record_applied(module_name: str, detector) -> None:
    engine = engine_for(experts_patch(module_name, yields_to=(detector,)))
    module = importlib.import_module(module_name)
    assert engine.report()["own.experts"].state == "applied"
    module.Experts.forward = _foreign_forward  # another owner, after us; its detector fails on it
    record = engine.report()["own.experts"]
    assert module.Block().forward(1) == -10  # theirs runs
    if detector is _raising:
        assert (record.state, record.reason) == ("superseded", f"replaced by {__name__}._foreign_forward")
    else:  # recognised, named as well as its answer can be
        assert record.state == "yielded" and record.reason.startswith("target owned by <unprintable")
    assert engine.revert() == [] and module.Experts.__dict__["forward"] is _foreign_forward
