"""The fault matrix: every bad value and every injected fault, strict and not, in real child
interpreters (Python 3.11 venvs with the built wheel and the fixture packages).

Each case asserts start-up silence (``python -c 'import json'``: exit 0, no output), the outcome
of the watched import, the record, and the exit code of ``doctor``. ``docs/reliability.md`` is the
same matrix as a table; ``test_docs_table_lists_every_case`` keeps the two in step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.children import FIXTURE_SITE, ROOT, clean_env, run

NPU = {"VERL_NPU_AUTOPATCH_DEVICE": "npu"}
STRICT = {"VERL_NPU_AUTOPATCH_STRICT": "1"}

#: Imports the fixture target and reports what happened (also when the import raised).
IMPORT = """
import json, sys
out = {}
try:
    import vllm.model
    out.update(imported=True, forward=vllm.model.Layer().forward(1))
except Exception as exc:
    out.update(imported=False, error=type(exc).__name__, message=str(exc),
               cause=type(exc.__cause__).__name__ if exc.__cause__ else None)
import verl_npu_autopatch
r = verl_npu_autopatch.report()
out.update(status=r.status, reason=r.reason, trigger=r.trigger, states=r.states(), warnings=r.warnings)
print(json.dumps(out))
"""

#: Every bad value tried: (variable, value, text of its warning, engine status with DEVICE=npu).
BAD_VALUES = [
    ("VERL_NPU_AUTOPATCH", "maybe", "VERL_NPU_AUTOPATCH='maybe' is not understood", "active"),
    ("VERL_NPU_AUTOPATCH", "yes please", "VERL_NPU_AUTOPATCH='yes please' is not understood", "active"),
    ("VERL_NPU_AUTOPATCH_DEVICE", "gpu", "VERL_NPU_AUTOPATCH_DEVICE='gpu' is not understood", "inactive"),
    ("VERL_NPU_AUTOPATCH_DEVICE", "\x01npu\x7f", "VERL_NPU_AUTOPATCH_DEVICE='\\x01npu\\x7f'", "inactive"),
    ("VERL_NPU_AUTOPATCH_STRICT", "maybe", "VERL_NPU_AUTOPATCH_STRICT='maybe' is not understood", "active"),
    ("VERL_NPU_AUTOPATCH_LOG", "LOUD", "VERL_NPU_AUTOPATCH_LOG='LOUD' is not understood", "active"),
    ("VERL_NPU_AUTOPATCH_ENABLE", "glm5", "unknown patch or group 'glm5'; did you mean 'glm52'", "active"),
    ("VERL_NPU_AUTOPATCH_ENABLE", "nosuchthing", "unknown patch or group 'nosuchthing'; `verl-npu", "active"),
    ("VERL_NPU_AUTOPATCH_DISABLE", "fixtur", "unknown patch or group 'fixtur'; did you mean 'fixture'", "active"),
    ("VERL_VLLM_ASCEND_GLM52_PATCH", "perhaps", "VERL_VLLM_ASCEND_GLM52_PATCH='perhaps' is not understood", "active"),
]

#: Values of the master switch that mean "off".
OFF_WORDS = ["0", "off", "disable", "disabled", "none", "False"]


def child(python: Path, code: str, env: dict[str, str], args: tuple[str, ...] = (), path: bool = True):
    """Run ``python [args] -c code`` with ``env`` (and the fixture packages on PYTHONPATH)."""
    extra = {"PYTHONPATH": str(FIXTURE_SITE)} if path else {}
    return subprocess.run(
        [str(python), *args, "-c", code],
        env=clean_env(**extra, **env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def imported(python: Path, env: dict[str, str], **kwargs) -> tuple[dict, str]:
    """What :data:`IMPORT` saw, and the child's stderr."""
    proc = child(python, IMPORT, env, **kwargs)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def assert_silent_startup(python: Path, env: dict[str, str], args: tuple[str, ...] = ()) -> None:
    proc = child(python, "import json", env, args)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def doctor(python: Path, env: dict[str, str], *extra: str) -> tuple[int, str]:
    proc = subprocess.run(
        [str(python), "-m", "verl_npu_autopatch", "doctor", *extra],
        env=clean_env(PYTHONPATH=str(FIXTURE_SITE), **env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return proc.returncode, proc.stdout


def status(python: Path, env: dict[str, str]) -> dict:
    proc = child(
        python, "import sys; from verl_npu_autopatch.cli.main import main; sys.exit(main(['status', '--json']))", env
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# ----------------------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    ("variable", "value", "warning", "engine"), BAD_VALUES, ids=[f"{v[0]}={v[1]!r}" for v in BAD_VALUES]
)
def test_bad_value(base_python: Path, variable: str, value: str, warning: str, engine: str) -> None:
    env = {**NPU, variable: value}
    assert_silent_startup(base_python, env)
    seen, stderr = imported(base_python, env)
    assert seen["imported"] is True and seen["status"] == engine
    assert seen["forward"] == (12 if engine == "active" else 2)
    assert [w for w in seen["warnings"] if warning in w], seen["warnings"]
    assert stderr.count(warning) == 1  # logged once per process
    assert all(len(w) < 300 for w in seen["warnings"])  # short: no list of every name
    assert [w for w in status(base_python, env)["warnings"] if warning in w]
    code, out = doctor(base_python, env)
    assert code == 0 and warning in out


def test_unknown_name_is_visible_on_an_inactive_host(base_python: Path) -> None:
    env = {"VERL_NPU_AUTOPATCH_ENABLE": "glm5"}  # no torch_npu, DEVICE unset: inactive
    assert_silent_startup(base_python, env)
    seen, stderr = imported(base_python, env)
    assert seen["status"] == "inactive" and seen["forward"] == 2 and stderr == ""
    assert any("did you mean 'glm52'" in w for w in seen["warnings"])
    assert any("did you mean 'glm52'" in w for w in status(base_python, env)["warnings"])
    code, out = doctor(base_python, env)
    assert code == 0 and "did you mean 'glm52'" in out


@pytest.mark.parametrize("word", OFF_WORDS)
def test_master_switch_off_words(base_python: Path, word: str) -> None:
    env = {**NPU, "VERL_NPU_AUTOPATCH": word}
    assert_silent_startup(base_python, env)
    seen, stderr = imported(base_python, env)
    assert (seen["imported"], seen["forward"], seen["states"], stderr) == (True, 2, {}, "")
    assert seen["status"] == "inactive" and seen["reason"] == "switched off by VERL_NPU_AUTOPATCH"
    code, out = doctor(base_python, env)
    assert code == 0 and "switched off" in out and "--device npu" not in out


# ----------------------------------------------------------------------------- faults
def venv_without_wrapt(tmp_path: Path, base_python: Path, wrapt: str) -> Path:
    """A venv made from the base interpreter holding links to the test venv's packages except
    wrapt; ``wrapt`` is ``missing``, ``broken`` (an ``__init__`` that raises) or ``old``
    (the real wrapt package under a 1.10 dist-info)."""
    base = Path(run(base_python, "import sys; print(sys._base_executable)", fixtures=False).stdout.strip())
    env = tmp_path / f"wrapt-{wrapt}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    target = Path(
        run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])", fixtures=False).stdout.strip()
    )
    source = Path(
        run(base_python, "import sysconfig; print(sysconfig.get_paths()['purelib'])", fixtures=False).stdout.strip()
    )
    for entry in source.iterdir():
        if entry.name.startswith("wrapt") and not (wrapt == "old" and entry.name == "wrapt"):
            continue
        if not (target / entry.name).exists():
            (target / entry.name).symlink_to(entry)
    if wrapt == "broken":
        (target / "wrapt").mkdir()
        (target / "wrapt" / "__init__.py").write_text("raise ImportError('wrapt/_wrappers.so: undefined symbol')\n")
    if wrapt == "old":
        info = target / "wrapt-1.10.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wrapt\nVersion: 1.10.0\n")
    return python


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
@pytest.mark.parametrize("wrapt", ["missing", "broken", "old"])
def test_wrapt_fault(tmp_path: Path, base_python: Path, wrapt: str, strict: bool) -> None:
    python = venv_without_wrapt(tmp_path, base_python, wrapt)
    env = {**NPU, **(STRICT if strict else {})}
    assert_silent_startup(python, env)
    seen, stderr = imported(python, env)
    assert seen["status"] == "failed" and "activation failed" in seen["reason"]
    if strict:
        assert (seen["imported"], seen["error"]) == (False, "PatchError")
        assert seen["cause"] in ("ModuleNotFoundError", "ImportError", "RuntimeError")
    else:
        assert (seen["imported"], seen["forward"]) == (True, 2)
        assert stderr.count("Traceback") == 1 and "activation failed" in stderr
    assert any("wrapt" in e for e in status(python, env)["errors"])
    assert doctor(python, {**NPU})[0] == 2


