"""``VERL_NPU_AUTOPATCH_REPORT_DIR`` and ``verl-npu-autopatch fleet`` with real child interpreters
(a venv with the built wheel): live processes, including ``spawn`` children, write their report
files; ``fleet`` reads them while they run and after they are gone."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.children import FIXTURE_SITE, clean_env, run

NPU = {"VERL_NPU_AUTOPATCH_DEVICE": "npu"}
LIVE = "import autopatch_live; autopatch_live.main()"


def _env(report_dir: Path, **extra: str) -> dict[str, str]:
    return clean_env(PYTHONPATH=str(FIXTURE_SITE), VERL_NPU_AUTOPATCH_REPORT_DIR=str(report_dir), **NPU, **extra)


@contextmanager
def live_job(python: Path, report_dir: Path, **extra: str) -> Iterator[dict[str, int]]:
    """A parent (``python -c``) and its ``spawn`` child, both activated and alive inside the block."""
    proc = subprocess.Popen(
        [str(python), "-c", LIVE],
        env=_env(report_dir, **extra),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            raise AssertionError(f"the live job did not start: {proc.communicate(timeout=60)[1]}")
        yield json.loads(line)
    finally:
        proc.communicate("\n", timeout=120)


def fleet(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "verl_npu_autopatch", "fleet", *args],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def fleet_json(python: Path, *args: str) -> tuple[dict, int]:
    proc = fleet(python, "--json", *args)
    return json.loads(proc.stdout), proc.returncode


def test_live_processes_and_spawned_children_write_reports_that_fleet_compares(
    base_python: Path, tmp_path: Path
) -> None:
    report_dir = tmp_path / "reports"  # created by the first write
    with (
        live_job(base_python, report_dir) as plain,
        live_job(base_python, report_dir, AUTOPATCH_FIXTURE_BROKEN="1", AUTOPATCH_FIXTURE_CHECK="fixed") as odd,
    ):
        files = sorted(report_dir.glob("*.json"))
        assert len(files) == 4  # two parents, two spawn children: one file each
        written = {json.loads(f.read_text())["pid"]: json.loads(f.read_text()) for f in files}
        assert set(written) == {plain["pid"], plain["child"], odd["pid"], odd["child"]}
        child = written[odd["child"]]
        assert child["host"] == os.uname().nodename and child["python"].count(".") == 2
        assert "--multiprocessing-fork" in child["argv"] and child["versions"]["vllm"] == "0.32.0"
        records = {r["name"]: r for r in child["records"]}
        assert records["fixture.broken"]["state"] == "failed"
        assert records["fixture.broken"]["reason"] == "fix raised RuntimeError: boom from the fixture fix"
        assert records["fixture.forward"]["state"] == "applied"
        assert not list(report_dir.glob(".*"))  # no temporary file left behind

        data, code = fleet_json(base_python, str(report_dir))
        text = fleet(base_python, str(report_dir))
        full = fleet(base_python, "--all", str(report_dir))
    assert code == 1  # fixture.broken failed in two processes
    assert len(data["processes"]) == 4 and data["stale"] == []
    assert data["roles"] == {"driver": 2, "other": 2}  # the parents run `-c`; the spawn children are nameless
    [other] = [d for d in data["differing"] if d["patch"] == "fixture.other"]
    assert other["states"] == {"applied": 2, "fixed-upstream": 2}
    fixed = next(g for g in other["groups"] if g["state"] == "fixed-upstream")
    assert fixed["reason"] == "fixture says the upstream already has it" and fixed["roles"] == {"driver": 1, "other": 1}
    assert [d["patch"] for d in data["differing"]] == ["fixture.other"]  # every other patch is alike
    [broken] = [p for p in data["problems"] if p["patch"] == "fixture.broken"]
    assert broken["count"] == 2 and broken["state"] == "failed"
    assert data["matrix"]["fixture.other"] == {
        "driver": {"applied": 1, "fixed-upstream": 1},
        "other": {"applied": 1, "fixed-upstream": 1},
    }

    assert text.returncode == 1
    lines = text.stdout.splitlines()
    assert max(map(len, lines)) <= 120
    assert lines[0].startswith("verl-npu-autopatch fleet: 4 live processes in ")
    assert "  roles: driver 2, other 2" in lines
    assert "  fixture.other: applied 2, fixed-upstream 2" in lines
    assert any(line.startswith("uniform: ") and "patches alike everywhere" in line for line in lines)
    assert any("fixture.broken: failed in 2" in line and "boom from the fixture fix" in line for line in lines)
    full_lines = full.stdout.splitlines()
    assert max(map(len, full_lines)) <= 120 and full.returncode == 1
    assert any(line.split()[:2] == ["fixture.forward", "applied"] for line in full_lines)

    # the job is over: every file is stale now, shown apart, and nothing is left to judge
    data, code = fleet_json(base_python, str(report_dir))
    assert code == 2 and data["processes"] == [] and len(data["stale"]) == 4
    assert {p["liveness"] for p in data["stale"]} == {"process gone"}
    listing = " ".join(fleet(base_python, "--stale", str(report_dir)).stdout.split())  # wrapped at 120 columns
    assert "0 live processes" in listing and "4 stale" in listing and "process gone" in listing


def test_uniform_job_exits_zero_and_several_directories_add_up(base_python: Path, tmp_path: Path) -> None:
    first, second = tmp_path / "node-a", tmp_path / "node-b"
    with live_job(base_python, first) as a, live_job(base_python, second) as b:
        data, code = fleet_json(base_python, str(first), str(second), str(first))  # the first twice: counted once
        alone, _ = fleet_json(base_python, str(second))
    assert code == 0 and data["problems"] == [] and data["differing"] == []
    assert sorted(p["pid"] for p in data["processes"]) == sorted([a["pid"], a["child"], b["pid"], b["child"]])
    assert sorted(p["pid"] for p in alone["processes"]) == sorted([b["pid"], b["child"]])


def test_report_is_refreshed_when_a_decision_changes(base_python: Path, tmp_path: Path) -> None:
    code = """
