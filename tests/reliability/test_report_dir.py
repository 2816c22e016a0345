"""The report directory on hostile ground (issue 37, the writer's side), in real child interpreters:
names planted by another user, a directory another user owns or may write, a full disk, ``~`` and
relative paths, forked children and ``exec``. The cases that need a second user or a tmpfs mount run
as root (as here and in CI) and skip otherwise; their logic is also tested in-process in
tests/unit/test_report_file.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.children import FIXTURE_SITE, clean_env, run

NPU = {"VERL_NPU_AUTOPATCH_DEVICE": "npu"}
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown to another user, or mount a tmpfs")

#: The fixture target imported, then what the process saw: the patch applied, and its warnings.
OBSERVE = """
import json, autopatch_target, vllm.model, verl_npu_autopatch
report = verl_npu_autopatch.report()
print(json.dumps([report["fixture.forward"].state, vllm.model.Layer().forward(1), report.warnings]))
"""


def _env(report_dir: Path | str, **extra: str) -> dict[str, str]:
    return {**NPU, "VERL_NPU_AUTOPATCH_REPORT_DIR": str(report_dir), **extra}


def _reports(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_names_planted_in_the_directory_are_never_followed_or_opened(
    base_python: Path, tmp_path: Path, kind: str
) -> None:
    # another user of the directory plants a link (or a FIFO) at the temporary name the writer used
    # to take (predictable: the same on every rewrite) and at the report's own name
    reports, victim = tmp_path / "reports", tmp_path / "victim"
    reports.mkdir(mode=0o700)
    victim.write_text("precious")
    code = """
import _thread, json, os
from verl_npu_autopatch.engine import report_file
directory = os.environ["VERL_NPU_AUTOPATCH_REPORT_DIR"]
name = report_file.file_name(report_file.identity())
for planted in (f".{name}.{_thread.get_ident()}.tmp", name):
    path = os.path.join(directory, planted)
    os.symlink(os.environ["PLANT_VICTIM"], path) if os.environ["PLANT"] == "symlink" else os.mkfifo(path)
import vllm.model, autopatch_target, verl_npu_autopatch  # activation writes the report, decisions rewrite it
print(json.dumps([name, vllm.model.Layer().forward(1), verl_npu_autopatch.report().warnings]))
"""
    out = run(base_python, code, env=_env(reports, PLANT=kind, PLANT_VICTIM=str(victim)), timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    name, forward, warnings = json.loads(out.stdout.splitlines()[-1])
    assert (forward, warnings) == (12, []) and victim.read_text() == "precious"
    assert stat.S_ISREG((reports / name).lstat().st_mode)  # the planted entry replaced, not followed
    assert json.loads((reports / name).read_text())["records"]


# code run before the import: makes the report directory as the case wants it
DIRECTORIES = {
    "another user's": "os.mkdir(d); os.chown(d, 65534, 65534)",
    "world-writable": "os.mkdir(d); os.chmod(d, 0o777)",
    "group-writable": "os.mkdir(d); os.chmod(d, 0o770)",
    "sticky world-writable": "os.mkdir(d); os.chmod(d, 0o1777)",
    "made by the writer": "",
}


@ROOT_ONLY
@pytest.mark.parametrize("case", DIRECTORIES)
def test_a_directory_other_users_could_read_or_replace_is_refused(base_python: Path, tmp_path: Path, case: str) -> None:
    directory = tmp_path / "job" / "reports"
    setup = f"import os; d = {str(directory)!r}; os.makedirs(os.path.dirname(d)); {DIRECTORIES[case]}\n"
    out = run(base_python, setup + OBSERVE, env=_env(directory))
    state, forward, warnings = json.loads(out.stdout.splitlines()[-1])
    assert (state, forward) == ("applied", 12)  # patching is not affected
    if case in ("sticky world-writable", "made by the writer"):
        [path] = directory.glob("*.json")
        assert warnings == [] and stat.S_IMODE(path.stat().st_mode) == 0o600
        if case == "made by the writer":
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        return
    assert list(directory.iterdir()) == []  # nothing written
    assert len(warnings) == 1 and out.stderr.count("VERL_NPU_AUTOPATCH_REPORT_DIR") == 1
    assert warnings[0].startswith(f"VERL_NPU_AUTOPATCH_REPORT_DIR={str(directory)!r} is not used: ")
    why = "another user (uid 65534)" if case == "another user's" else "no sticky bit"
    assert why in warnings[0] and "patching is not affected" in warnings[0]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 kB tmpfs, mounted for the test (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a small tmpfs to fill")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_leaves_the_report_incomplete_not_healthy(base_python: Path, small_disk: Path) -> None:
    reports = small_disk / "reports"
    code = """
import json, os, verl_npu_autopatch
from verl_npu_autopatch.engine import report_file
directory = os.environ["VERL_NPU_AUTOPATCH_REPORT_DIR"]
verl_npu_autopatch.activate()  # the first report: every patch pending
seen = [sorted(os.listdir(directory))]
filler = os.path.join(os.path.dirname(directory), "filler")
with open(filler, "wb", buffering=0) as f:
    try:
        while f.write(b"x" * 1024):
            pass
    except OSError:  # the disk is full
        pass