#: (fault, its knob, the record it shows in, the state, doctor's exit code lenient / strict)
PATCH_FAULTS = [
    ("plugin-load", {"AUTOPATCH_FIXTURE_LOAD": "raise"}, "entry-point:fixtures", "failed", (1, 2)),
    ("plugin-fix", {"AUTOPATCH_FIXTURE_BROKEN": "1"}, "fixture.broken", "failed", (1, 1)),
    ("plugin-check", {"AUTOPATCH_FIXTURE_CHECK": "raise"}, "fixture.other", "failed", (1, 1)),
    ("unsupported", {"AUTOPATCH_FIXTURE_CHECK": "unsupported"}, "fixture.other", "unsupported", (0, 1)),
]


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
@pytest.mark.parametrize(("fault", "env", "record", "state", "codes"), PATCH_FAULTS, ids=[f[0] for f in PATCH_FAULTS])
def test_patch_fault(base_python: Path, fault: str, env: dict, record: str, state: str, codes, strict: bool) -> None:
    env = {**NPU, **env, **(STRICT if strict else {})}
    assert_silent_startup(base_python, env)
    seen, stderr = imported(base_python, env)
    assert seen["states"][record] == state
    if strict:
        assert (seen["imported"], seen["error"]) == (False, "PatchError")
        assert record.removeprefix("entry-point:") in seen["message"]
        assert seen["cause"] is not None or state == "unsupported"
    else:
        assert seen["imported"] is True
        if state == "failed":
            assert stderr.count("Traceback") == 1 and record in stderr
    code, out = doctor(base_python, env)
    assert code == codes[strict], out


