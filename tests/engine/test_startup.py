"""The start-up hook in real interpreters, on every Python from 3.10 to 3.13."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.children import run, run_json

#: The start-up hooks on ``sys.meta_path``: "placeholder" for the ``.pth`` line's placeholder,
#: "observer" for the start-up module's observer object.
HOOKS = (
    "[('observer' if f is getattr(sys.modules.get('_verl_npu_autopatch_startup'), 'OBSERVER', 0) else 'placeholder') "
    "for f in sys.meta_path "
    "if getattr(f, 'verl_npu_autopatch_observer', False) or getattr(f, 'verl_npu_autopatch_placeholder', False)]"
)
#: What the hooks are at start-up, and then after the first watched name is looked up (without
#: loading it), with the start-up module loaded or not.
STAGES = (
    "import importlib.util, json, sys; start = " + HOOKS + "; loaded = '_verl_npu_autopatch_startup' in sys.modules; "
    "importlib.util.find_spec('vllm'); print(json.dumps([start, loaded, " + HOOKS + "]))"
)
#: The hooks at start-up in these venvs: a venv's ``site`` reads the ``.pth`` twice (cpython#75723),
#: and the line puts a placeholder each time.
AT_START = ["placeholder", "placeholder"]
#: The observer: the start-up module's ``OBSERVER``.
OBSERVER = "observer"
#: The start-up module, in ``sys.modules`` under its root name and the package's (one object).
STARTUP_MODULE = ["_verl_npu_autopatch_startup", "verl_npu_autopatch.bootstrap.startup"]
MODULES = "import sys, json; print(json.dumps(sorted(sys.modules)))"
#: What a first watched import loads of the package where the configuration decides.
PACKAGE_ON_THE_INACTIVE_PATH = (
    "verl_npu_autopatch",
    "verl_npu_autopatch.bootstrap",
    "verl_npu_autopatch.bootstrap.activation",
    "verl_npu_autopatch.engine",
    "verl_npu_autopatch.engine.config",
    "verl_npu_autopatch.engine.environment",
)


def site_packages(python: Path) -> Path:
    out = run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])", fixtures=False)
    return Path(out.stdout.strip())


def test_wheel_root_holds_both_startup_files(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "verl_npu_autopatch.pth" in names
    assert "verl_npu_autopatch.start" in names
    start = zipfile.ZipFile(wheel).read("verl_npu_autopatch.start").decode("utf-8-sig").split()
    assert start == ["_verl_npu_autopatch_startup:install_observer"]
    # the start-up module at the root is the package's own startup.py
    wheel_file = zipfile.ZipFile(wheel).read
    assert wheel_file("_verl_npu_autopatch_startup.py") == wheel_file("verl_npu_autopatch/bootstrap/startup.py")
    assert "verl_npu_autopatch/py.typed" in names


def test_placeholders_at_start_then_exactly_one_observer(any_python: Path) -> None:
    start, loaded, after = run_json(any_python, STAGES, fixtures=False)
    # one placeholder each time site read the .pth (a venv reads it twice: cpython#75723); nothing imported
    assert start == AT_START and loaded is False
    # the first watched name puts the observer in the first one's place and drops the others
    assert after == [OBSERVER]


def test_the_placeholder_answers_misses_parts_and_watched_names(any_python: Path) -> None:
    # the .pth line's placeholder alone (-S: site never ran, the start-up module is not on the path);
    # that the line holds exactly the watched names is test_pth_line's (in-process) check
    purelib = site_packages(any_python)
    code = f"""
