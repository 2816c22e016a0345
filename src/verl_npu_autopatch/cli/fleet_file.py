"""One report file read the way ``fleet`` reads every file: as untrusted input. The directory may be
writable by other users and the file may come from another host, so a file is used only when it is
a regular file (never a link followed, never a FIFO waited on), owned by the reader, root or the
directory's owner, at most :data:`MAX_BYTES` long, and valid against the report's schema: every
field of the right type and range, every text bounded. Anything else raises :class:`Unreadable`
with the reason, which ``fleet`` lists.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from typing import Any, get_args

from verl_npu_autopatch.engine.records import EngineStatus, RecordState
from verl_npu_autopatch.engine.report_file import FORMAT
from verl_npu_autopatch.engine.text import REASON_CHARS, cut, describe

__all__ = ["INCOMPLETE", "MAX_BYTES", "MAX_PID", "Unreadable", "checked", "read"]

#: Largest file read: a real report is a few kB (its arguments and reasons are bounded).
MAX_BYTES = 1 << 20
#: Longest host name, boot id or namespace accepted.
ID_CHARS = 256
#: The largest pid Linux hands out (``pid_max`` at most 2**22).
MAX_PID = 1 << 22
#: How the writer renames its file when a rewrite failed: the last complete state, kept.
INCOMPLETE = ".incomplete.json"
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_STATUSES = frozenset(get_args(EngineStatus))
_STATES = frozenset(get_args(RecordState))
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a link"}


class Unreadable(Exception):
    """Why a file is not used; its text is what ``fleet`` lists."""


def read(path: str, owners: frozenset[int]) -> tuple[dict[str, Any], float]:
    """The checked content of the report file at ``path`` and its modification time (the clock of
    the filesystem that holds it). Raises :class:`Unreadable`, and nothing else for any content."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Unreadable("a symbolic link (not followed)") from None
        raise Unreadable(describe(exc)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "a device")
            raise Unreadable(f"not a regular file ({kind})")
        if info.st_uid not in owners:
            raise Unreadable(f"owned by uid {info.st_uid}: not by the directory's owner or root")
        raw = _read_bounded(fd, info.st_size)
    except OSError as exc:
        raise Unreadable(describe(exc)) from None
    finally:
        os.close(fd)
    try:
        data = json.loads(raw)
    except RecursionError:
        raise Unreadable("not a report file: JSON nested too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of thousands of digits
        raise Unreadable(f"not JSON: {describe(exc, 200)}") from None
    return checked(data), info.st_mtime


def _read_bounded(fd: int, size: int) -> bytes:
    """At most :data:`MAX_BYTES` of ``fd``; a file that is (or grows) larger is refused."""
    if size > MAX_BYTES:
        raise Unreadable(f"larger than {MAX_BYTES:,} bytes ({size:,})")
    chunks, left = [], MAX_BYTES + 1
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    if left <= 0:
        raise Unreadable(f"larger than {MAX_BYTES:,} bytes")
    return b"".join(chunks)


def _bad(field: str, expected: str) -> Unreadable:
    return Unreadable(f"not a valid report file: field {field!r} is not {expected}")


def _str(value: object, field: str, limit: int = REASON_CHARS, strict: bool = False) -> str:
    """``value`` if a string; cut to ``limit`` (or refused when ``strict``: an identity)."""
    if type(value) is not str:
        raise _bad(field, "a string")
    if len(value) > limit:
        if strict:
            raise _bad(field, f"a string of at most {limit} characters")
        return cut(value, limit)
    return value


def _int(value: object, field: str, low: int, high: float = math.inf, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if type(value) is not int or not low <= value <= high:
        bounds = f"from {low:,} to {high:,}" if high != math.inf else f"at least {low:,}"
        raise _bad(field, f"an integer {bounds}" + (" or null" if optional else ""))
    return value


def _strings(value: object, field: str) -> list[str]:
    if type(value) is not list:
        raise _bad(field, "a list of strings")
    return [_str(item, f"{field}[{index}]") for index, item in enumerate(value)]


def _record(value: object, index: int) -> dict[str, str]:
    if type(value) is dict:  # the common case, checked without building a field name per record
        name, state, reason = value.get("name"), value.get("state"), value.get("reason")
        if (
            type(name) is str
            and type(reason) is str
            and type(state) is str
            and state in _STATES
            and len(name) <= REASON_CHARS
            and len(reason) <= REASON_CHARS
        ):
            return {"name": name, "state": state, "reason": reason}
    field = f"records[{index}]"
    if type(value) is not dict:
        raise _bad(field, "an object")
    state = value.get("state")
    if state not in _STATES or type(state) is not str:
        raise _bad(f"{field}.state", "a record state")
    name, reason = _str(value.get("name"), f"{field}.name"), _str(value.get("reason"), f"{field}.reason")
    return {"name": name, "state": state, "reason": reason}


def checked(data: object) -> dict[str, Any]:
    """``data`` (a parsed file) as a report with only the schema's fields, each checked; the
    fields newer writers add (``image``, ``timens``) may be missing. Raises :class:`Unreadable`."""
    if type(data) is not dict or type(data.get("format")) is not int or data["format"] != FORMAT:
        raise Unreadable(f"not a report file of format {FORMAT}")
    written = data.get("written")
    if not isinstance(written, (int, float)) or type(written) is bool or not math.isfinite(written):
        raise _bad("written", "a finite number")
    status = data.get("status")
    if status not in _STATUSES or type(status) is not str:
        raise _bad("status", "an engine status")
    records, versions = data.get("records"), data.get("versions")
    if type(records) is not list:
        raise _bad("records", "a list")
    if type(versions) is not dict or not all(v is None or type(v) is str for v in versions.values()):
        raise _bad("versions", "an object of strings or nulls")
    return {
        "format": FORMAT,
        **{key: _str(data.get(key), key, ID_CHARS, strict=True) for key in ("host", "boot_id", "pidns")},
        "timens": _str(data.get("timens", ""), "timens", ID_CHARS, strict=True),
        "pid": _int(data.get("pid"), "pid", 1, MAX_PID),
        "start": _int(data.get("start"), "start", 0, optional=True),
        "image": _int(data.get("image"), "image", 0, optional=True),
        "written": written,
        "status": status,
        "reason": _str(data.get("reason"), "reason"),
        **{key: _str(data.get(key, ""), key) for key in ("trigger", "device")},
        **{key: _str(data.get(key), key) for key in ("python", "executable", "title")},
        "argv": _strings(data.get("argv"), "argv"),
        "warnings": _strings(data.get("warnings"), "warnings"),
        "versions": {cut(k, ID_CHARS): v if v is None else cut(v, REASON_CHARS) for k, v in versions.items()},
        "records": [_record(record, index) for index, record in enumerate(records)],
    }
