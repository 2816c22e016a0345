"""Report files as ``fleet`` may find them in a directory other users can write: one valid report
to start from, and one malformation per file of every kind the reader must refuse (each a
separate fault named in issue 37)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

#: What a CPython ``"\x1b]0;..."`` title change, a screen clear and a right-to-left override look like.
ESCAPES = "\x1b]0;owned\x07\x1b[2J\u202ehidden\x9b"


def valid_report(**fields: Any) -> dict[str, Any]:
    """A report as the writer makes it (format 1, with the newer ``image`` and ``timens``), from
    another host and written now, with ``fields`` replacing its own."""
    report = {
        "host": "node-7",
        "boot_id": "0b7a5e52-5a4e-4e0b-8c7d-3f0c5d0e0a11",
        "pidns": "pid:[4026531836]",
        "timens": "time:[4026531834]",
        "pid": 4242,
        "start": 1234,
        "image": 140737488347136,
        "argv": ["python3", "train.py"],
        "title": "python3 train.py",
        "python": "3.11.7",
        "executable": "/usr/bin/python3",
        "format": 1,
        "written": time.time(),
        "status": "active",
        "reason": "activated by vllm",
        "trigger": "vllm",
        "device": "npu",
        "warnings": [],
        "versions": {"verl-npu-autopatch": "1.0", "vllm": "0.32.0"},
        "records": [{"name": "fixture.forward", "state": "applied", "reason": "patched"}],
    }
    report.update(fields)
    return report


def _stat_field(pid: int, field: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[field - 3])


def local_report(pid: int, **fields: Any) -> dict[str, Any]:
    """A report of the live process ``pid`` on this host, as a writer of the new format makes it."""
    return valid_report(
        host=os.uname().nodename,
        boot_id=Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        pidns=os.readlink(f"/proc/{pid}/ns/pid"),
        timens=os.readlink(f"/proc/{pid}/ns/time"),
        pid=pid,
        start=_stat_field(pid, 22),
        image=_stat_field(pid, 28),
        **fields,
    )


def _with(**fields: Any) -> bytes:
    return json.dumps(valid_report(**fields)).encode()


def _without(field: str) -> bytes:
    report = valid_report()
    del report[field]
    return json.dumps(report).encode()


#: File name -> content: each must be listed unreadable, none may stop ``fleet``.
MALFORMED: dict[str, bytes] = {
    "deep.json": b"[" * 200_000 + b"]" * 200_000,
    "deep-object.json": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "host-list.json": _with(host=["a", "b"]),
    "host-long.json": _with(host="h" * 5000),
    "boot-null.json": _with(boot_id=None),
    "pidns-number.json": _with(pidns=4026531836),
    "timens-list.json": _with(timens=["time"]),
    "pid-string.json": _with(pid="1", start=None),
    "pid-path.json": _with(pid="../../etc"),
    "pid-bool.json": _with(pid=True),
    "pid-zero.json": _with(pid=0),
    "pid-negative.json": _with(pid=-5),
    "pid-huge.json": _with(pid=2**22 + 1),
    "pid-float.json": _with(pid=4242.0),
    "pid-digits.json": _with(pid="x").replace(b'"pid": "x"', b'"pid": ' + b"9" * 5000),
    "start-string.json": _with(start="1234"),
    "start-negative.json": _with(start=-1),
    "image-string.json": _with(image="x"),
    "written-missing.json": _without("written"),
    "written-string.json": _with(written="yesterday"),
    "written-nan.json": _with(written=float("nan")),
    "written-infinite.json": _with(written=float("-inf")),
    "written-bool.json": _with(written=True),
    "status-unknown.json": _with(status="fine"),
    "status-missing.json": _without("status"),
    "reason-number.json": _with(reason=3),
    "records-object.json": _with(records={"a": "applied"}),
    "records-missing.json": _without("records"),
    "record-string.json": _with(records=["applied"]),
    "record-state.json": _with(records=[{"name": "p", "state": "owned", "reason": ""}]),
    "record-name.json": _with(records=[{"name": ["p"], "state": "applied", "reason": ""}]),
    "versions-list.json": _with(versions=["1.0"]),
    "versions-value.json": _with(versions={"vllm": 32}),
    "versions-missing.json": _without("versions"),
    "argv-string.json": _with(argv="python3 train.py"),
    "argv-number.json": _with(argv=[1]),
    "warnings-null.json": _with(warnings=[None]),
    "title-number.json": _with(title=5),
    "format-2.json": _with(format=2),
    "format-true.json": _with(format=True),
    "top-list.json": b"[1, 2]",
    "not-json.json": b"\x00\x01garbage",
    "not-utf8.json": b'{"host": "\xff\xfe"}',
    "empty.json": b"",
    "escape\x1b[2J\u202ename.json": b"{}",
    "too-large.json": _with(reason="r" * (1 << 20)),  # valid, but larger than any report
}


def write_malformed(directory: Path) -> list[str]:
    """Every :data:`MALFORMED` file, a FIFO, two links (to ``/dev/zero`` and to a valid report)
    and a directory, each named ``*.json``, into ``directory``: their paths."""
    for name, content in MALFORMED.items():
        (directory / name).write_bytes(content)
    os.mkfifo(directory / "fifo.json")
    (directory / "zero.json").symlink_to("/dev/zero")
    target = directory / "elsewhere"
    target.mkdir()
    (target / "real").write_text(json.dumps(valid_report()))
    (directory / "link.json").symlink_to(target / "real")
    (directory / "dir.json").mkdir()
    names = [*MALFORMED, "fifo.json", "zero.json", "link.json", "dir.json"]
    return sorted(str(directory / name) for name in names)