import json, sys
exec(open({str(purelib / "verl_npu_autopatch.pth")!r}).read())
placeholder = sys.meta_path[0]
find, kept = placeholder.find_spec, placeholder.find_spec.__kwdefaults__
missed = [find(name, None, None) for name in ("json", "torch", "torch_np", "encodings.idna", "vllm", "megatron")]
stale = "_verl_npu_autopatch_startup" in sys.modules
sys.path.append({str(purelib)!r})  # the start-up module can be imported from now on
part = find("torch", None, None), "_verl_npu_autopatch_startup" in sys.modules
find("vllm", None, None)
print(json.dumps([missed, stale, part, kept["r"], {HOOKS}]))
"""
    missed, stale, part, results_left, hooks = run_json(any_python, code, args=("-S",), fixtures=False)
    # unrelated names and watched names whose start-up module cannot be imported (a stale .pth)
    # give None; "torch", a part of "torch_npu", does not even look for the start-up module
    assert missed == [None] * 6 and stale is False and part == [None, False]
    # a watched name imports it, and its observer takes the placeholder's place; no result is left behind
    assert hooks == [OBSERVER] and results_left == []


#: One start-up module object under both names, and ``report()`` / ``status`` reading the observer
#: that woke (or that the engine drove): its mode seen through the package's name and by ``status``,
#: the engine's trigger.
ONE_MODULE = """
import json, sys
{before}
import vllm, verl_npu_autopatch
from verl_npu_autopatch.bootstrap import startup
from verl_npu_autopatch.cli import main as cli
one = sys.modules["verl_npu_autopatch.bootstrap.startup"] is sys.modules["_verl_npu_autopatch_startup"]
r = verl_npu_autopatch.report()
print(json.dumps([one, startup.OBSERVER.mode, cli.status_data()["observer"], r.status, r.trigger]))
"""


def test_one_start_up_module_per_process(any_python: Path, tmp_path: Path) -> None:
    # wheel install: the first watched import wakes the root module's observer, found inactive
    seen = run_json(any_python, ONE_MODULE.format(before=""))
    assert seen == [True, "retired", "retired", "inactive", "vllm"]
    # python -S + activate(): the package imports the root module; the engine retires its observer
    purelib = site_packages(any_python)
    activated = f"sys.path.append({str(purelib)!r}); import verl_npu_autopatch; verl_npu_autopatch.activate()"
    seen = run_json(any_python, ONE_MODULE.format(before=activated), args=("-S",))
    assert seen == [True, "retired", "retired", "inactive", "api"]
    # the package shipped alone (no root module): its copy of the file is the one module
    alone = tmp_path / "alone"
    for package in ("verl_npu_autopatch", "packaging"):  # packaging: status reads version requirements
        shutil.copytree(purelib / package, alone / package)
    activated = f"sys.path.append({str(alone)!r}); import verl_npu_autopatch; verl_npu_autopatch.activate()"
    root = "sys.modules['_verl_npu_autopatch_startup']"
    code = ONE_MODULE.format(before=activated) + f"assert {root}.__file__.startswith({str(alone)!r})\n"
    assert run_json(any_python, code, args=("-S",)) == [True, "retired", "retired", "inactive", "api"]


def test_startup_imports_nothing_heavy(any_python: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"  # made the same way as the test venv, without the wheel
    base = Path(run(any_python, "import sys; print(sys._base_executable)", fixtures=False).stdout.strip())
    subprocess.run([str(base), "-m", "venv", str(bare)], check=True)
    without = set(run_json(bare / "bin" / "python", MODULES, fixtures=False))
    with_package = set(run_json(any_python, MODULES, fixtures=False))
    # site.py itself (3.13+) loads the utf-8-sig codec to read any .pth file
    assert with_package - without - {"encodings.utf_8_sig"} == set()  # the .pth line imports nothing


def test_meta_path_changes_never_shift_an_import_in_another_thread(any_python: Path) -> None:
    # an import iterates over the list it read: the observer replaces the first placeholder in
    # place, and the other placeholders and later the observer leave through a new list, so an
    # iteration under way skips no finder
    code = """
