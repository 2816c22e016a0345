"""The report writer's logic in-process (``report_file``, issue 37): names, bounded content, the
temporary file created exclusively, a failed rewrite that leaves the report marked incomplete, and
``VERL_NPU_AUTOPATCH_REPORT_DIR`` / ``_REPORT_MODE`` as the configuration reads them. Child
interpreters, forks, exec and other users: tests/reliability/test_report_dir.py."""

from __future__ import annotations

import _thread
import errno
import json
import os
import stat
import threading
from pathlib import Path

import pytest

from verl_npu_autopatch.engine import report_file
from verl_npu_autopatch.engine.config import read_config
from verl_npu_autopatch.engine.records import Record
from verl_npu_autopatch.engine.slots import Slots
from verl_npu_autopatch.engine.text import REASON_CHARS


class FakeEngine:
    """What the writer reads of an engine: a status, reasons, warnings and records."""

    def __init__(self, reason: str = "activated by vllm", warnings: list[str] | None = None) -> None:
        self.slots = Slots()
        self.status, self.reason, self.trigger, self.device = "active", reason, "vllm", "npu"
        self.warnings = warnings or []
        self.record = Record("fixture.one", ("fixture",), "vllm.model:Layer.forward", "pending", "not imported yet")

    @property
    def records(self) -> dict[str, Record]:
        return {self.record.name: self.record}


def written(directory: Path) -> dict:
    [path] = directory.glob("*.json")
    return json.loads(path.read_text())


def test_file_name_holds_the_pid_namespace() -> None:
    # two containers, one host name, each trainer pid 1, started in the same tick: two names
    first = {"host": "node-1", "pid": 1, "start": 4242, "pidns": "pid:[4026531836]"}
    second = {**first, "pidns": "pid:[4026532501]"}
    assert report_file.file_name(first) == "node-1-1-4242-4026531836.json"
    assert report_file.file_name(first) != report_file.file_name(second)
    assert report_file.file_name({**first, "pidns": "", "start": None}) == "node-1-1-0-0.json"  # unknown: 0
    here = report_file.identity()
    assert report_file.file_name(here).endswith(f"-{os.stat('/proc/self/ns/pid').st_ino}.json")


def test_identity_has_the_image_and_time_namespace() -> None:
    here = report_file.identity()
    assert here["timens"] == os.readlink("/proc/self/ns/time")
    startstack = Path("/proc/self/stat").read_text().rpartition(")")[2].split()[25]  # field 28
    assert here["image"] == report_file.image() == int(startstack) > 0
    assert report_file.image(2**22 + 7) is None  # no such process


def test_reasons_and_warnings_are_bounded_in_the_file(tmp_path: Path) -> None:
    huge = "x" * 219_000  # a 219 kB exception message
    engine = FakeEngine(reason=huge, warnings=[huge, "short"])
    engine.record.state, engine.record.reason = "failed", f"fix raised ValueError: {huge}"
    report_file.ReportFile(engine, str(tmp_path)).changed()  # type: ignore[arg-type]
    [path] = tmp_path.glob("*.json")
    assert path.stat().st_size < 4 * REASON_CHARS + 4096  # three cut texts and the rest: not 657 kB
    data = json.loads(path.read_text())
    assert data["records"][0]["reason"].endswith("... (219,023 characters)")
    assert data["reason"].endswith("(219,000 characters)") and data["warnings"][1] == "short"


