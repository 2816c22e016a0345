"""The per-patch decision pipeline as a function of its inputs: no engine, no wrapt, no hooks.
Each test hands ``decision.run`` a patch, its variants, a module and a configuration and reads
the outcome; one runs it in a child interpreter where wrapt cannot be imported."""

from __future__ import annotations

import itertools
import sys
import types

import pytest

from tests.support.children import run_json
from verl_npu_autopatch.authoring.patching import mark, set_attribute
from verl_npu_autopatch.authoring.spec import Patch, Reach, Target, fixed_upstream, unsupported
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.decision import Outcome, run

_counter = itertools.count()
CONFIG = Config(device="npu")


@pytest.fixture
def module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A fresh module ``pipeline_target_N`` in ``sys.modules`` with ``Layer.forward``/``legacy``."""
    module = types.ModuleType(f"pipeline_target_{next(_counter)}")

    class Layer:
        def forward(self) -> str:
            return "upstream"

        def legacy(self) -> str:
            return "upstream legacy"

    module.Layer = Layer
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def plus_ours(site):
    original = site.value
    return set_attribute(site.owner, site.attribute, mark(lambda self: f"ours+{original(self)}", site.patch.name))


def patch_on(*targets: str, **kwargs) -> Patch:
    targets_ = tuple(Target.parse(t) for t in targets)
    return Patch("pipe.test", "a test patch", targets_, plus_ours, device="any", **kwargs)


def decide(patch: Patch, module: types.ModuleType | None, **kwargs) -> Outcome:
    return run(patch, patch.targets, {}, module, kwargs.pop("config", CONFIG), **kwargs)


def test_applies_on_the_first_live_variant_and_returns_its_undo(module: types.ModuleType) -> None:
    patch = patch_on(f"{module.__name__}:Layer.forward", f"{module.__name__}:Layer.legacy")
    outcome = decide(patch, module)
    assert (outcome.state, outcome.reason, str(outcome.target)) == (
        "applied",
        "fix installed",
        f"{module.__name__}:Layer.forward",
    )
    assert outcome.site.owner is module.Layer and outcome.site.attribute == "forward"
    assert module.Layer().forward() == "ours+upstream" and module.Layer().legacy() == "upstream legacy"
    outcome.undo()
    assert module.Layer().forward() == "upstream"


def test_a_variant_its_check_rejects_hands_over_to_the_next(module: types.ModuleType) -> None:
    def check(site):
        return unsupported("a newer forward", "the old one") if site.attribute == "forward" else None

    patch = patch_on(f"{module.__name__}:Layer.forward", f"{module.__name__}:Layer.legacy", check=check)
    outcome = decide(patch, module)
    assert outcome.state == "applied" and str(outcome.target) == f"{module.__name__}:Layer.legacy"
    assert outcome.reason == (
        f"fix installed on variant 2 of 2 ({module.__name__}:Layer.legacy); "
        "passed over: expected a newer forward; found the old one"
    )
    assert list(outcome.rejected.values()) == ["expected a newer forward; found the old one"]
    assert module.Layer().legacy() == "ours+upstream legacy" and module.Layer().forward() == "upstream"


def test_waits_for_a_module_to_come_and_concludes_once_it_is_absent() -> None:
    name = f"pipeline_missing_{next(_counter)}"
    patch = patch_on(f"{name}:Layer.forward")
    waiting = decide(patch, None)
    assert (waiting.state, waiting.target) == ("pending", None)
    absent = decide(patch, None, absent={name})
    assert absent.state == "unsupported"
    assert absent.reason == f"expected {name}:Layer.forward; found {name}:Layer.forward (module {name} does not exist)"


def test_a_module_under_a_subpackage_that_cannot_exist_is_absent(module: types.ModuleType) -> None:
    """The parent package is imported; the subpackage holding the variant is not there (a release
    that has not moved the code yet), so the variant cannot come either."""
    module.__path__ = []  # type: ignore[attr-defined]  (a package holding no submodule)
    moved = f"{module.__name__}.nowhere.deeper"
    outcome = decide(patch_on(f"{moved}:Layer.forward"), None)
    assert outcome.state == "unsupported"
    assert outcome.reason.endswith(f"(module {moved} does not exist)")
    waiting = decide(patch_on(f"pipeline_unimported_{next(_counter)}.sub:Layer.forward"), None)
    assert waiting.state == "pending", "a top-level package not imported yet may still come"


def test_missing_attribute_names_the_first_part_not_there(module: types.ModuleType) -> None:
    outcome = decide(patch_on(f"{module.__name__}:Layer.gone.deeper"), module)
    assert outcome.state == "unsupported"
    assert outcome.reason.endswith("(Layer (type) has no attribute 'gone')")


def test_yields_to_an_owner_a_detector_recognises_without_fixing(module: types.ModuleType) -> None:
    patch = patch_on(f"{module.__name__}:Layer.forward", yields_to=(lambda site: "someone else",))
    outcome = decide(patch, module)
    assert (outcome.state, outcome.reason, outcome.undo) == ("yielded", "target owned by someone else", None)
    assert module.Layer().forward() == "upstream"


def test_our_fix_already_in_place_is_applied_without_an_undo(module: types.ModuleType) -> None:
    patch = patch_on(f"{module.__name__}:Layer.forward")
    first = decide(patch, module)
    again = decide(patch, module)
    assert again.state == "applied" and again.reason.startswith("already in place (")
    assert again.undo is None and again.site is not None
    assert module.Layer().forward() == "ours+upstream"  # not wrapped twice
    first.undo()


def test_a_fix_installed_elsewhere_that_says_it_is_in_place_is_applied_without_an_undo(
    module: types.ModuleType,
) -> None:
    registry: dict[str, object] = {}  # where the fix installs: the target stays upstream's, unmarked

    def register(site):
        registry[site.owner.__name__] = site.owner
        return lambda: registry.clear()

    patch = Patch(
        "pipe.test", "a test patch", (Target.parse(f"{module.__name__}:Layer.forward"),), register,
        reach=Reach(in_place=lambda site: site.owner.__name__ in registry),
    )  # fmt: skip
    first = decide(patch, module)
    assert first.state == "applied" and first.undo is not None and registry == {"Layer": module.Layer}
    again = decide(patch, module)
    assert (again.state, again.undo) == ("applied", None) and again.reason.startswith("already in place (")
    first.undo()
    assert decide(patch, module).undo is not None  # no longer in place: fixed again


def test_a_verdict_other_than_apply_is_the_outcome(module: types.ModuleType) -> None:
    patch = patch_on(f"{module.__name__}:Layer.forward", check=lambda site: fixed_upstream("upstream has it"))
    outcome = decide(patch, module)
    assert (outcome.state, outcome.reason) == ("fixed-upstream", "upstream has it")
    assert module.Layer().forward() == "upstream"


def test_a_step_that_raises_is_a_failed_outcome_naming_it(module: types.ModuleType) -> None:
    def fix(site):
        raise ValueError("boom")

    patch = Patch("pipe.fails", "raises", (Target.parse(f"{module.__name__}:Layer.forward"),), fix, device="any")
    outcome = decide(patch, module)
    assert (outcome.state, outcome.reason, outcome.stage) == ("failed", "fix raised ValueError: boom", "fix")
    assert isinstance(outcome.error, ValueError) and str(outcome.target) == f"{module.__name__}:Layer.forward"


def test_npu_device_patch_is_gated_without_a_visible_device(module: types.ModuleType) -> None:
    patch = Patch("pipe.device", "needs a device", (Target.parse(f"{module.__name__}:Layer.forward"),), plus_ours)
    patch = Patch(**{**patch.__dict__, "device": "npu-device"})
    outcome = decide(patch, module, config=Config(device="auto"), npu_visible=lambda: False)
    assert (outcome.state, outcome.reason) == ("gated", "needs a visible NPU device")
    assert decide(patch, module, config=Config(device="auto"), npu_visible=lambda: True).state == "applied"


def test_runs_where_wrapt_cannot_be_imported() -> None:
    code = """
import json, sys, types
sys.modules["wrapt"] = None  # any "import wrapt" now raises ImportError
from verl_npu_autopatch.engine.decision import run
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.authoring.patching import mark, set_attribute
from verl_npu_autopatch.authoring.spec import Patch, Target

module = types.ModuleType("no_wrapt_target")
class Layer:
    def forward(self):
        return 1
module.Layer = Layer
sys.modules[module.__name__] = module

def fix(site):
    original = site.value
    return set_attribute(site.owner, site.attribute, mark(lambda self: original(self) + 10, site.patch.name))

patch = Patch("pipe.nowrapt", "adds ten", (Target.parse("no_wrapt_target:Layer.forward"),), fix, device="any")
outcome = run(patch, patch.targets, {}, module, Config(device="npu"))
print(json.dumps([outcome.state, outcome.reason, Layer().forward(), sys.modules["wrapt"] is None]))
"""
    assert run_json(sys.executable, code, fixtures=False) == ["applied", "fix installed", 11, True]
