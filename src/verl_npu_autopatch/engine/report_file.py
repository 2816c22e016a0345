"""The process's report file in ``VERL_NPU_AUTOPATCH_REPORT_DIR`` (read by ``fleet``): who this
process is and each record's state and reason, rewritten whenever a decision changes. Imported only
by an engine activated with the variable set; a failure to write is one warning, never an error.

The directory may be shared (docs/watching.md), so each write goes through a checked descriptor of
it (owned by this user or root, not writable by others without the sticky bit) into a temporary
file of a random name created exclusively (no planted link followed, no FIFO opened), then
``os.replace``d over the report: a reader sees the old report or the new one. A failed rewrite
renames the old report ``NAME.incomplete.json``, so nothing out of date reads as healthy.
"""

from __future__ import annotations

import _thread
import json
import os
import sys
import time

from verl_npu_autopatch._version import __version__
from verl_npu_autopatch.engine import log
from verl_npu_autopatch.engine.config import REPORT_MODE
from verl_npu_autopatch.engine.text import REASON_CHARS, cut, describe

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol

    from verl_npu_autopatch.engine.records import EngineStatus, Record
    from verl_npu_autopatch.engine.slots import Slots

    class Engine(Protocol):
        """What the report file reads of the engine (its slots get the file's refresh)."""

        slots: Slots
        reason: str
        trigger: str
        device: str
        warnings: list[str]

        @property
        def status(self) -> EngineStatus: ...
        @property
        def records(self) -> dict[str, Record]: ...


__all__ = ["FORMAT", "INCOMPLETE", "ReportFile", "attach", "file_name", "identity", "image", "start_time", "title"]

#: The file's layout version (``fleet`` skips a layout it does not know).
FORMAT = 1
#: How the name of a report whose rewrite failed ends (``NAME.json`` becomes ``NAME.incomplete.json``).
INCOMPLETE = ".incomplete.json"
#: Longest argument (and process title) kept, and how many arguments: a ``-c`` program can be long.
_ARG_CHARS, _ARGS = 300, 40
#: How often a temporary name found taken (planted) is drawn again.
_TRIES = 8
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
_STICKY, _OTHERS_WRITE = 0o1000, 0o022
#: Where processes are read (a synthetic tree in tests).
PROC = "/proc"

_attached: list[ReportFile] = []  # the engine's report file, refreshed in a forked child at once


def attach(engine: Engine, directory: str) -> None:
    """Give ``engine`` a report file in ``directory``, refreshed at every decision (and in a forked
    child at once), and write it now. Never raises."""
    try:
        report = ReportFile(engine, directory)
        engine.slots.on_change = report.changed
        if not _attached and hasattr(os, "register_at_fork"):  # once per process
            os.register_at_fork(after_in_child=_after_fork_in_child)
        _attached[:] = [report]
        report.changed()
    except Exception as exc:  # a bug here must not break the user's import; the file is extra
        log.logger().warning("verl-npu-autopatch: cannot write the process report: %s", describe(exc))


def _after_fork_in_child() -> None:
    """The child of ``os.fork()`` (its own pid and start time: its own file) writes its report now,
    not waiting for a lock a parent's thread may hold; not a ``subprocess`` child with a
    ``preexec_fn``, which runs another program next. Never raises."""
    try:
        caller = sys._getframe(1)
        if caller.f_code.co_name == "_execute_child" and caller.f_globals.get("__name__") == "subprocess":
            return
        for report in _attached:
            report.changed(wait=False)
    except Exception:  # a fork handler must not raise; the child's next decision writes its file
        pass


def proc_text(pid: int | str, name: str) -> str | None:
    """``/proc/PID/NAME`` (at most 4 kB read), or ``None`` where it cannot be read."""
    try:
        with open(f"{PROC}/{pid}/{name}", "rb") as f:
            return f.read(4096).decode("utf-8", "replace")
    except OSError:  # not Linux, gone, or hidden (hidepid): unknown
        return None


def proc_stat(pid: int | str, *fields: int) -> tuple[int | None, ...] | None:
    """Fields of ``/proc/PID/stat`` by their number in proc(5), each ``None`` if not a number;
    ``None`` if the file cannot be read."""
    text = proc_text(pid, "stat")
    if text is None:
        return None
    after = text.rpartition(")")[2].split()  # field 3 onwards: the command name (2) may hold anything
    values = [after[n - 3] if 3 <= n < len(after) + 3 else "" for n in fields]
    return tuple(int(v) if v.isdigit() and v.isascii() else None for v in values)


def start_time(pid: int | str = "self") -> int | None:
    """When process ``pid`` started, in clock ticks after boot (field 22), or ``None``: with the
    boot id, it tells a live process from a later one reusing its pid."""
    return (proc_stat(pid, 22) or (None,))[0]


