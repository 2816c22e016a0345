"""In-process checks of engine pieces that need no child interpreter: configuration parsing,
private engines on throw-away modules, and the undo rules of ``patching``."""

from __future__ import annotations

import logging
import weakref

import pytest

from verl_npu_autopatch.authoring.handover import HandOver
from verl_npu_autopatch.authoring.patching import mark, set_attribute
from verl_npu_autopatch.authoring.spec import Patch, Target
from verl_npu_autopatch.engine.config import Config, read_config
from verl_npu_autopatch.engine.lifecycle import Engine


def plus_one_patch(module: str, **kwargs) -> Patch:
    def fix(site):
        original = site.value
        return set_attribute(site.owner, site.attribute, mark(lambda self: original(self) + 1, site.patch.name))

    return Patch("unit.plus_one", "adds one", (Target.parse(f"{module}:Box.value"),), fix, device="any", **kwargs)


def test_read_config_defaults_and_values() -> None:
    config = read_config({})
    assert (config.enabled, config.device, config.strict, config.log_level) == (True, "auto", False, None)
    config = read_config(
        {
            "VERL_NPU_AUTOPATCH": "off",
            "VERL_NPU_AUTOPATCH_ENABLE": " a, b ,,",
            "VERL_NPU_AUTOPATCH_DISABLE": "c",
            "VERL_NPU_AUTOPATCH_DEVICE": "NPU",
            "VERL_NPU_AUTOPATCH_STRICT": "yes",
            "VERL_NPU_AUTOPATCH_LOG": "debug",
            "VERL_VLLM_ASCEND_GLM52_PATCH": "true",
        }
    )
    assert config.enabled is False and config.device == "npu" and config.strict is True
    assert config.enable == {"a", "b", "glm52"} and config.disable == {"c"} and config.log_level == "DEBUG"
    assert config.warnings == ()


def test_bad_values_warn_once_each_and_keep_defaults() -> None:
    config = read_config({"VERL_NPU_AUTOPATCH_DEVICE": "gpu", "VERL_VLLM_ASCEND_GLM52_PATCH": "sure"})
    assert config.device == "auto" and "glm52" not in config.enable
    device, legacy = config.warnings
    assert "VERL_NPU_AUTOPATCH_DEVICE='gpu'" in device and "accepted values: auto (default) / npu / none" in device
    assert legacy.startswith("VERL_VLLM_ASCEND_GLM52_PATCH='sure' is not understood; accepted values: 1 / true")


def test_yield_to_only_takes_pending_or_applied(module_name: str) -> None:
    engine = Engine([plus_one_patch(module_name, requires=("nosuchdist>=1",))], Config(device="npu"))
    engine.activate("unit")
    assert engine.report()["unit.plus_one"].state == "gated"
    assert engine.hand_over.yield_to("unit.plus_one", "someone") is False
    assert engine.report()["unit.plus_one"].state == "gated"


def test_yield_to_reverts_an_applied_patch(module_name: str) -> None:
    engine = Engine([plus_one_patch(module_name)], Config(device="npu"))
    engine.activate("unit")
    module = __import__(module_name)
    assert module.Box().value() == 2
    assert engine.hand_over.yield_to("unit.plus_one", "liger-kernel (apply_x)") is True
    record = engine.report()["unit.plus_one"]
    assert (record.state, record.reason) == ("yielded", "target handed to liger-kernel (apply_x)")
    assert module.Box().value() == 1