def test_planted_names_are_never_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()
    report = report_file.ReportFile(engine, str(tmp_path))  # type: ignore[arg-type]
    name = report_file.file_name(report_file.identity())
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.write_text("precious")
    # the name the writer used before (predictable), and the next three random ones, all taken
    (tmp_path / f".{name}.{_thread.get_ident()}.tmp").symlink_to(victim)
    draws = iter([b"\x01" * 8, b"\x02" * 8, b"\x03" * 8])
    monkeypatch.setattr(os, "urandom", lambda n: next(draws, b"\x04" * n))
    (tmp_path / f".{name}.{'01' * 8}.tmp").symlink_to(victim)
    os.mkfifo(tmp_path / f".{name}.{'02' * 8}.tmp")  # opening it for writing would block for good
    (tmp_path / f".{name}.{'03' * 8}.tmp").write_text("someone's file")
    report.changed()
    monkeypatch.undo()
    assert victim.read_text() == "precious" and engine.warnings == []
    assert written(tmp_path)["records"][0]["state"] == "pending"
    assert stat.S_ISFIFO((tmp_path / f".{name}.{'02' * 8}.tmp").lstat().st_mode)
    assert (tmp_path / f".{name}.{'03' * 8}.tmp").read_text() == "someone's file"
    assert not (tmp_path / f".{name}.{'04' * 8}.tmp").exists()  # renamed into place


