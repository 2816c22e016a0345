"""``verl-npu-autopatch fleet DIR...``: what every process of a job decided, from the report files
its processes wrote into ``VERL_NPU_AUTOPATCH_REPORT_DIR`` (see ``report_file``).

This module reads the files, tells live processes from stale ones, names each process's role
and compares the patches across processes; ``fleet_view`` prints the result and ``fleet_ray``
gathers the files from every node of a Ray cluster.

Every file is untrusted (``fleet_file``: regular files only, bounded, checked against the schema;
the others are listed unreadable). Stale: a file whose process is gone. On the host that wrote it
(same host name, boot and pid namespace) that is exact: the pid is not running, runs a later
process (another start time, read back through the time namespace's offset when the writer runs in
another one) or another program (an exec changed its image). Where /proc hides the process
(``hidepid``) or another time namespace's offset cannot be read, it is counted live and says it
could not be checked. Elsewhere a file counts as stale only when both its ``written`` time (that
host's clock) and its modification time (the filesystem's) are older than ``stale_after`` seconds
(``fleet --ray`` checks every file on its own node instead).
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from typing import Any

from verl_npu_autopatch.cli import fleet_file
from verl_npu_autopatch.engine import report_file
from verl_npu_autopatch.engine.report_file import identity, proc_stat, proc_text, title
from verl_npu_autopatch.engine.text import cut, describe

__all__ = [
    "ROLES",
    "STALE_AFTER_S",
    "compare",
    "exit_code",
    "judge",
    "judged",
    "read_directories",
    "role",
]

#: The roles a process is grouped by, in the order they are shown.
ROLES = ("driver", "Ray worker", "vLLM EngineCore", "vLLM worker", "other")
#: A file from another host not rewritten for this long is stale (``--stale-after``, in hours).
STALE_AFTER_S = 24 * 3600.0
#: States that make ``fleet`` exit non-zero when any live process has one.
PROBLEM_STATES = ("failed", "unsupported")
#: How a live process whose writer renamed its file after a failed rewrite is shown (a problem).
INCOMPLETE, INCOMPLETE_REASON = "report incomplete", "a later write failed; this is the last complete state"
#: Exit codes: all well / a patch failed or is unsupported somewhere (or an activation failed) /
#: no live process file found (nothing to judge).
OK, PROBLEMS, NOTHING = 0, 1, 2


# --------------------------------------------------------------------------- reading
def read_directories(directories: list[str], stale_after: float = STALE_AFTER_S) -> dict[str, Any]:
    """Every report file in ``directories`` judged live or stale, here: ``{"processes",
    "stale", "unreadable"}`` (a process seen in several directories counts once, its newest file).
    Never raises for any file: a file that cannot be used is listed unreadable with the reason."""
    here, now = {**identity(), "timens": _readlink("self", "ns/time")}, time.time()
    found: dict[tuple[Any, ...], dict[str, Any]] = {}
    unreadable = []
    for directory in directories:
        try:
            owners = frozenset((os.geteuid(), 0, os.stat(directory).st_uid))
            names = sorted(entry.name for entry in os.scandir(directory) if entry.name.endswith(".json"))
        except OSError as exc:
            unreadable.append({"file": directory, "error": describe(exc)})
            continue
        for name in names:
            if name.startswith("."):
                continue  # a temporary file being written
            path = os.path.join(directory, name)
            try:
                data, modified = fleet_file.read(path, owners)
            except fleet_file.Unreadable as exc:
                unreadable.append({"file": path, "error": str(exc)})
                continue
            except Exception as exc:  # a bug must not hide the other files: this one is named
                unreadable.append({"file": path, "error": f"cannot be read: {describe(exc)}"})
                continue
            data.update(file=path, modified=modified, incomplete=name.endswith(fleet_file.INCOMPLETE))
            key = (data["host"], data["boot_id"], data["pidns"], data["pid"], data["start"])
            if key not in found or found[key]["written"] < data["written"]:
                found[key] = data
    processes: list[dict[str, Any]] = []
    stale: list[dict[str, Any]] = []
    for data in found.values():
        data.update(judge(data, here, now, stale_after))
        (processes if data["live"] else stale).append(data)
    return {"processes": processes, "stale": stale, "unreadable": unreadable}


def judged(item: object) -> dict[str, Any] | None:
    """A process another node's reader judged (``fleet --ray``), checked as a file is plus the
    judgement's fields, or ``None``."""
    try:
        data = fleet_file.checked(item)
    except fleet_file.Unreadable:  # the caller counts it as not valid
        return None
    assert isinstance(item, dict)  # checked() accepts nothing else
    judgement = {key: item.get(key) for key in ("file", "liveness", "title", "role", "live", "incomplete")}
    if not all(type(judgement[key]) is str for key in ("file", "liveness", "title")) or judgement["role"] not in ROLES:
        return None
    if type(judgement["live"]) is not bool or type(judgement["incomplete"]) not in (bool, type(None)):
        return None
    return data | {key: cut(value) if type(value) is str else value for key, value in judgement.items()}