def image(pid: int | str = "self") -> int | None:
    """Which program image ``pid`` runs: the bottom of its stack (field 28, ``startstack``), placed
    at random by every ``exec``; ``None`` where unknown (the kernel shows 0 to a reader that may
    not trace ``pid``)."""
    return (proc_stat(pid, 28) or (None,))[0] or None


def title(pid: int | str = "self") -> str:
    """``pid``'s title as ``ps`` shows it (``cmdline``, which ``setproctitle`` rewrites), or ""."""
    return (proc_text(pid, "cmdline") or "").replace("\0", " ").strip()[:_ARG_CHARS]


def _namespace(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")  # e.g. "pid:[4026531836]"
    except OSError:  # not Linux, or no such namespace kind: compared without it
        return ""


def identity() -> dict[str, Any]:
    """What tells this process from every other: host, boot, pid and time namespaces, pid, start
    time and program image (changed by ``exec``)."""
    return {
        "host": os.uname().nodename,
        "boot_id": (proc_text("sys", "kernel/random/boot_id") or "").strip(),
        "pidns": _namespace("pid"),
        "timens": _namespace("time"),
        "pid": os.getpid(),
        "start": start_time(),
        "image": image(),
    }


def file_name(found: dict[str, Any]) -> str:
    """``HOST-PID-START-PIDNS.json`` for an ``identity()`` (two containers may share a host name, a
    pid and a start tick, never a pid namespace: its inode number, 0 if unknown)."""
    host = "".join(c if c.isalnum() or c in "-._" else "_" for c in found["host"]) or "host"
    digits = (found.get("pidns") or "").rpartition("[")[2].rstrip("]")  # "pid:[4026531836]"
    inode = int(digits) if digits.isascii() and digits.isdigit() else 0
    return f"{host}-{found['pid']}-{found['start'] or 0}-{inode}.json"


class _Refused(Exception):
    """The directory is not safe to write into (another user may read or replace the files)."""


class ReportFile:
    """One process's report file; :meth:`changed` rewrites it when a decision changed."""

    def __init__(self, engine: Engine, directory: str) -> None:
        self._engine = engine
        self._directory = os.path.abspath(directory)  # the configuration gives it absolute already
        self._mode = getattr(engine.slots.config, "report_mode", REPORT_MODE)  # VERL_NPU_AUTOPATCH_REPORT_MODE
        self._lock = _thread.allocate_lock()  # over the file; never held while waiting for the slots' lock
        self._pid = os.getpid()  # whose identity this is (a forked child writes its own file)
        self._identity = identity()
        self._taken = 0  # snapshots taken (under the slots' lock: in the order of the decisions)
        self._written: tuple[int, object] = (0, None)  # the last snapshot written and its decisions
        self._may_create = True  # until a first write: a directory removed later is never made again
        self._incomplete = False  # a failed rewrite left NAME.incomplete.json: the next write removes it
        self._warned = False

    def changed(self, wait: bool = True) -> None:
        """Write the report if a decision changed since the last write. Never raises.

        The snapshot is taken under the slots' lock, the file written under this object's own, never
        the other way round (decisions are recorded under the slots' lock); a snapshot older than the
        last written is dropped, so the file never goes back. Without ``wait`` (a fork's child), a
        slots' lock held elsewhere means no write now."""
        if self._pid != os.getpid():  # a forked child: its own file, a lock of its own
            self._lock, self._pid, self._identity = _thread.allocate_lock(), os.getpid(), identity()
            self._written, self._incomplete = (0, None), False
        try:
            if wait:  # the states written are claims re-checked against the live code
                self._engine.slots.recheck()
            snapshot = self._snapshot(wait)
            if snapshot is None:  # held by a thread the fork left behind: the next decision writes
                return
            taken, decisions, data = snapshot
            with self._lock:
                if taken > self._written[0] and decisions != self._written[1]:
                    self._write(data)
                    self._written = (taken, decisions)
        except _Refused as exc:
            self._warn(
                f"VERL_NPU_AUTOPATCH_REPORT_DIR={self._directory!r} is not used: {exc}; "
                "no process report is written (patching is not affected)"
            )
        except Exception as exc:  # unwritable, full or removed directory: patching goes on
            self._warn(
                f"cannot write the process report into VERL_NPU_AUTOPATCH_REPORT_DIR={self._directory!r} "
                f"({describe(exc)}); patching is not affected"
            )

    def _snapshot(self, wait: bool) -> tuple[int, object, dict[str, Any]] | None:
        """``(its number, the decisions, the file's content)`` read under the slots' lock (``None``
        without ``wait`` if it is held); every foreign text cut to ``REASON_CHARS``."""
        engine = self._engine
        lock = engine.slots.lock
        if not lock.acquire(wait):
            return None
        try:
            self._taken += 1
            records = list(engine.records.values())
            decisions = (engine.status, engine.reason, [(r.name, r.state, r.reason) for r in records])
            versions = {"verl-npu-autopatch": __version__, **{k: v for r in records for k, v in r.versions.items()}}
            argv = getattr(sys, "orig_argv", None) or [sys.executable, *getattr(sys, "argv", [])]
            data = {
                **self._identity,
                "argv": [arg[:_ARG_CHARS] for arg in argv[:_ARGS]],
                "title": title(),  # read at each write: it changes after start
                "python": "{}.{}.{}".format(*sys.version_info[:3]),
                "executable": sys.executable,
                "format": FORMAT,
                "written": time.time(),
                "status": engine.status,
                "reason": cut(engine.reason, REASON_CHARS),
                "trigger": engine.trigger,
                "device": engine.device,
                "warnings": [cut(warning, REASON_CHARS) for warning in engine.warnings],
                "versions": versions,
                "records": [{"name": r.name, "state": r.state, "reason": cut(r.reason, REASON_CHARS)} for r in records],
            }
            return self._taken, decisions, data
        finally:
            lock.release()

    def _write(self, data: dict[str, Any]) -> None:
        """``data`` into the file through a checked descriptor of the directory (made with its
        parents at the first write only); a failed rewrite renames the old report
        ``NAME.incomplete.json`` (a rename needs no space), or else removes it."""
        name = file_name(self._identity)
        incomplete = name.removesuffix(".json") + INCOMPLETE
        if self._may_create:
            read = self._mode & 0o044  # directories get search where others may read (640: 750)
            directory = _make(self._directory, 0o700 | read | read >> 2)
        else:  # removed while the job runs: never made again behind the user's back
            directory = os.open(self._directory, _DIRECTORY)
        try:
            _check(directory)
            try:
                self._replace(directory, name, json.dumps(data, separators=(",", ":")).encode())
            except BaseException:
                self._incomplete = True
                try:
                    os.replace(name, incomplete, src_dir_fd=directory, dst_dir_fd=directory)
                except OSError:  # none yet, or the directory refuses renames: no old report may stay
                    _unlink(name, directory)
                raise
            self._may_create = False
            if self._incomplete:
                self._incomplete = False
                _unlink(incomplete, directory)
        finally:
            os.close(directory)

    def _replace(self, directory: int, name: str, content: bytes) -> None:
        """``content`` into a new temporary file of an unpredictable name, created exclusively (never
        a planted one), then renamed to ``name`` (whatever entry is there)."""
        for _ in range(_TRIES):
            temporary = f".{name}.{os.urandom(8).hex()}.tmp"
            try:
                fd = os.open(temporary, _CREATE, self._mode, dir_fd=directory)
                break
            except FileExistsError:  # a name someone planted (or a 1 in 2**64 clash): draw another
                continue
        else:
            raise FileExistsError(f"{_TRIES} temporary names in a row were taken in the report directory")
        try:
            try:
                os.fchmod(fd, self._mode)  # the mode asked for, whatever the umask
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)  # may report a failed write itself (NFS)
            os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            _unlink(temporary, directory)
            raise

    def _warn(self, text: str) -> None:
        if not self._warned:
            self._warned = True
            self._engine.warnings.append(text)
            log.logger().warning("%s", text)