def test_a_failed_rewrite_leaves_the_report_incomplete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()
    report = report_file.ReportFile(engine, str(tmp_path))  # type: ignore[arg-type]
    report.changed()
    name = report_file.file_name(report_file.identity())
    assert (tmp_path / name).exists()
    replace = os.replace

    def full(src: str, dst: str, **kwargs: object) -> None:  # the temporary file's move fails
        if str(src).startswith("."):
            raise OSError(errno.ENOSPC, "No space left on device")
        replace(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", full)
    engine.record.state, engine.record.reason = "failed", "fix raised KeyError: 'w13'"
    report.changed()  # a decision the file cannot take: the old "pending" must not read as healthy
    engine.record.state = "reverted"
    report.changed()  # another one: still one warning
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [name.removesuffix(".json") + ".incomplete.json"]
    assert len(engine.warnings) == 1 and "No space left on device" in engine.warnings[0]
    assert "VERL_NPU_AUTOPATCH_REPORT_DIR" in engine.warnings[0]

    engine.record.state = "applied"
    report.changed()  # space again: the report is whole, the mark gone
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    assert written(tmp_path)["records"][0]["state"] == "applied" and len(engine.warnings) == 1


def test_a_directory_removed_while_the_job_runs_is_not_made_again(tmp_path: Path) -> None:
    directory = tmp_path / "reports"
    engine = FakeEngine()
    report = report_file.ReportFile(engine, str(directory))  # type: ignore[arg-type]
    report.changed()  # the first write makes it
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()  # the user cleans up while the job runs
    engine.record.state = "applied"
    report.changed()
    assert not directory.exists()
    assert len(engine.warnings) == 1 and "VERL_NPU_AUTOPATCH_REPORT_DIR" in engine.warnings[0]
    assert "FileNotFoundError" in engine.warnings[0]


def test_a_forked_child_never_waits_for_the_slots_lock(tmp_path: Path) -> None:
    # a thread the fork left behind may hold the lock for good: the child's write is skipped, not blocked
    engine = FakeEngine()
    report = report_file.ReportFile(engine, str(tmp_path))  # type: ignore[arg-type]
    report.changed()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with engine.slots.lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait()
    engine.record.state = "applied"
    child = threading.Thread(target=report.changed, kwargs={"wait": False}, daemon=True)
    child.start()
    child.join(30)
    blocked = child.is_alive()
    release.set()
    holder.join()
    assert not blocked
    assert written(tmp_path)["records"][0]["state"] == "pending"  # no write while the lock was held
    report.changed()
    assert written(tmp_path)["records"][0]["state"] == "applied"


def test_files_and_directories_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        engine = FakeEngine()
        report_file.ReportFile(engine, str(tmp_path / "a" / "b")).changed()  # type: ignore[arg-type]
        engine.slots.config = read_config({"VERL_NPU_AUTOPATCH_REPORT_MODE": "0640"})
        report_file.ReportFile(engine, str(tmp_path / "shared")).changed()  # type: ignore[arg-type]
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    name = report_file.file_name(report_file.identity())
    assert modes == {"a": 0o700, "a/b": 0o700, f"a/b/{name}": 0o600, "shared": 0o750, f"shared/{name}": 0o640}


def test_a_directory_others_may_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    for mode, refused in ((0o777, True), (0o770, True), (0o1777, False), (0o755, False)):
        directory = tmp_path / f"{mode:o}"
        directory.mkdir()
        directory.chmod(mode)
        engine = FakeEngine()
        report_file.ReportFile(engine, str(directory)).changed()  # type: ignore[arg-type]
        assert (list(directory.iterdir()) == []) == refused, oct(mode)
        assert len(engine.warnings) == refused, engine.warnings
        if refused:
            assert "VERL_NPU_AUTOPATCH_REPORT_DIR" in engine.warnings[0] and "no sticky bit" in engine.warnings[0]


def test_report_dir_is_expanded_or_refused_and_the_mode_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/someone")
    config = read_config({"VERL_NPU_AUTOPATCH_REPORT_DIR": "~/reports"})
    assert config.report_dir == "/home/someone/reports" and config.warnings == ()
    assert config.to_dict()["report_dir"] == "/home/someone/reports" and config.report_mode == 0o600
    relative = read_config({"VERL_NPU_AUTOPATCH_REPORT_DIR": "reports/job"})
    assert relative.report_dir == "" and len(relative.warnings) == 1
    assert "VERL_NPU_AUTOPATCH_REPORT_DIR='reports/job' is not an absolute path" in relative.warnings[0]
    for raw, mode in (("640", 0o640), ("0644", 0o644), ("0o604", 0o604), (" 600 ", 0o600)):
        config = read_config({"VERL_NPU_AUTOPATCH_REPORT_MODE": raw})
        assert (config.report_mode, config.warnings) == (mode, ()), raw
    for raw in ("666", "777", "0660", "rw-r--r--", "64O"):
        config = read_config({"VERL_NPU_AUTOPATCH_REPORT_MODE": raw})
        assert config.report_mode == 0o600 and len(config.warnings) == 1, raw
        assert config.warnings[0].startswith(f"VERL_NPU_AUTOPATCH_REPORT_MODE={raw!r} is not understood")
        assert "600 (default), 640, 604 or 644" in config.warnings[0]


def test_each_write_re_checks_the_records_against_the_live_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import sys

    from verl_npu_autopatch.authoring.patching import set_marked
    from verl_npu_autopatch.authoring.spec import Patch, Target
    from verl_npu_autopatch.engine.config import Config
    from verl_npu_autopatch.engine.lifecycle import Engine

    def plus_hundred(site):
        original = site.value
        return set_marked(site.owner, site.attribute, lambda x: original(x) + 100, site.patch.name)

    names = [f"report_target_{n}_{os.getpid()}" for n in ("a", "b")]
    labels = dict(zip(names, ("fixture.a", "fixture.b"), strict=True))
    for name in names:
        (tmp_path / f"{name}.py").write_text("def f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patches = [Patch(labels[n], "adds a hundred", (Target(n, "f"),), plus_hundred, device="any") for n in names]
    engine = Engine(patches, Config(device="npu"))
    engine.activate("unit")
    reports = tmp_path / "reports"
    reports.mkdir(mode=0o700)
    report_file.attach(engine, str(reports))
    try:
        first = importlib.import_module(names[0])
        first.f = lambda x: -1  # another owner takes the first target after us
        importlib.import_module(names[1])  # a later decision rewrites the file
        states = {r["name"]: r["state"] for r in written(reports)["records"]}
        assert first.f(1) == -1 and states == {"fixture.a": "superseded", "fixture.b": "applied"}
    finally:
        engine.slots.on_change = None
        report_file._attached.clear()
        for name in names:
            sys.modules.pop(name, None)
