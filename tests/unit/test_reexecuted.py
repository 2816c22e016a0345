"""In-process checks of round 4 (issue 31): a private engine's target deleted from ``sys.modules``
and imported again, or replaced in ``sys.modules`` while importing; an interrupted fix; and the
CLI's ``--timeout`` values and first-screen log (the child-interpreter trials are in
``tests/reliability``)."""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import sys
import types

import pytest

from tests.unit.test_units import plus_one_patch
from verl_npu_autopatch.authoring.patching import mark, set_attribute
from verl_npu_autopatch.authoring.spec import Patch, Target
from verl_npu_autopatch.cli.doctor import LOG_LINES, first_screen
from verl_npu_autopatch.cli.help_text import seconds
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.lifecycle import Engine


def test_a_target_imported_afresh_is_patched_again(module_name: str) -> None:
    engine = Engine([plus_one_patch(module_name)], Config(device="npu"))
    engine.activate("unit")
    old = importlib.import_module(module_name)
    del sys.modules[module_name]
    fresh = importlib.import_module(module_name)
    record = engine.report()["unit.plus_one"]
    assert fresh is not old and (fresh.Box().value(), old.Box().value()) == (2, 2)
    assert (record.state, record.reason) == (
        "applied",
        "fix installed; again after a fresh import (it had left sys.modules)",
    )
    assert engine.revert() == ["unit.plus_one"] and (fresh.Box().value(), old.Box().value()) == (1, 1)


def test_revert_while_the_target_is_out_of_sys_modules_stops_watching_it(module_name: str) -> None:
    """Reverted while the patched module had left ``sys.modules`` (a test fixture dropping it):
    the fix on the old module object is undone and a later fresh import stays upstream's."""
    engine = Engine([plus_one_patch(module_name)], Config(device="npu"))
    engine.activate("unit")
    old = importlib.import_module(module_name)
    del sys.modules[module_name]
    assert engine.report()["unit.plus_one"].state == "superseded"
    assert engine.revert() == ["unit.plus_one"] and old.Box().value() == 1
    fresh = importlib.import_module(module_name)
    assert fresh.Box().value() == 1 and engine.report()["unit.plus_one"].state == "reverted"


def test_a_target_replacing_itself_in_sys_modules_is_patched_where_importers_look(module_name: str, tmp_path) -> None:
    source = tmp_path / f"{module_name}.py"
    source.write_text(
        source.read_text() + "import sys, types\n_new = types.ModuleType(__name__)\n_new.Box = Box\n"
        "_new.__spec__ = __spec__\nsys.modules[__name__] = _new\n"
    )
    engine = Engine([plus_one_patch(module_name)], Config(device="npu"))
    engine.activate("unit")
    module = importlib.import_module(module_name)
    assert type(module).__name__ == "module" and module.Box().value() == 2
    assert engine.report()["unit.plus_one"].state == "applied"
    assert engine.revert() == ["unit.plus_one"] and module.Box().value() == 1


def test_a_target_replacing_itself_is_patched_where_importers_look_after_a_fresh_import(
    module_name: str, tmp_path
) -> None:
    source = tmp_path / f"{module_name}.py"
    source.write_text(
        "def helper():\n    return 1\n\nimport sys, types\n_new = types.ModuleType(__name__)\n"
        "_new.helper = helper\n_new.__spec__ = __spec__\nsys.modules[__name__] = _new\n"
    )

    def fix(site):
        return set_attribute(site.owner, site.attribute, mark(lambda: 2, site.patch.name))

    engine = Engine(
        [Patch("unit.helper", "two", (Target(module_name, "helper"),), fix, device="any")], Config(device="npu")
    )
    engine.activate("unit")
    assert importlib.import_module(module_name).helper() == 2
    del sys.modules[module_name]
    fresh = importlib.import_module(module_name)
    record = engine.report()["unit.helper"]
    assert (record.state, fresh.helper()) == ("applied", 2)
    assert record.reason == "fix installed; again after a fresh import (it had left sys.modules)"


