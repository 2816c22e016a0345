"""``verl-npu-autopatch fleet`` (the real CLI in a child venv) on a directory written by others:
hostile files, escape sequences, wrong clocks, an exec'd process, an incomplete report, a time
namespace, ``/proc`` mounted ``hidepid=2`` and files planted by another user (issue 37, 9-16)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.engine.test_fleet import fleet, fleet_json
from tests.support.children import clean_env
from tests.support.hostile_reports import ESCAPES, local_report, valid_report, write_malformed

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, mounts, a second user)")
NOBODY = 65534


@contextmanager
def waiting(*command: str, **env: str) -> Iterator[subprocess.Popen[str]]:
    """A process that runs until the block ends (it reads its stdin to the end)."""
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env(**env))
    try:
        yield proc
    finally:
        proc.communicate("", timeout=60)


def test_hostile_files_are_listed_unreadable_and_nothing_raw_reaches_the_screen(
    base_python: Path, tmp_path: Path
) -> None:
    bad = write_malformed(tmp_path)
    failing = {"name": "p.evil" + ESCAPES, "state": "failed", "reason": "boom " + ESCAPES + "x" * 5000}
    good = valid_report(records=[failing], versions={"vllm": ESCAPES}, title=ESCAPES, argv=[ESCAPES])
    (tmp_path / "good.json").write_text(json.dumps(good))
    data, code = fleet_json(base_python, str(tmp_path))
    assert code == 1  # the one valid file's failed patch; no bad file counts
    assert sorted(item["file"] for item in data["unreadable"]) == bad
    assert [p["file"] for p in data["processes"]] == [str(tmp_path / "good.json")]
    reason = data["problems"][0]["reason"]
    assert reason.startswith("boom " + ESCAPES) and len(reason) < 2100  # whole in --json, within the bound
    errors = {Path(item["file"]).name: item["error"] for item in data["unreadable"]}
    assert errors["fifo.json"] == "not a regular file (a FIFO)"
    assert errors["zero.json"] == errors["link.json"] == "a symbolic link (not followed)"
    assert errors["pid-path.json"].endswith("field 'pid' is not an integer from 1 to 4,194,304")
    assert errors["deep.json"] == "not a report file: JSON nested too deeply"
    assert errors["too-large.json"].startswith("larger than 1,048,576 bytes")

    for args in ((), ("--all",), ("--stale",)):
        proc = fleet(base_python, *args, str(tmp_path))
        assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
        assert not any(raw in proc.stdout for raw in ("\x1b", "\x07", "\x9b", "\u202e"))
        assert "\\x1b[2J" in proc.stdout and "\\u202e" in proc.stdout
        assert max(map(len, proc.stdout.splitlines())) <= 120
    listing = fleet(base_python, str(tmp_path)).stdout
    assert "characters)" in listing and "x" * 400 not in listing.replace("\n", "").replace(" ", "")


@pytest.mark.parametrize("value", ["nan", "-1", "-inf", "inf"])
def test_stale_after_must_be_a_finite_number_of_hours(base_python: Path, tmp_path: Path, value: str) -> None:
    proc = fleet(base_python, f"--stale-after={value}", str(tmp_path))
    assert proc.returncode == 2 and "--stale-after" in proc.stderr and "Traceback" not in proc.stderr


def test_another_hosts_clock_is_not_trusted_alone(base_python: Path, tmp_path: Path) -> None:
    behind = valid_report(
        host="behind", written=time.time() - 30 * 3600, records=[{"name": "p", "state": "failed", "reason": "boom"}]
    )
    (tmp_path / "behind.json").write_text(json.dumps(behind))  # its mtime: now, by the filesystem's clock
    ahead = valid_report(host="ahead", written=time.time() + 2 * 86400)
    (tmp_path / "ahead.json").write_text(json.dumps(ahead))
    old = valid_report(host="old", written=time.time() - 30 * 3600)
    (tmp_path / "old.json").write_text(json.dumps(old))
    os.utime(tmp_path / "old.json", (old["written"], old["written"]))  # both clocks say 30 h
    data, code = fleet_json(base_python, str(tmp_path))
    assert code == 1 and [p["patch"] for p in data["problems"]] == ["p"]  # the fresh file's failure counts
    liveness = {p["host"]: p["liveness"] for p in data["processes"] + data["stale"]}
    assert liveness["behind"].startswith("written 30.0 h ago on another host (its file changed")
    assert liveness["ahead"] == "written on another host (clock ahead by 48.0 h)"
    assert [p["host"] for p in data["stale"]] == ["old"]


def test_an_incomplete_report_of_a_live_process_is_a_problem(base_python: Path, tmp_path: Path) -> None:
    with waiting(str(base_python), "-c", "import sys; sys.stdin.read()") as proc:
        (tmp_path / "me.incomplete.json").write_text(json.dumps(local_report(proc.pid)))
        data, code = fleet_json(base_python, str(tmp_path))
        text = fleet(base_python, str(tmp_path)).stdout
    assert code == 1
    [process] = data["processes"]
    assert process["liveness"] == "running; report incomplete (a later write failed; this is the last complete state)"
    assert [(p["state"], p["patch"]) for p in data["problems"]] == [("report incomplete", None)]
    assert "engine: report incomplete in 1" in " ".join(text.split())


def test_a_pid_that_runs_another_program_is_gone(base_python: Path, tmp_path: Path) -> None:
    with waiting(str(base_python), "-c", "import sys; sys.stdin.read()") as proc:
        report = local_report(proc.pid)
        (tmp_path / "same.json").write_text(json.dumps(report))
        same, _ = fleet_json(base_python, str(tmp_path))
        (tmp_path / "same.json").write_text(json.dumps({**report, "image": report["image"] + 4096}))
        execd, code = fleet_json(base_python, str(tmp_path))
    assert [p["liveness"] for p in same["processes"]] == ["running"]
    assert code == 2 and [p["liveness"] for p in execd["stale"]] == [
        "process gone (the pid now runs another program: exec)"
    ]


WRITE_IN_NAMESPACE = """
import json, os, sys
sys.path.insert(0, os.environ["TESTS_ROOT"])
from tests.support.hostile_reports import local_report
report = local_report(os.getpid())
if not int(os.environ["WITH_TIMENS"]):
    del report["timens"]  # as an older writer, which did not record it