import glob, json, os, vllm.model
def state():
    [path] = glob.glob(os.path.join(os.environ["VERL_NPU_AUTOPATCH_REPORT_DIR"], "*.json"))
    return {r["name"]: r["state"] for r in json.load(open(path))["records"]}["fixture.early"]
before = state()
import autopatch_target  # the target of fixture.early: a new decision
print(json.dumps([before, state()]))
"""
    out = run(base_python, code, env={**NPU, "VERL_NPU_AUTOPATCH_REPORT_DIR": str(tmp_path)})
    assert json.loads(out.stdout.splitlines()[-1]) == ["pending", "applied"]


def test_threads_deciding_at_once_leave_the_last_decisions_in_the_file(base_python: Path, tmp_path: Path) -> None:
    code = """
import glob, json, os, threading
import verl_npu_autopatch
barrier = threading.Barrier(8)
def work(i):
    barrier.wait()
    for _ in range(20):
        if i % 4 == 0:
            import vllm.model
        elif i % 4 == 1:
            import autopatch_target
        elif i % 4 == 2:
            verl_npu_autopatch.revert("fixture.early")  # a decision taken with the engine's lock held
        verl_npu_autopatch.report()
threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
[path] = glob.glob(os.path.join(os.environ["VERL_NPU_AUTOPATCH_REPORT_DIR"], "*.json"))
written = {r["name"]: r["state"] for r in json.load(open(path))["records"]}
print(json.dumps([written == verl_npu_autopatch.report().states(), written["fixture.forward"]]))
"""
    env = {**NPU, "VERL_NPU_AUTOPATCH_REPORT_DIR": str(tmp_path), "AUTOPATCH_FIXTURE_SLOW": "1"}
    assert json.loads(run(base_python, code, env=env, timeout=120).stdout.splitlines()[-1]) == [True, "applied"]


def test_unwritable_or_vanished_directory_is_one_warning_and_patching_goes_on(
    base_python: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    observe = """