def judge(data: dict[str, Any], here: dict[str, Any], now: float, stale_after: float) -> dict[str, Any]:
    """``{"live", "liveness", "role", "title"}`` of the process that wrote ``data`` (a checked
    file), judged on the host ``here`` (``report_file.identity()`` and its ``timens``) at ``now``.
    A live local process's title is read afresh: Ray and vLLM retitle their processes after start."""
    shown = data["title"]
    local = (data["host"], data["boot_id"], data["pidns"]) == (here["host"], here["boot_id"], here["pidns"])
    if local:
        live, liveness = _local(data, here.get("timens", ""))
        shown = (title(data["pid"]) if live else "") or shown
    else:
        live, liveness = _elsewhere(data, now, stale_after)
    if data.get("incomplete"):
        liveness += f"; {INCOMPLETE} ({INCOMPLETE_REASON})"
    return {"live": live, "liveness": liveness, "title": shown, "role": role(data["argv"], shown)}


def _elsewhere(data: dict[str, Any], now: float, stale_after: float) -> tuple[bool, str]:
    """Another host's file: stale when neither its ``written`` time (that host's clock) nor its
    modification time (the clock of the filesystem holding it) is within ``stale_after``."""
    age, quiet = now - data["written"], now - data.get("modified", data["written"])
    live = not stale_after or min(age, quiet) <= stale_after
    if age < 0:
        liveness = f"written on another host (clock ahead by {_age(-age)})"
    else:
        liveness = f"written {_age(age)} ago on another host"
    if live and stale_after and age > stale_after:
        liveness += f" (its file changed {_age(max(quiet, 0))} ago: the clocks differ)"
    return live, liveness + ("" if live else " (stale)")


def _local(data: dict[str, Any], timens: str) -> tuple[bool, str]:
    """Whether the process that wrote ``data`` on this host still runs, and how it was told: its
    pid, start time (shifted back when it runs in another time namespace than ``timens``, fleet's
    own) and program image (which an exec changes)."""
    pid, start, image = data["pid"], data["start"], data["image"]
    fields = proc_stat(pid, 22, 28)
    if fields is None:  # gone, hidden by /proc's hidepid, or no /proc: ask the kernel
        if not _running(pid):
            return False, "process gone"
        return True, "running" if start is None else "running (cannot check its start time: /proc hides it)"
    started, now_image = fields
    liveness = "running"
    if start is not None and started is not None:
        theirs = data["timens"] or _readlink(pid, "ns/time") or timens
        shift = 0 if theirs == timens or not timens else _boottime_shift(pid)
        if shift is None:
            liveness = "running (start time not checked: another time namespace)"
        elif abs(started - (start - shift)) > (1 if shift else 0):  # offsets in ns: one tick of rounding
            return False, "process gone (its pid was reused)"
    if image and now_image and image != now_image:
        return False, "process gone (the pid now runs another program: exec)"
    return True, liveness


def _readlink(pid: int | str, name: str) -> str:
    try:
        return os.readlink(f"{report_file.PROC}/{pid}/{name}")
    except OSError:  # no time namespaces, no access, or gone: unknown
        return ""


def _boottime_shift(pid: int) -> int | None:
    """In clock ticks: how far ``pid``'s time namespace shifts its boot-time clock beyond fleet's
    own (``/proc/PID/timens_offsets``), or ``None`` if either cannot be read."""
    theirs, ours = _boottime_offset(pid), _boottime_offset("self")
    if theirs is None or ours is None:
        return None
    return (theirs - ours) * _ticks_per_second() // 1_000_000_000


def _boottime_offset(pid: int | str) -> int | None:
    """The boot-time clock offset of ``pid``'s time namespace in ns, or ``None``."""
    for line in (proc_text(pid, "timens_offsets") or "").splitlines():
        name, _, rest = line.partition(" ")
        seconds, _, nanoseconds = rest.strip().partition(" ")
        if name in ("boottime", "7"):  # by name, or CLOCK_BOOTTIME's number on older kernels
            try:
                return int(seconds) * 1_000_000_000 + int(nanoseconds.strip())
            except ValueError:  # not the layout proc(5) describes: unknown
                return None
    return None


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):  # not POSIX: Linux's usual value
        return 100


