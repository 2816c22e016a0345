"""The process's report file in ``VERL_NPU_AUTOPATCH_REPORT_DIR`` (read by ``verl-npu-autopatch
fleet``): who this process is (pid, host, Python, command line, process title) and each record's
state and reason, rewritten whenever a decision changes.

Imported only by an engine that activated with the variable set; never at start-up, never on an
inactive host. Writing never breaks the process: the file is written to a temporary name and moved
into place (``os.replace``), so a reader sees the old report or the new one, and any failure
(directory unwritable, full or removed) is logged as one warning and patching goes on.
"""

from __future__ import annotations

import _thread
import json
import os
import sys
import time

from verl_npu_autopatch import _logging
from verl_npu_autopatch._version import __version__

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol

    from verl_npu_autopatch._slots import Slots
    from verl_npu_autopatch.records import Record

    class Engine(Protocol):
        """What the report file reads of the engine (and the refresh it installs there)."""

        @property
        def slots(self) -> Slots: ...  # their lock, and the refresh (``on_change``) the file installs there
        @property
        def status(self) -> str: ...
        @property
        def reason(self) -> str: ...
        @property
        def trigger(self) -> str: ...
        @property
        def device(self) -> str: ...
        @property
        def warnings(self) -> list[str]: ...
        @property
        def records(self) -> dict[str, Record]: ...


__all__ = ["FORMAT", "ReportFile", "attach", "file_name", "identity", "start_time"]

#: The version of the file's layout (``fleet`` skips files of a layout it does not know).
FORMAT = 1
#: Longest argument (and process title) kept, and how many arguments: a ``-c`` program can be long.
_ARG_CHARS, _ARGS = 300, 40


def attach(engine: Engine, directory: str) -> None:
    """Give ``engine`` a report file in ``directory``, refreshed at every decision from now on, and
    write it once. Never raises."""
    try:
        engine.slots.on_change = refresh = ReportFile(engine, directory).changed
        refresh()
    except Exception as exc:  # a bug here must not break the user's import; the file is extra
        _logging.logger().warning("verl-npu-autopatch: cannot write the process report: %r", exc)


def _read(path: str) -> str:
    """A small /proc or /sys file's text, or ``""`` where there is none (not Linux, no access)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:  # not Linux, or the process is gone: the fact is unknown
        return ""


def start_time(pid: int | str = "self") -> int | None:
    """When process ``pid`` started, in clock ticks after boot (Linux ``/proc/PID/stat`` field
    22), or ``None``: with the boot id, it tells a live process from a later one reusing its pid."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rpartition(")")[2].split()  # the command name (field 2) may hold spaces
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def title(pid: int | str = "self") -> str:
    """Process ``pid``'s title as ``ps`` shows it (``/proc/PID/cmdline``, which ``setproctitle``,
    as used by Ray and vLLM, rewrites), or ``""`` where unknown."""
    return _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()[:_ARG_CHARS]


def identity() -> dict[str, Any]:
    """What tells this process apart from every other one: host, boot, pid namespace, pid and
    start time."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux: pids are compared without a namespace
        namespace = ""
    return {
        "host": os.uname().nodename,
        "boot_id": _read("/proc/sys/kernel/random/boot_id").strip(),
        "pidns": namespace,
        "pid": os.getpid(),
        "start": start_time(),
    }


def file_name(found: dict[str, Any]) -> str:
    """The report file's name for the process ``identity()`` returned."""
    host = "".join(c if c.isalnum() or c in "-._" else "_" for c in found["host"]) or "host"
    return f"{host}-{found['pid']}-{found['start'] or 0}.json"


class ReportFile:
    """One process's report file; :meth:`changed` rewrites it when a decision changed."""

    def __init__(self, engine: Engine, directory: str) -> None:
        self._engine = engine
        self._directory = os.path.abspath(directory)
        self._lock = _thread.allocate_lock()  # over the file; never held while waiting for the slots' lock
        self._pid = os.getpid()  # the process the identity below is of (a forked child writes its own file)
        self._identity = identity()
        self._taken = 0  # snapshots taken (under the slots' lock, so in the order of the decisions)
        self._written: tuple[int, object] = (0, None)  # the last snapshot written and its decisions
        self._warned = False

    def changed(self) -> None:
        """Write the report if a decision changed since the last write. Never raises.

        The snapshot is taken under the slots' lock, the file written under this object's own,
        never the other way round (a decision is recorded with the slots' lock held); a
        snapshot older than the one last written is dropped, so the file never goes back."""
        if self._pid != os.getpid():  # a forked child: its own file, a lock of its own
            self._lock, self._pid, self._identity = _thread.allocate_lock(), os.getpid(), identity()
            self._written = (0, None)
        try:
            taken, decisions, data = self._snapshot()
            with self._lock:
                if taken > self._written[0] and decisions != self._written[1]:
                    self._write(data)
                    self._written = (taken, decisions)
        except Exception as exc:  # unwritable, full or removed directory: patching goes on
            self._warn(exc)

    def _snapshot(self) -> tuple[int, object, dict[str, Any]]:
        """``(its number, the decisions, the file's content)``, read under the slots' lock."""
        engine = self._engine
        with engine.slots.lock:
            self._taken += 1
            records = list(engine.records.values())
            decisions = (engine.status, engine.reason, [(r.name, r.state, r.reason) for r in records])
            versions = {"verl-npu-autopatch": __version__, **{k: v for r in records for k, v in r.versions.items()}}
            data = {
                **self._identity,
                **self._process(),
                "format": FORMAT,
                "written": time.time(),
                "status": engine.status,
                "reason": engine.reason,
                "trigger": engine.trigger,
                "device": engine.device,
                "warnings": list(engine.warnings),
                "versions": versions,
                "records": [{"name": r.name, "state": r.state, "reason": r.reason} for r in records],
            }
            return self._taken, decisions, data

    def _write(self, data: dict[str, Any]) -> None:
        """``data`` into the file, atomically: a temporary file in the directory, then moved."""
        name = file_name(self._identity)
        if self._written[1] is None and not os.path.isdir(self._directory):
            os.makedirs(self._directory, exist_ok=True)  # the first write creates it; a later one never does
        temporary = os.path.join(self._directory, f".{name}.{_thread.get_ident()}.tmp")
        try:
            with open(temporary, "w", encoding="utf-8") as f:
                f.write(json.dumps(data, separators=(",", ":")))
            os.replace(temporary, os.path.join(self._directory, name))
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:  # never created, or the directory is gone: nothing to clean up
                pass
            raise

    @staticmethod
    def _process() -> dict[str, Any]:
        """The command line and interpreter, read at each write (the title changes after start)."""
        argv = getattr(sys, "orig_argv", None) or [sys.executable, *getattr(sys, "argv", [])]
        return {
            "argv": [arg[:_ARG_CHARS] for arg in argv[:_ARGS]],
            "title": title(),
            "python": "{}.{}.{}".format(*sys.version_info[:3]),
            "executable": sys.executable,
        }

    def _warn(self, exc: BaseException) -> None:
        if self._warned:
            return
        self._warned = True
        text = (
            f"cannot write the process report into VERL_NPU_AUTOPATCH_REPORT_DIR={self._directory!r} "
            f"({type(exc).__name__}: {exc}); patching is not affected"
        )
        self._engine.warnings.append(text)
        _logging.logger().warning("%s", text)