def test_an_interrupted_fix_hooks_the_retried_import(module_name: str) -> None:
    calls = []
    patch = plus_one_patch(module_name)
    fix = patch.fix

    def interrupted_once(site):
        calls.append(site)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return fix(site)

    engine = Engine(
        [Patch(patch.name, patch.summary, patch.targets, interrupted_once, device="any")], Config(device="npu")
    )
    engine.activate("unit")
    with pytest.raises(KeyboardInterrupt):
        importlib.import_module(module_name)
    assert module_name not in sys.modules
    assert importlib.import_module(module_name).Box().value() == 2
    assert engine.report()["unit.plus_one"].state == "applied"


def test_an_interrupted_activation_decides_again_and_keeps_what_went_in(
    module_name: str, tmp_path, request: pytest.FixtureRequest
) -> None:
    """Ctrl-C in a fix run at activation (its module imported first, after another module's hook
    ran): the activation is abandoned; the next keeps the fix that went in (not run twice), decides
    the failed patch afresh and hooks both modules again, so every patch ends applied."""
    source = tmp_path / f"{module_name}.py"
    source.write_text(source.read_text() + "def one():\n    return 1\n")
    (tmp_path / f"{module_name}_b.py").write_text("def two():\n    return 2\n")
    request.addfinalizer(lambda: sys.modules.pop(f"{module_name}_b", None))
    module, second = importlib.import_module(module_name), importlib.import_module(f"{module_name}_b")
    runs: dict[str, int] = {}

    def negate(target: Target, fault: BaseException) -> Patch:
        def fix(site):
            runs[site.attribute] = runs.get(site.attribute, 0) + 1
            if runs[site.attribute] == 1:
                raise fault
            return set_attribute(site.owner, site.attribute, mark(lambda: -1, site.patch.name))

        return Patch(f"unit.{target.qualname}", "negates", (target,), fix, device="any")

    one, two = Target(module_name, "one"), Target(second.__name__, "two")
    patches = [plus_one_patch(module_name), negate(one, ValueError("once")), negate(two, KeyboardInterrupt())]
    engine = Engine(patches, Config(device="npu"))
    with pytest.raises(KeyboardInterrupt):
        engine.activate("unit")
    assert (engine.status, engine.reason) == (
        "not-activated",
        "activation interrupted (KeyboardInterrupt); the next watched import activates",
    )
    engine.activate("unit")
    records = [(r.name, r.state, r.reason) for r in engine.report().records]
    assert records == [(f"unit.{n}", "applied", "fix installed") for n in ("plus_one", "one", "two")]
    assert (runs, module.Box().value(), module.one(), second.two()) == ({"one": 2, "two": 2}, 2, -1, -1)


def test_a_deferred_module_whose_import_failed_is_hooked_again(module_name: str) -> None:
    """A target still executing at activation (deferred) whose import then failed: the engine's next
    catch-up (here ``settle``) hooks its retried import, which is patched."""
    executing = types.ModuleType(module_name)
    executing.__spec__ = importlib.machinery.ModuleSpec(module_name, None)
    executing.__spec__._initializing = True
    sys.modules[module_name] = executing
    engine = Engine([plus_one_patch(module_name)], Config(device="npu"))
    engine.activate("unit")
    del sys.modules[module_name]  # its import raised
    engine.settle()
    assert engine.report()["unit.plus_one"].state == "pending"
    assert importlib.import_module(module_name).Box().value() == 2
    assert engine.report()["unit.plus_one"].state == "applied"


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "0", "-1", "soon", ""])
def test_timeout_must_be_a_positive_finite_number(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive number of seconds"):
        seconds(text)


def test_timeout_values_accepted() -> None:
    assert (seconds("0.5"), seconds("600"), seconds("1e3")) == (0.5, 600.0, 1000.0)


def test_the_doctor_log_fits_the_first_screen() -> None:
    log = "".join(f"line {i} " + "x" * (200 if i == 3 else 0) + "\n" for i in range(50))
    short = first_screen(log, full=False).splitlines()
    assert len(short) == LOG_LINES + 1 and all(len(line) <= 120 for line in short)
    assert short[-1] == "... (30 more lines; the whole log: verl-npu-autopatch doctor --all)"
    whole = first_screen(log, full=True)  # every line, a long one folded to the width (120 here)
    assert whole.replace("\n", "") == log.replace("\n", "") and max(map(len, whole.splitlines())) == 120
    assert first_screen("a\nb\n", full=False) == "a\nb\n"