open(os.environ["REPORT"], "w").write(json.dumps(report))
print(report["start"], flush=True)
sys.stdin.read()
"""


@ROOT_ONLY
@pytest.mark.parametrize("with_timens", [1, 0])
def test_a_process_in_another_time_namespace_is_running(base_python: Path, tmp_path: Path, with_timens: int) -> None:
    probe = subprocess.run(["unshare", "--time", "--fork", "--boottime", "100000", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"this kernel or sandbox refuses a time namespace: {probe.stderr.decode().strip()}")
    env = {"TESTS_ROOT": str(Path(__file__).parents[2]), "REPORT": str(tmp_path / "r.json")}
    command = ["unshare", "--time", "--fork", "--boottime", "100000", str(base_python), "-c", WRITE_IN_NAMESPACE]
    with waiting(*command, WITH_TIMENS=str(with_timens), **env) as proc:
        assert proc.stdout and int(proc.stdout.readline()) > 100000 * 100  # shifted by the namespace's offset
        data, code = fleet_json(base_python, str(tmp_path))
    assert code == 0 and [p["liveness"] for p in data["processes"]] == ["running"]


@ROOT_ONLY
def test_proc_mounted_hidepid_says_cannot_check_not_gone(base_python: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="fleet-hidepid-"))  # outside pytest's root-only tmp tree
    try:
        directory.chmod(0o755)
        with waiting(str(base_python), "-c", "import sys; sys.stdin.read()") as proc:
            (directory / "r.json").write_text(json.dumps(local_report(proc.pid)))
            (directory / "r.json").chmod(0o644)
            as_nobody = f"exec setpriv --reuid {NOBODY} --regid {NOBODY} --clear-groups"
            script = (
                f'mount -t proc -o hidepid=2 proc /proc && {as_nobody} "$0" -m verl_npu_autopatch fleet --json "$1"'
            )
            run = subprocess.run(
                ["unshare", "--mount", "sh", "-c", script, str(base_python), str(directory)],
                capture_output=True,
                text=True,
                timeout=120,
            )
        if run.returncode not in (0, 1, 2) or not run.stdout.startswith("{"):
            pytest.skip(f"cannot mount /proc with hidepid=2 in a mount namespace here: {run.stderr.strip()}")
        data = json.loads(run.stdout)
        assert [p["liveness"] for p in data["processes"]] == ["running (cannot check its start time: /proc hides it)"]
        assert run.returncode == 0
    finally:
        shutil.rmtree(directory)


@ROOT_ONLY
def test_a_file_planted_by_another_user_is_not_used(base_python: Path, tmp_path: Path) -> None:
    (tmp_path / "planted.json").write_text(json.dumps(valid_report()))
    os.chown(tmp_path / "planted.json", NOBODY, NOBODY)
    data, code = fleet_json(base_python, str(tmp_path))
    assert code == 2 and data["processes"] == []
    assert [item["error"] for item in data["unreadable"]] == [
        f"owned by uid {NOBODY}: not by the directory's owner or root"
    ]