import json, autopatch_target, vllm.model, verl_npu_autopatch
report = verl_npu_autopatch.report()
print(json.dumps([report["fixture.forward"].state, report["fixture.early"].state, vllm.model.Layer().forward(1),
                  report.warnings]))
"""
    unwritable = run(base_python, observe, env={**NPU, "VERL_NPU_AUTOPATCH_REPORT_DIR": str(blocker / "reports")})
    forward, early, result, warnings = json.loads(unwritable.stdout.splitlines()[-1])
    assert (forward, early, result) == ("applied", "applied", 12)
    assert unwritable.stderr.count("cannot write the process report") == 1
    assert len(warnings) == 1 and "patching is not affected" in warnings[0] and "NotADirectoryError" in warnings[0]

    vanishing = tmp_path / "vanishing"
    code = """
import json, shutil, vllm.model, verl_npu_autopatch, os
shutil.rmtree(os.environ["VERL_NPU_AUTOPATCH_REPORT_DIR"])  # written at activation; gone now
import autopatch_target  # a decision: the rewrite fails
verl_npu_autopatch.revert("fixture.early")  # another one: no second warning
report = verl_npu_autopatch.report()
print(json.dumps([report["fixture.early"].state, report["fixture.forward"].state, len(report.warnings)]))
"""
    vanished = run(base_python, code, env={**NPU, "VERL_NPU_AUTOPATCH_REPORT_DIR": str(vanishing)})
    assert json.loads(vanished.stdout.splitlines()[-1]) == ["reverted", "applied", 1]
    assert vanished.stderr.count("cannot write the process report") == 1 and "FileNotFoundError" in vanished.stderr
    assert not vanishing.exists()  # never re-created behind the user's back


def test_inactive_host_and_start_up_never_load_the_writer(base_python: Path, tmp_path: Path) -> None:
    code = """
import json, sys, vllm.model
import verl_npu_autopatch
print(json.dumps([verl_npu_autopatch.report().status, "verl_npu_autopatch.engine.report_file" in sys.modules]))
"""
    env = {"VERL_NPU_AUTOPATCH_REPORT_DIR": str(tmp_path / "inactive")}
    assert json.loads(run(base_python, code, env=env).stdout.splitlines()[-1]) == ["inactive", False]
    start = "import json, sys; print(json.dumps(sorted(m for m in sys.modules if 'autopatch' in m)))"
    assert json.loads(run(base_python, start, env={**env, **NPU}).stdout.splitlines()[-1]) == []
    assert not (tmp_path / "inactive").exists()


def test_files_from_another_host_are_stale_after_the_threshold(base_python: Path, tmp_path: Path) -> None:
    with live_job(base_python, tmp_path):
        pass  # two real files, then the processes end
    for path in tmp_path.glob("*.json"):  # as if written on another node: 2 h ago and just now
        data = json.loads(path.read_text())
        data.update(
            host="elsewhere", written=data["written"] - (7200 if data["argv"][-1] == "--multiprocessing-fork" else 0)
        )
        path.write_text(json.dumps(data))
        os.utime(path, (data["written"], data["written"]))  # the filesystem's clock agrees
    data, code = fleet_json(base_python, "--stale-after", "1", str(tmp_path))
    assert code == 0 and [p["role"] for p in data["processes"]] == ["driver"]
    assert data["processes"][0]["liveness"].endswith("ago on another host")
    assert [p["liveness"] for p in data["stale"]] == ["written 2.0 h ago on another host (stale)"]
    data, _ = fleet_json(base_python, "--stale-after", "0", str(tmp_path))  # 0: never by age
    assert len(data["processes"]) == 2 and data["stale"] == []