def _running(pid: int) -> bool:
    """Whether ``pid`` exists (without /proc, or where /proc hides it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:  # no such process: gone
        return False
    except OSError:  # e.g. EPERM: it exists, owned by someone else
        return True
    return True


def _age(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:.0f} s"


def role(argv: list[str], shown_title: str) -> str:
    """The role of a process, from its command line and title (one of :data:`ROLES`)."""
    head = shown_title.split(" ", 1)[0]
    if head.startswith("ray::") or any(arg.endswith("default_worker.py") for arg in argv):
        return "Ray worker"
    if "::EngineCore" in head or head.startswith("EngineCore"):
        return "vLLM EngineCore"
    if "::Worker" in head or "VllmWorker" in head:
        return "vLLM worker"
    if "--multiprocessing-fork" in argv or any("spawn_main" in arg or "forkserver" in arg for arg in argv):
        return "other"  # a multiprocessing child nobody named
    return "driver"


# --------------------------------------------------------------------------- comparing
def compare(processes: list[dict[str, Any]]) -> dict[str, Any]:
    """The live processes compared patch by patch: ``{"roles", "patches", "differing",
    "uniform", "problems"}``. A patch differs when the processes that decided it (not
    ``pending``) did not all reach the same state; each state's processes are split by reason."""
    groups: dict[str, dict[tuple[str, str], list[int]]] = defaultdict(lambda: defaultdict(list))
    for index, process in enumerate(processes):
        for record in process["records"]:
            groups[record["name"]][(record["state"], record["reason"])].append(index)
    differing, uniform = [], {}
    for name, by_reason in groups.items():
        states: Counter[str] = Counter()
        for (state, _), members in by_reason.items():
            states[state] += len(members)
        decided = [state for state in states if state != "pending"]
        if len(decided) < 2:
            uniform[name] = decided[0] if decided else "pending"
            continue
        ranked = sorted(by_reason.items(), key=lambda item: (-states[item[0][0]], item[0][0], -len(item[1])))
        differing.append(
            {
                "patch": name,
                "states": dict(states.most_common()),
                "groups": [_group(state, reason, members, processes) for (state, reason), members in ranked],
            }
        )
    problems = [
        _group(state, reason, members, processes) | {"patch": name}
        for name, by_reason in groups.items()
        for (state, reason), members in by_reason.items()
        if state in PROBLEM_STATES
    ]
    problems += [
        _group("activation failed", reason, members, processes) | {"patch": None}
        for reason, members in _failed_engines(processes).items()
    ]
    incomplete = [index for index, process in enumerate(processes) if process.get("incomplete")]
    if incomplete:
        problems.append(_group(INCOMPLETE, INCOMPLETE_REASON, incomplete, processes) | {"patch": None})
    return {
        "roles": {r: n for r in ROLES if (n := sum(p["role"] == r for p in processes))},
        "patches": list(groups),
        "differing": differing,
        "uniform": uniform,
        "problems": problems,
    }


def _failed_engines(processes: list[dict[str, Any]]) -> dict[str, list[int]]:
    failed: dict[str, list[int]] = defaultdict(list)
    for index, process in enumerate(processes):
        if process["status"] == "failed":
            failed[process["reason"]].append(index)
    return failed


#: How many processes a group names as examples.
EXAMPLES = 3


def _group(state: str, reason: str, members: list[int], processes: list[dict[str, Any]]) -> dict[str, Any]:
    """The processes with one state and reason: how many, by role, on how many hosts, a few by name."""
    roles = Counter(processes[i]["role"] for i in members)
    return {
        "state": state,
        "reason": reason,
        "count": len(members),
        "roles": {r: roles[r] for r in ROLES if roles[r]},
        "hosts": len({processes[i]["host"] for i in members}),
        "examples": [f"{processes[i]['host']}:{processes[i]['pid']}" for i in members[:EXAMPLES]],
    }


def matrix(processes: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, int]]]:
    """``{patch: {role: {state: count}}}`` over the live processes (``fleet --all``)."""
    found: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    for process in processes:
        for record in process["records"]:
            found[record["name"]][process["role"]][record["state"]] += 1
    return {name: {r: dict(by_role[r].most_common()) for r in ROLES if r in by_role} for name, by_role in found.items()}


# --------------------------------------------------------------------------- the whole view
def view(read: dict[str, Any], sources: list[str], entries: bool = True, with_matrix: bool = True) -> dict[str, Any]:
    """``fleet --json``: the processes, the comparison and where they came from. Without
    ``entries`` the processes stay as read (what the text needs, and much faster over thousands);
    without ``with_matrix`` there is no ``matrix``."""
    processes = read["processes"]
    data = {
        "sources": sources,
        "processes": [_entry(p) for p in processes] if entries else processes,
        **compare(processes),
        "stale": [_entry(p) for p in read["stale"]] if entries else read["stale"],
        "unreadable": read["unreadable"],
    }
    if with_matrix:
        data["matrix"] = matrix(processes)
    return data


def _entry(process: dict[str, Any]) -> dict[str, Any]:
    """One process as ``--json`` lists it: every field of its file plus the judgement, records
    as ``{patch: {"state", "reason"}}``."""
    entry = {k: v for k, v in process.items() if k != "records"}
    entry["records"] = {r["name"]: {"state": r["state"], "reason": r["reason"]} for r in process["records"]}
    return entry


def exit_code(data: dict[str, Any]) -> int:
    """:data:`PROBLEMS` when a live process has a failed or unsupported patch or a failed
    activation, :data:`NOTHING` when no live process was found, else :data:`OK`."""
    if data.get("error") or not data["processes"]:
        return NOTHING
    return PROBLEMS if data["problems"] else OK