def _check(directory: int) -> None:
    """Refuse (:class:`_Refused`) a directory where another user could read and replace the
    reports: owned by someone else than this user or root, or writable by others without the
    sticky bit (which keeps them from renaming or removing our files)."""
    found = os.fstat(directory)
    if found.st_uid not in (os.geteuid(), 0):
        raise _Refused(f"it belongs to another user (uid {found.st_uid}), who could read and replace the reports")
    if found.st_mode & _OTHERS_WRITE and not found.st_mode & _STICKY:
        raise _Refused(
            f"other users may write it (mode {found.st_mode & 0o7777:04o}, no sticky bit) and replace the reports"
        )


def _make(path: str, mode: int) -> int:
    """A descriptor of directory ``path``, made with ``mode`` (its missing parents too) if missing."""
    try:
        return os.open(path, _DIRECTORY)
    except FileNotFoundError:
        parent_path, name = os.path.split(path.rstrip("/"))
        if not name or not parent_path:  # nothing above to make it in
            raise
    parent = _make(parent_path, mode)
    try:
        try:
            os.mkdir(name, mode, dir_fd=parent)
            made = True
        except FileExistsError:  # made meanwhile by another process of the job: checked as any
            made = False
        fd = os.open(name, _DIRECTORY | (getattr(os, "O_NOFOLLOW", 0) if made else 0), dir_fd=parent)
        if made:
            os.fchmod(fd, mode)  # the mode asked for, whatever the umask
        return fd
    finally:
        os.close(parent)


def _unlink(name: str, directory: int) -> None:
    try:
        os.unlink(name, dir_fd=directory)
    except OSError:  # never made, or gone already: nothing to remove
        pass