import importlib.util, json, sys
live = sys.meta_path
before = list(live)
others = [f for f in before if not getattr(f, "verl_npu_autopatch_placeholder", False)]
importlib.util.find_spec("vllm")  # the first watched name: take_over
observer = sys.modules["_verl_npu_autopatch_startup"].OBSERVER
replaced = live[0] is observer and live[1:] == before[1:] and sys.meta_path == [observer, *others]
observing = sys.meta_path
observer.retire()
left = observing[0] is observer and sys.meta_path == others
print(json.dumps([before[0] is not observer, replaced, left]))
"""
    assert run_json(any_python, code, fixtures=False) == [True, True, True]


def test_a_watched_package_loaded_by_hand_does_not_stop_the_observer(any_python: Path) -> None:
    # e.g. a test double in sys.modules["torch_npu"]: the next watched import still activates
    code = "import sys, types; sys.modules['torch_npu'] = types.ModuleType('torch_npu'); " + STAGES
    start, _, after = run_json(any_python, code, fixtures=False)
    assert start == AT_START and after == [OBSERVER]


def test_a_pth_processed_again_after_the_observer_left_adds_no_observer(any_python: Path) -> None:
    purelib = site_packages(any_python)
    code = f"""
import importlib.util, json, site, sys
importlib.util.find_spec("vllm")
sys.modules["_verl_npu_autopatch_startup"].OBSERVER.retire()  # as at the end of an activation
site.addsitedir({str(purelib)!r})
again = {HOOKS}
importlib.util.find_spec("transformers")
print(json.dumps([again, {HOOKS}]))
"""
    assert run_json(any_python, code, fixtures=False) == [["placeholder"], []]  # one addsitedir, one placeholder


def test_master_switch_leaves_nothing_at_the_first_watched_name(any_python: Path) -> None:
    for value in ("0", "false", "NO", " off "):
        start, _, after = run_json(any_python, STAGES, env={"VERL_NPU_AUTOPATCH": value}, fixtures=False)
        assert start == AT_START and after == []


def test_dash_capital_s_does_nothing(any_python: Path) -> None:
    seen = run_json(any_python, "import sys, json; print(json.dumps(sorted(sys.modules)))", args=("-S",))
    assert not [m for m in seen if "verl_npu_autopatch" in m]


def test_start_file_entry_point_works_as_pep_829_calls_it(any_python: Path) -> None:
    purelib = site_packages(any_python)
    code = f"""
import json, pkgutil, sys
sys.path.append({str(purelib)!r})
line = open({str(purelib / "verl_npu_autopatch.start")!r}, encoding="utf-8-sig").read().strip()
entry = pkgutil.resolve_name(line)
entry(); entry()
print(json.dumps({HOOKS}))
"""
    assert run_json(any_python, code, args=("-S",), fixtures=False) == [OBSERVER]


def test_odd_values_never_break_startup(any_python: Path) -> None:
    proc = run(any_python, "print('ok')", env={"VERL_NPU_AUTOPATCH": "maybe\x01", "VERL_NPU_AUTOPATCH_DEVICE": "?"})
    assert (proc.stdout, proc.stderr) == ("ok\n", "")


def test_watched_import_activates_and_inactive_host_stays_light(any_python: Path) -> None:
    code = f"""
import json, sys
import vllm
heavy = sorted(m for m in ("wrapt", "importlib.metadata", "logging", "dataclasses", "inspect", "torch_npu")
               if m in sys.modules)
