"""Round 4 of the fault matrix (issue 31), plugins and the command line: broken metadata of an
unrelated distribution, a plugin that exits or hangs at load, a user's script shadowing the
package's name, a doctor child that leaves a process holding its pipes, an ASCII-only terminal,
bad ``--timeout`` values, in real child interpreters (venvs with the built wheel and the fixture
packages). ``docs/reliability.md`` names each case.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.children import FIXTURE_SITE, ROOT, clean_env, run_json

NPU = {"VERL_NPU_AUTOPATCH_DEVICE": "npu"}

IMPORT = """
import json, vllm.model, verl_npu_autopatch
r = verl_npu_autopatch.report()
print(json.dumps([vllm.model.Layer().forward(1), r.status, {x.name: [x.state, x.reason] for x in r.records}]))
"""


def cli(python: Path, *args: str, env: dict[str, str], path: str = "") -> subprocess.CompletedProcess[str]:
    """``python -m verl_npu_autopatch ARGS`` with the fixture packages (and ``path``) on PYTHONPATH."""
    paths = os.pathsep.join(filter(None, [str(FIXTURE_SITE), path]))
    return subprocess.run(
        [str(python), "-m", "verl_npu_autopatch", *args],
        env=clean_env(PYTHONPATH=paths, **env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_malformed_entry_points_of_an_unrelated_distribution(tmp_path: Path, base_python: Path) -> None:
    # an unrelated distribution's entry points are never parsed; a plugin's malformed ones are its record
    for name, group in (("broken_dist", "console_scripts"), ("unrelated_dist", "console_scripts")):
        info = tmp_path / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[{group}]\nnot an entry point line\n")
    (tmp_path / "broken_dist-1.0.dist-info" / "entry_points.txt").write_text(
        "[verl_npu_autopatch.patches]\nnot an entry point line\n"
    )
    forward, status, records = run_json(base_python, IMPORT, env={**NPU, "PYTHONPATH": str(tmp_path)})
    assert (forward, status, records["fixture.forward"][0]) == (12, "active", "applied")
    assert "distribution:unrelated_dist" not in records
    state, reason = records["distribution:broken_dist"]
    assert state == "failed" and "reading the entry points of distribution broken_dist raised" in reason
    proc = cli(base_python, "status", env=NPU, path=str(tmp_path))
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr
    assert "plugin distribution:broken_dist failed to load" in proc.stdout


def test_plugin_raising_system_exit_at_load(base_python: Path) -> None:
    env = {**NPU, "AUTOPATCH_FIXTURE_LOAD": "exit"}
    forward, status, records = run_json(base_python, IMPORT, env=env)
    state, reason = records["entry-point:fixtures"]
    assert (forward, status, state) == (2, "active", "failed") and "raised SystemExit: 2" in reason
    proc = cli(base_python, "status", env=env)
    assert proc.returncode == 0 and "plugin entry-point:fixtures failed to load" in proc.stdout


def test_user_script_named_like_the_package(tmp_path: Path, any_python: Path) -> None:
    # `python verl_npu_autopatch.py`: the script's directory is first on sys.path
    script = tmp_path / "verl_npu_autopatch.py"
    script.write_text('import json, vllm.model\nprint("body"); print(json.dumps(vllm.model.Layer().forward(1)))\n')
    proc = subprocess.run(
        [str(any_python), str(script)],
        env=clean_env(PYTHONPATH=str(FIXTURE_SITE), **NPU),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (proc.returncode, proc.stdout.splitlines(), proc.stderr) == (0, ["body", "12"], "")


def test_plugin_hanging_at_load_does_not_hang_status(base_python: Path) -> None:
    proc = cli(base_python, "status", "--timeout", "3", env={**NPU, "AUTOPATCH_FIXTURE_LOAD": "hang"})
    assert proc.returncode == 0
    assert "plugin entry-point:fixtures failed to load" in proc.stdout and "did not finish within 3 s" in proc.stdout


def test_doctor_timeout_with_a_grandchild_holding_the_pipe(tmp_path: Path, base_python: Path) -> None:
    # the doctor child hangs importing a target after starting a process in a session of its own
    # that holds the child's pipes for an hour: doctor ends at its timeout, not the grandchild's
    pidfile = tmp_path / "grandchild"
    env = {**NPU, "AUTOPATCH_FIXTURE_HANG": "1", "AUTOPATCH_FIXTURE_GRANDCHILD": str(pidfile)}
    try:
        proc = cli(base_python, "doctor", "--timeout", "5", env=env)
        assert proc.returncode == 3 and "TIMED OUT" in proc.stdout and "import vllm.hang" in proc.stdout
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_doctor_child_done_while_a_grandchild_holds_the_pipe(tmp_path: Path, base_python: Path) -> None:
    # the doctor child finishes but leaves a process in a session of its own holding its pipes:
    # doctor reports at once, not after its timeout
    pidfile = tmp_path / "grandchild"
    try:
        proc = cli(base_python, "doctor", "--timeout", "100", env={**NPU, "AUTOPATCH_FIXTURE_GRANDCHILD": str(pidfile)})
        assert proc.returncode == 0, proc.stdout
        assert "engine active: activated by doctor" in proc.stdout and "TIMED OUT" not in proc.stdout
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_non_ascii_value_on_an_ascii_terminal(base_python: Path) -> None:
    env = {**NPU, "VERL_NPU_AUTOPATCH_ENABLE": "glm5\u00e9", "PYTHONIOENCODING": "ascii", "LC_ALL": "C"}
    for command in ("status", "doctor"):
        proc = cli(base_python, command, env=env)
        assert proc.returncode == 0, proc.stderr
        assert "UnicodeEncodeError" not in proc.stderr and "'glm5\\xe9'" in proc.stdout


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "soon"])
def test_bad_timeout_values(base_python: Path, value: str) -> None:
    for command in ("doctor", "status"):
        proc = cli(base_python, command, "--timeout", value, env=NPU)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert f"--timeout: expected a positive number of seconds, got '{value}'" in proc.stderr


def test_doctor_log_after_failed_fits_the_first_screen(base_python: Path) -> None:
    env = {**NPU, "AUTOPATCH_FIXTURE_BROKEN": "1"}
    short, full = (cli(base_python, "doctor", *extra, env=env).stdout for extra in ((), ("--all",)))
    tail = short.split("FAILED:", 1)[1].rstrip().splitlines()
    assert len(tail) <= 22 and all(len(line) <= 120 for line in tail)
    assert "RuntimeError: boom from the fixture fix" in full.split("FAILED:", 1)[1]
    if "the whole log" in short:
        assert "verl-npu-autopatch doctor --all" in tail[-1]


def test_docs_name_every_case() -> None:
    text = (ROOT / "docs" / "reliability.md").read_text()
    for name in [n for n in globals() if n.startswith("test_") and n != "test_docs_name_every_case"]:
        assert f"{name.removeprefix('test_')}`" in text, name