import vllm.model  # fixture.broken fails: the rewrite cannot be written
seen.append(sorted(os.listdir(directory)))
os.unlink(filler)  # space again
import autopatch_target  # a decision: the report is whole again
seen.append(sorted(os.listdir(directory)))
report = verl_npu_autopatch.report()
name = report_file.file_name(report_file.identity())
print(json.dumps([name, seen, report["fixture.broken"].state, report.warnings]))
"""
    out = run(base_python, code, env=_env(reports, AUTOPATCH_FIXTURE_BROKEN="1"))
    name, seen, broken, warnings = json.loads(out.stdout.splitlines()[-1])
    incomplete = name.removesuffix(".json") + ".incomplete.json"
    assert seen == [[name], [incomplete], [name]]  # the pending report renamed: fleet shows it incomplete
    assert broken == "failed" and len(warnings) == 1 and "No space left on device" in warnings[0]
    assert {r["name"]: r["state"] for r in _reports(reports)[0]["records"]}["fixture.broken"] == "failed"


def test_tilde_is_expanded_and_a_relative_path_refused(base_python: Path, tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    for raw in ("~/reports", "reports"):
        env = clean_env(PYTHONPATH=str(FIXTURE_SITE), HOME=str(home), **_env(raw))
        proc = subprocess.run(
            [str(base_python), "-c", OBSERVE], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
        )
        state, forward, warnings = json.loads(proc.stdout.splitlines()[-1])
        assert (state, forward) == ("applied", 12)
        if raw == "~/reports":
            assert warnings == [] and len(list((home / "reports").glob("*.json"))) == 1
        else:
            assert (
                len(warnings) == 1 and "VERL_NPU_AUTOPATCH_REPORT_DIR='reports' is not an absolute path" in warnings[0]
            )
        status = subprocess.run(
            [str(base_python), "-m", "verl_npu_autopatch", "status", "--json"], env=env, cwd=cwd, capture_output=True
        )
        shown = json.loads(status.stdout)["configuration"]["report_dir"]
        assert shown == (str(home / "reports") if raw == "~/reports" else None)
    assert list(cwd.iterdir()) == []  # no ./~/reports, no ./reports


def test_forked_children_write_their_own_files_at_once(base_python: Path, tmp_path: Path) -> None:
    # two os.fork children (one forked while another thread holds the engine's and the file's
    # locks) and a multiprocessing 'fork' child, all alive: four files (and none for a subprocess
    # forked by a preexec_fn only to run another program)
    code = """
import json, multiprocessing, os, subprocess, sys, threading, vllm.model, verl_npu_autopatch
from verl_npu_autopatch.engine import lifecycle as engine
directory = os.environ["VERL_NPU_AUTOPATCH_REPORT_DIR"]

def fork_child():
    ready, go = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(ready[1], b"x")
        os.read(go[0], 1)
        os._exit(0)
    os.read(ready[0], 1)
    return pid, go[1]

children = [fork_child()]
taken, release = threading.Event(), threading.Event()
def hold():
    with engine.engine().slots.lock, engine.engine().slots.on_change.__self__._lock:
        taken.set()
        release.wait()
holder = threading.Thread(target=hold)
holder.start()
taken.wait()
children.append(fork_child())  # the locks are held by a thread the child does not have
release.set()
holder.join()

def wait(ready, go):
    ready.set()
    go.wait(60)
context = multiprocessing.get_context("fork")
ready, go = context.Event(), context.Event()
process = context.Process(target=wait, args=(ready, go))
process.start()
ready.wait(60)
subprocess.run([sys.executable, "-c", "pass"], preexec_fn=os.getpid)  # forked to exec at once: no file
pids = sorted([os.getpid(), process.pid, *(pid for pid, _ in children)])
written = sorted(json.load(open(os.path.join(directory, f)))["pid"] for f in os.listdir(directory))
go.set()
for pid, release_child in children:
    os.write(release_child, b"x")
    os.waitpid(pid, 0)
process.join(60)
print(json.dumps([pids, written]))
"""
    out = run(base_python, code, env=_env(tmp_path / "reports"), timeout=60)
    pids, written = json.loads(out.stdout.splitlines()[-1])
    assert written == pids and len(pids) == 4


def test_an_exec_changes_the_image_the_report_names(base_python: Path, tmp_path: Path) -> None:
    # same pid, same start time, another program: the file's "image" no longer matches the pid's
    reports = tmp_path / "reports"
    code = """
import os, sys, vllm.model
env = {**os.environ, "VERL_NPU_AUTOPATCH": "0"}
after = "import json, os, sys; print(json.dumps(os.getpid()), flush=True); sys.stdin.readline()"
os.execve(sys.executable, [sys.executable, "-c", after], env)
"""
    env = clean_env(PYTHONPATH=str(FIXTURE_SITE), **_env(reports))
    proc = subprocess.Popen(
        [str(base_python), "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        pid = json.loads(proc.stdout.readline() if proc.stdout else "")
        look = f"from verl_npu_autopatch.engine import report_file as r; print(r.image({pid}), r.start_time({pid}))"
        live_image, live_start = run(base_python, look).stdout.split()
    finally:
        proc.communicate("\n", timeout=60)
    [report] = _reports(reports)
    assert report["pid"] == pid and report["start"] == int(live_start)  # the pid and start time match
    assert isinstance(report["image"], int) and report["image"] != int(live_image)  # the program does not
    assert report["timens"] == os.readlink("/proc/self/ns/time")