def test_yield_to_keeps_an_undo_that_raises_out_of_the_callers_way(
    module_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The hand-over runs inside the user's call (Liger's apply function): our undo raising is
    logged and recorded, never raised into it."""

    def fix(site):
        original = site.value
        set_attribute(site.owner, site.attribute, mark(lambda self: original(self) + 1, site.patch.name))

        def undo() -> None:
            raise RuntimeError("cannot undo")

        return undo

    patch = Patch("unit.bad_undo", "adds one", (Target.parse(f"{module_name}:Box.value"),), fix, device="any")
    engine = Engine([patch], Config(device="npu"))
    engine.activate("unit")
    module = __import__(module_name)
    assert module.Box().value() == 2
    with caplog.at_level(logging.ERROR, logger="verl_npu_autopatch"):
        assert engine.hand_over.yield_to("unit.bad_undo", "liger-kernel (apply_x)") is True
    record = engine.report()["unit.bad_undo"]
    assert (record.state, record.reason) == (
        "failed",
        "handing to liger-kernel (apply_x): undo raised RuntimeError: cannot undo",
    )
    (logged,) = [r for r in caplog.records if r.name == "verl_npu_autopatch" and r.levelno == logging.ERROR]
    assert "unit.bad_undo" in logged.getMessage() and logged.exc_info[0] is RuntimeError
    assert engine.revert() == []  # the undo is not tried again


def test_the_engine_hand_over_is_what_its_fixes_receive(module_name: str) -> None:
    """``site.engine`` is the engine's ``hand_over``, offering every ``HandOver`` method; ``record``
    is a copy."""
    seen = []

    def fix(site):
        seen.append(site.engine)
        return plus_one_patch(module_name).fix(site)

    patch = Patch("unit.hand_over", "adds one", (Target.parse(f"{module_name}:Box.value"),), fix, device="any")
    engine = Engine([patch], Config(device="npu"))
    engine.activate("unit")
    __import__(module_name)
    assert seen == [engine.hand_over]
    members = {n for n in vars(HandOver) if not n.startswith("_")}
    assert members == {"record", "note", "yield_to", "reapply"}
    assert all(callable(getattr(engine.hand_over, n)) for n in members)
    record = engine.hand_over.record("unit.hand_over")
    assert (record.state, record.reason) == ("applied", "fix installed")
    record.state = "changed by the caller"
    assert engine.records["unit.hand_over"].state == "applied" and engine.hand_over.record("nothing.here") is None


def test_the_hand_over_is_hashed_by_identity(module_name: str) -> None:
    """A plugin may keep state per engine keyed by its ``site.handover`` (at 9ca5749 a plain object;
    the store of slots it became, a dict, was unhashable: the fix raised and the patch failed)."""
    per_engine: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def fix(site):
        per_engine[site.handover] = site.patch.name
        return plus_one_patch(module_name).fix(site)

    patch = Patch("unit.keyed", "adds one", (Target.parse(f"{module_name}:Box.value"),), fix, device="any")
    engine, other = Engine([patch], Config(device="npu")), Engine([], Config(device="npu"))
    engine.activate("unit")
    __import__(module_name)
    assert (engine.report()["unit.keyed"].state, engine.report()["unit.keyed"].reason) == ("applied", "fix installed")
    assert per_engine.get(engine.hand_over) == "unit.keyed" and other.hand_over not in per_engine


def test_undo_never_clobbers_a_later_owner() -> None:
    class Owner:
        def method(self) -> str:
            return "upstream"

    original = Owner.__dict__["method"]
    undo = set_attribute(Owner, "method", lambda self: "ours")
    later = Owner.method = lambda self: "theirs"  # e.g. Liger-Kernel after us
    undo()
    assert Owner.__dict__["method"] is later
    undo2 = set_attribute(Owner, "method", lambda self: "ours again")
    undo2()
    assert Owner.__dict__["method"] is later and original is not later


def test_undo_removes_an_attribute_that_was_inherited() -> None:
    class Base:
        def method(self) -> str:
            return "base"

    class Child(Base):
        pass

    undo = set_attribute(Child, "method", lambda self: "ours")
    assert Child().method() == "ours"
    undo()
    assert "method" not in vars(Child) and Child().method() == "base"


def test_reapply_applies_afresh_over_another_owners_value(module_name: str) -> None:
    """``reapply``: a value another owner put over ours (verl <= 0.8 patching after our hooks
    ran) is decided and wrapped afresh when ``when`` holds; the new undo restores that value."""
    engine = Engine([plus_one_patch(module_name)], Config(device="npu"))
    engine.activate("unit")
    module = __import__(module_name)

    def theirs(self) -> int:
        return 10

    module.Box.value = theirs
    assert engine.hand_over.reapply("unit.plus_one", lambda value: False) is False
    assert engine.hand_over.reapply("nothing.here", lambda value: True) is False
    assert engine.hand_over.reapply("unit.plus_one", lambda value: value is theirs) is True
    assert module.Box().value() == 11
    assert engine.hand_over.record("unit.plus_one").state == "applied"
    assert engine.revert() == ["unit.plus_one"]
    assert module.Box.__dict__["value"] is theirs


def test_reapply_leaves_our_live_value_and_its_undo_alone(module_name: str) -> None:
    engine = Engine([plus_one_patch(module_name)], Config(device="npu"))
    engine.activate("unit")
    module = __import__(module_name)
    assert engine.hand_over.reapply("unit.plus_one", lambda value: True) is False  # ours is what runs
    assert (module.Box().value(), engine.revert()) == (2, ["unit.plus_one"])
    assert module.Box().value() == 1


def test_a_fix_found_in_place_is_still_watched_for_another_owner(module_name: str) -> None:
    """A second engine finds our fix in place (``already in place``): its record, too, says
    ``superseded`` once another owner replaces the target."""
    first = Engine([plus_one_patch(module_name)], Config(device="npu"))
    first.activate("unit")
    module = __import__(module_name)
    second = Engine([plus_one_patch(module_name)], Config(device="npu"))
    second.activate("unit")
    assert second.report()["unit.plus_one"].reason.startswith("already in place (")

    def theirs(self) -> int:
        return 10

    module.Box.value = theirs
    record = second.report()["unit.plus_one"]
    assert (record.state, record.reason) == ("superseded", f"replaced by {__name__}.{theirs.__qualname__}")


def test_strict_mode_errors_are_recognised_by_type_not_by_name() -> None:
    from verl_npu_autopatch.bootstrap import activation
    from verl_npu_autopatch.engine.lifecycle import PatchError

    class ImpostorError(RuntimeError):
        pass

    ImpostorError.__name__ = "PatchError"  # what a comparison of class names would take for strict mode
    assert activation._strict(PatchError("strict")) and not activation._strict(ImpostorError("not strict"))


def test_drop_orphans_forgets_only_new_submodules_whose_package_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from verl_npu_autopatch.engine.lifecycle import drop_orphans

    modules = {name: types.ModuleType(name) for name in ("old_pkg", "old_pkg.kept", "gone_before.sub")}
    monkeypatch.setattr(sys, "modules", dict(modules))
    known = len(sys.modules)
    for name in ("new_pkg", "new_pkg.sub", "cut_short.done", "cut_short.done.deeper", "old_pkg.new", ("a", "b")):
        sys.modules[name] = types.ModuleType(str(name))  # type: ignore[index]  # another's key may be no string
    drop_orphans(known)  # "cut_short" left sys.modules when its import failed: its submodules go with it
    kept = ["old_pkg", "old_pkg.kept", "gone_before.sub", "new_pkg", "new_pkg.sub", "old_pkg.new", ("a", "b")]
    assert list(sys.modules) == kept


def test_known_absent_passes_over_a_finder_raising_a_base_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    # a test's finder forbidding an import with pytest.fail (a BaseException) must not come out of our hook
    import sys

    from verl_npu_autopatch.engine.decision import known_absent

    class Forbidding:
        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            if name == "json.forbidden":
                raise SystemExit("no json.forbidden here")

    monkeypatch.setattr(sys, "meta_path", [Forbidding(), *sys.meta_path])
    assert known_absent("json.forbidden") is False and known_absent("json.nothere") is True