def test_stale_pth_without_package(tmp_path: Path, base_python: Path) -> None:
    base = Path(run(base_python, "import sys; print(sys._base_executable)", fixtures=False).stdout.strip())
    env = tmp_path / "stale"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    purelib = Path(
        run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])", fixtures=False).stdout.strip()
    )
    (purelib / "verl_npu_autopatch.pth").write_text((ROOT / "verl_npu_autopatch.pth").read_text())
    assert_silent_startup(python, NPU)
    proc = child(python, "import vllm.model; print(vllm.model.Layer().forward(1))", NPU)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "2\n", "")


def test_read_only_site_packages(tmp_path: Path, base_python: Path) -> None:
    python = venv_without_wrapt(tmp_path, base_python, "old")  # a copy we may chmod
    purelib = python.parents[1] / "lib"
    (next(purelib.glob("python3*/site-packages")) / "wrapt-1.10.0.dist-info").rename(tmp_path / "moved")
    before = sorted(str(p) for p in purelib.rglob("*"))
    for path in [purelib, *purelib.rglob("*")]:
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o555)
    try:
        assert_silent_startup(python, NPU)
        seen, stderr = imported(python, NPU)
        assert (seen["status"], seen["forward"], seen["states"]["fixture.forward"], stderr) == (
            "active",
            12,
            "applied",
            "",
        )
        assert doctor(python, NPU)[0] == 0
    finally:
        for path in [purelib, *purelib.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
    assert sorted(str(p) for p in purelib.rglob("*")) == before  # nothing written


def test_dash_s_dash_i_dash_e(base_python: Path) -> None:
    prefix = f"import sys; sys.path.insert(0, {str(FIXTURE_SITE)!r})\n"
    for flag in ("-S", "-I", "-E"):
        assert_silent_startup(base_python, NPU, (flag,))
    # -S: no site, no .pth: nothing happens until activate()
    purelib = run(base_python, "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    code = prefix + f"sys.path.append({purelib!r})\n" + IMPORT
    seen = json.loads(child(base_python, code, NPU, ("-S",), path=False).stdout.splitlines()[-1])
    assert (seen["status"], seen["forward"]) == ("not-activated", 2)
    activated = (
        prefix + f"sys.path.append({purelib!r})\nimport verl_npu_autopatch; verl_npu_autopatch.activate()\n" + IMPORT
    )
    seen = json.loads(child(base_python, activated, NPU, ("-S",), path=False).stdout.splitlines()[-1])
    assert (seen["status"], seen["forward"]) == ("active", 12)
    # -I and -E ignore PYTHONPATH but still process the .pth: patched as usual
    for flag in ("-I", "-E"):
        proc = child(base_python, prefix + IMPORT, NPU, (flag,), path=False)
        seen = json.loads(proc.stdout.splitlines()[-1])
        assert (seen["status"], seen["forward"], proc.stderr) == ("active", 12, "")


def test_double_pth_run(base_python: Path) -> None:
    purelib = run(base_python, "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    code = (
        f"""
import site, sys
exec(open({purelib + "/verl_npu_autopatch.pth"!r}).read())
site.addsitedir({purelib!r})
from verl_npu_autopatch.bootstrap import startup
startup.install_observer(); startup.install_observer()
hooks = [f for f in sys.meta_path if getattr(f, "verl_npu_autopatch_observer", False)
         or getattr(f, "verl_npu_autopatch_placeholder", False)]
assert hooks == [startup.OBSERVER], hooks
import autopatch_test_plugin
"""
        + IMPORT
        + "\nassert set(autopatch_test_plugin.CALLS.values()) == {1}"
    )
    proc = child(base_python, code, NPU)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["forward"] == 12


def test_hanging_target_doctor_timeout(base_python: Path) -> None:
    env = {**NPU, "AUTOPATCH_FIXTURE_HANG": "1"}
    assert_silent_startup(base_python, env)
    code, out = doctor(base_python, env, "--timeout", "20")
    assert code == 3
    assert "TIMED OUT" in out and "still running: import vllm.hang" in out


def test_reload_after_patching(base_python: Path) -> None:
    code = """
import importlib, json, vllm.model, verl_npu_autopatch
before = vllm.model.Layer().forward(1)
importlib.reload(vllm.model)
r = verl_npu_autopatch.report()
print(json.dumps([before, vllm.model.Layer().forward(1), r.status, r["fixture.forward"].reason]))
"""
    proc = child(base_python, code, NPU)
    assert proc.returncode == 0 and proc.stderr == ""
    before, after, engine, reason = json.loads(proc.stdout.splitlines()[-1])
    # reload re-executes the module (fresh upstream classes); the engine applies the fix again
    assert (before, after, engine) == (12, 12, "active") and reason.endswith("again after importlib.reload")


def test_fork_after_activation(base_python: Path) -> None:
    code = """
import json, os, vllm.model, verl_npu_autopatch
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    import vllm.old_layout  # a target module first imported in the child
    r = verl_npu_autopatch.report()
    os.write(write, json.dumps([vllm.model.Layer().forward(1), r.status, r["fixture.missing"].state]).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(read, 65536).decode())
"""
    assert_silent_startup(base_python, NPU)
    proc = child(base_python, code, NPU)
    assert proc.returncode == 0, proc.stderr  # stderr: the child's "unsupported" warnings
    assert json.loads(proc.stdout.splitlines()[-1]) == [12, "active", "unsupported"]


def test_namespace_package_activates(tmp_path: Path, base_python: Path) -> None:
    (tmp_path / "liger_kernel").mkdir()  # a watched package without __init__.py
    (tmp_path / "liger_kernel" / "ops.py").write_text("VALUE = 1\n")
    code = """
import json, liger_kernel.ops, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([r.status, r.trigger, liger_kernel.ops.VALUE, type(liger_kernel.__loader__).__name__]))
"""
    env = {**NPU, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(FIXTURE_SITE)])}
    proc = subprocess.run(
        [str(base_python), "-c", code], env=clean_env(**env), capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    status_, trigger, value, loader = json.loads(proc.stdout.splitlines()[-1])
    assert (status_, trigger, value) == ("active", "liger_kernel", 1)
    assert "NamespaceLoader" in loader


def test_disable_names_an_entry_point_so_it_is_never_imported(base_python: Path) -> None:
    code = "import sys\n" + IMPORT.replace(
        "print(json.dumps(out))", "out['loaded'] = 'autopatch_test_plugin' in sys.modules\nprint(json.dumps(out))"
    )
    for name in ("fixtures", "entry-point:fixtures"):
        proc = child(base_python, code, {**NPU, "VERL_NPU_AUTOPATCH_DISABLE": name})
        seen = json.loads(proc.stdout.splitlines()[-1])
        assert seen["loaded"] is False and seen["forward"] == 2 and proc.stderr == ""
        assert seen["states"]["entry-point:fixtures"] == "disabled"
        assert not seen["warnings"]


def test_logs_show_up_with_the_variable_and_not_without(base_python: Path) -> None:
    _, quiet = imported(base_python, NPU)
    assert quiet == ""
    _, info = imported(base_python, {**NPU, "VERL_NPU_AUTOPATCH_LOG": "INFO"})
    lines = info.splitlines()
    assert all(line.startswith("verl-npu-autopatch: ") for line in lines)
    for text in ("fixture.forward: applied", "fixture.optin: disabled", "fixture.gated: gated", "engine active"):
        assert sum(text in line for line in lines) == 1, text
    assert "DEBUG" not in info
    _, debug = imported(base_python, {**NPU, "VERL_NPU_AUTOPATCH_LOG": "DEBUG"})
    assert "post-import hook on vllm.model" in debug
    _, inactive = imported(base_python, {"VERL_NPU_AUTOPATCH_LOG": "INFO"})
    assert "engine inactive: no NPU stack" in inactive


def test_docs_table_lists_every_case() -> None:
    text = (ROOT / "docs" / "reliability.md").read_text()
    for variable, value, _, _ in BAD_VALUES:
        assert f"`{variable}={value!r}`" in text, value
    for word in OFF_WORDS:
        assert f"`VERL_NPU_AUTOPATCH={word}`" in text
    names = [n.removeprefix("test_") for n in dir(sys.modules[__name__]) if n.startswith("test_")]
    for name in names:
        assert f"{name}`" in text, name  # `test_name` or `name`


def test_ray_doctor_timeout_has_its_own_exit_code(base_python: Path) -> None:
    code = """
import json
from verl_npu_autopatch.cli import main as cli
from verl_npu_autopatch.cli import ray_doctor
args = cli.build_parser().parse_args(["doctor", "--ray", "--timeout", "5"])
node = {"NodeID": "ab" * 14, "Resources": {}}
late = {**ray_doctor.summarize(node, None, "no answer within 5 s (--timeout)"), "timed_out": True}
data = {"nodes": [late], "problems": ray_doctor.problems([late], [])}
print(json.dumps([args.timeout, ray_doctor.exit_code(data), ray_doctor.render({**data, "address": "x",
      "runtime_env": None, "disagreements": []})]))
"""
    timeout, exit_code, text = json.loads(child(base_python, code, {}).stdout.splitlines()[-1])
    assert (timeout, exit_code) == (5.0, 3)
    assert "no answer within 5 s (--timeout)" in text
