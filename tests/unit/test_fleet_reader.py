"""``fleet``'s reader in process: every hostile file refused with a reason, liveness judged through a
synthetic ``/proc`` (time namespaces, ``hidepid``, exec), other hosts' clocks, what the screen
shows of foreign text, ``--stale-after`` and the answers of ``fleet --ray``'s nodes (issue 37)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.hostile_reports import ESCAPES, MALFORMED, valid_report, write_malformed
from verl_npu_autopatch.cli import fleet, fleet_file, fleet_ray, fleet_view
from verl_npu_autopatch.engine import report_file

PID = 77
HERE = {"host": "node-7", "boot_id": "b", "pidns": "pid:[1]", "timens": "time:[1]"}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_every_malformed_file_is_refused_with_a_reason(tmp_path: Path, name: str) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(MALFORMED[name])
    with pytest.raises(fleet_file.Unreadable) as raised:
        fleet_file.read(str(path), frozenset({0, path.stat().st_uid}))
    assert str(raised.value)


def test_read_directories_lists_every_bad_file_and_never_raises(tmp_path: Path) -> None:
    bad = write_malformed(tmp_path)
    (tmp_path / "good.json").write_text(json.dumps(valid_report()))
    read = fleet.read_directories([str(tmp_path)])
    assert sorted(item["file"] for item in read["unreadable"]) == bad
    assert [p["host"] for p in read["processes"]] == ["node-7"]


def test_a_valid_file_keeps_only_the_schemas_fields_and_older_writers_pass(tmp_path: Path) -> None:
    older = valid_report(extra={"x": [1] * 10}, reason="r" * 5000)
    del older["image"], older["timens"]
    data = fleet_file.checked(older)
    assert "extra" not in data and data["image"] is None and data["timens"] == ""
    assert len(data["reason"]) < 2100 and data["reason"].endswith("(5,000 characters)")


def _proc(root: Path, pid: int, start: int | None, image: int = 4096, offset: str | None = None) -> None:
    """A synthetic ``/proc``: fleet's own time namespace (offset 0), and process ``pid``."""
    (root / "self" / "ns").mkdir(parents=True, exist_ok=True)
    if not (root / "self" / "ns" / "time").is_symlink():
        (root / "self" / "ns" / "time").symlink_to(HERE["timens"])
    (root / "self" / "timens_offsets").write_text("monotonic 0 0\nboottime 0 0\n")
    if start is None:
        return  # hidden, or gone
    fields = ["0"] * 50
    fields[22 - 3], fields[28 - 3] = str(start), str(image)
    (root / str(pid)).mkdir(exist_ok=True)
    (root / str(pid) / "stat").write_text(f"{pid} (a) b) S " + " ".join(fields[1:]) + "\n")
    if offset is not None:
        (root / str(pid) / "timens_offsets").write_text(f"monotonic 0 0\nboottime {offset}\n")


def _judge(monkeypatch: pytest.MonkeyPatch, root: Path, **fields: Any) -> dict[str, Any]:
    monkeypatch.setattr(report_file, "PROC", str(root))
    data = fleet_file.checked(valid_report(**{**HERE, "pid": PID, "start": 500, "image": 4096, **fields}))
    here = {**HERE, "timens": fleet._readlink("self", "ns/time")}
    return fleet.judge(data, here, time.time(), fleet.STALE_AFTER_S)