ours, hooks = sorted(m for m in sys.modules if "verl_npu_autopatch" in m), {HOOKS}
import verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps(dict(status=r.status, reason=r.reason, trigger=r.trigger, heavy=heavy, ours=ours, hooks=hooks)))
"""
    # no torch_npu and nothing configured: the start-up module decides alone, importing nothing
    seen = run_json(any_python, code)
    assert (seen["status"], seen["trigger"], seen["heavy"], seen["hooks"]) == ("inactive", "vllm", [], [])
    assert "torch_npu is not installed" in seen["reason"]
    assert seen["ours"] == STARTUP_MODULE
    # a configuration that could change the decision is read (by _activation): inactive all the same
    configured = run_json(any_python, code, env={"VERL_NPU_AUTOPATCH_DEVICE": "auto"})
    assert {**configured, "ours": []} == {**seen, "ours": []}
    assert configured["ours"] == sorted([*STARTUP_MODULE, *PACKAGE_ON_THE_INACTIVE_PATH])


def test_stale_pth_without_package_is_silent(tmp_path: Path, base_python: Path) -> None:
    base = Path(run(base_python, "import sys; print(sys._base_executable)", fixtures=False).stdout.strip())
    env = tmp_path / "stale"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(env)], check=True)
    purelib = site_packages(env / "bin" / "python")
    (purelib / "verl_npu_autopatch.pth").write_text((Path(__file__).parents[2] / "verl_npu_autopatch.pth").read_text())
    (purelib / "vllm").mkdir()
    (purelib / "vllm" / "__init__.py").write_text("X = 1\n")
    watched = "import importlib.util, vllm; importlib.util.find_spec('transformers'); print(vllm.X)"
    proc = run(env / "bin" / "python", watched, fixtures=False)
    assert (proc.stdout, proc.stderr) == ("1\n", "")
    # a broken install (start-up module present but unimportable) is just as silent
    (purelib / "_verl_npu_autopatch_startup.py").write_text("this is not python\n")
    proc = run(env / "bin" / "python", watched, fixtures=False)
    assert (proc.stdout, proc.stderr) == ("1\n", "")
    # and so is a start-up module whose package is missing, at the first watched import
    (purelib / "_verl_npu_autopatch_startup.py").write_text(
        (Path(__file__).parents[2] / "src" / "verl_npu_autopatch" / "bootstrap" / "startup.py").read_text()
    )
    proc = run(env / "bin" / "python", "import vllm; print(vllm.X)", fixtures=False)
    assert (proc.stdout, proc.stderr) == ("1\n", "")


@pytest.mark.parametrize("editable", [False, True], ids=["pip-install-dot", "pip-install-e"])
def test_source_install_and_uninstall(tmp_path: Path, base_python: Path, editable: bool) -> None:
    """``pip install .`` and ``pip install -e .`` both leave a working ``.pth``; uninstall removes it."""
    root = Path(__file__).parents[2]
    env = tmp_path / "env"
    subprocess.run([str(base_python), "-m", "venv", str(env)], check=True)
    python = env / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *(["-e"] if editable else []), str(root)], check=True, capture_output=True)
    assert run_json(python, STAGES, fixtures=False)[2] == [OBSERVER]
    assert run_json(python, ONE_MODULE.format(before="")) == [True, "retired", "retired", "inactive", "vllm"]
    location = run(python, "import verl_npu_autopatch; print(verl_npu_autopatch.__file__)", fixtures=False).stdout
    assert location.startswith(str(root / "src")) is editable
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "verl-npu-autopatch"], check=True)
    purelib = site_packages(python)
    assert not [p.name for p in purelib.iterdir() if "verl_npu_autopatch" in p.name]
    assert run_json(python, STAGES, fixtures=False) == [[], False, []]


def test_wheel_install_with_uv_and_uninstall(tmp_path: Path, wheel: Path, base_python: Path) -> None:
    uv = Path(sys.executable).parent / "uv"
    env = tmp_path / "uv-env"
    subprocess.run([str(base_python), "-m", "venv", str(env)], check=True)
    python = env / "bin" / "python"
    subprocess.run([str(uv), "pip", "install", "-q", "--python", str(python), str(wheel)], check=True)
    assert run_json(python, STAGES, fixtures=False)[2] == [OBSERVER]
    subprocess.run([str(uv), "pip", "uninstall", "-q", "--python", str(python), "verl-npu-autopatch"], check=True)
    assert not [p.name for p in site_packages(python).iterdir() if "verl_npu_autopatch" in p.name]
    assert run_json(python, STAGES, fixtures=False) == [[], False, []]