def test_same_namespace_start_and_image_decide(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _proc(tmp_path, PID, start=500)
    assert _judge(monkeypatch, tmp_path)["liveness"] == "running"
    assert _judge(monkeypatch, tmp_path, start=499)["liveness"] == "process gone (its pid was reused)"
    execd = _judge(monkeypatch, tmp_path, image=8192)
    assert (execd["live"], execd["liveness"]) == (False, "process gone (the pid now runs another program: exec)")
    assert _judge(monkeypatch, tmp_path, image=None)["liveness"] == "running"  # an older writer: not checked


def test_another_time_namespace_is_read_back_through_its_offset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _proc(tmp_path, PID, start=500, offset="100000 0")
    shifted = 500 + 100000 * fleet._ticks_per_second()  # what the writer read of itself
    assert _judge(monkeypatch, tmp_path, timens="time:[2]", start=shifted)["liveness"] == "running"
    reused = _judge(monkeypatch, tmp_path, timens="time:[2]", start=shifted + 50)
    assert reused["liveness"] == "process gone (its pid was reused)"


def test_another_time_namespace_that_cannot_be_read_is_not_called_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _proc(tmp_path, PID, start=500)  # no timens_offsets: no access to it
    judged = _judge(monkeypatch, tmp_path, timens="time:[2]", start=10_000_500)
    assert (judged["live"], judged["liveness"]) == (True, "running (start time not checked: another time namespace)")


@pytest.mark.parametrize(
    ("exists", "expected"), [(True, "running (cannot check its start time: /proc hides it)"), (False, "process gone")]
)
def test_a_pid_proc_hides_is_asked_of_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exists: bool, expected: str
) -> None:
    _proc(tmp_path, PID, start=None)
    monkeypatch.setattr(fleet, "_running", lambda pid: exists)
    judged = _judge(monkeypatch, tmp_path)
    assert (judged["live"], judged["liveness"]) == (exists, expected)


def test_another_host_is_stale_only_when_both_clocks_say_so() -> None:
    now = time.time()
    day = 86400.0

    def liveness(written: float, modified: float, stale_after: float = day) -> tuple[bool, str]:
        return fleet._elsewhere({"written": written, "modified": modified}, now, stale_after)

    assert liveness(now - 30 * 3600, now)[0] is True
    assert liveness(now - 30 * 3600, now - 30 * 3600) == (False, "written 30.0 h ago on another host (stale)")
    assert liveness(now + 2 * day, now) == (True, "written on another host (clock ahead by 48.0 h)")
    assert liveness(now - 300 * day, now - 300 * day, 0)[0] is True  # 0: never by age


@pytest.mark.parametrize("value", ["nan", "-1", "-inf", "inf", "1e999"])
def test_stale_after_refuses_what_is_not_a_finite_number_of_hours(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        fleet_view._hours(value)
    assert fleet_view._hours("0") == 0.0 and fleet_view._hours("2.5") == 2.5


def test_the_screen_escapes_and_cuts_every_foreign_text(tmp_path: Path) -> None:
    failing = {"name": "p" + ESCAPES, "state": "failed", "reason": ESCAPES + "x" * 5000}
    good = valid_report(host="h" + ESCAPES, records=[failing], python=ESCAPES, versions={"verl-npu-autopatch": ESCAPES})
    (tmp_path / "good.json").write_text(json.dumps(good))
    (tmp_path / f"bad{ESCAPES}\udcff.json").write_text("{}")  # a non-UTF-8 name too
    read = fleet.read_directories([str(tmp_path)])
    data = fleet.view(read, [str(tmp_path) + ESCAPES], True, True)
    text = fleet_view.render(data, full=True, stale=True)
    text.encode("utf-8")  # printable on any UTF-8 terminal: no lone surrogate left
    assert not any(raw in text for raw in ("\x1b", "\x07", "\x9b", "\u202e", "\udcff"))
    assert (
        "\\x1b[2J" in text
        and "characters)" in text
        and "x" * 400 not in text
        and max(map(len, text.splitlines())) <= 120
    )


def test_a_nodes_answer_is_checked_as_a_file_is() -> None:
    judged = {"file": "f", "liveness": "running", "title": "", "role": "driver", "live": True, "incomplete": False}
    good = valid_report() | judged
    answer = {"processes": [good, valid_report(pid="../x") | judged, "junk"], "stale": None, "unreadable": [1]}
    found = fleet_ray._checked(answer, "node 1")
    assert [p["pid"] for p in found["processes"]] == [4242]
    assert found["unreadable"] == [{"file": "node 1", "error": "3 entries of its answer are not valid"}]
    assert fleet_ray._checked(["x"], "node 2")["unreadable"][0]["error"] == "an answer of type list"
