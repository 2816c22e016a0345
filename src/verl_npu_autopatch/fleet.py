"""``verl-npu-autopatch fleet DIR...``: what every process of a job decided, from the report files
its processes wrote into ``VERL_NPU_AUTOPATCH_REPORT_DIR`` (see ``_report_file``).

This module reads the files, tells live processes from stale ones, names each process's role
and compares the patches across processes; ``_fleet_view`` prints the result and ``_fleet_ray``
gathers the files from every node of a Ray cluster.

Stale: a file whose process is gone. On the host that wrote it (same host name, boot and pid
namespace) that is exact: the pid is not running, or runs a later process (another start time).
Elsewhere it cannot be checked, so a file not rewritten for longer than ``stale_after`` seconds
counts as stale (``fleet --ray`` checks every file on its own node instead).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from typing import Any

from verl_npu_autopatch._report_file import FORMAT, identity, start_time, title

__all__ = ["ROLES", "STALE_AFTER_S", "compare", "exit_code", "judge", "read_directories", "role"]

#: The roles a process is grouped by, in the order they are shown.
ROLES = ("driver", "Ray worker", "vLLM EngineCore", "vLLM worker", "other")
#: A file from another host not rewritten for this long is stale (``--stale-after``, in hours).
STALE_AFTER_S = 24 * 3600.0
#: States that make ``fleet`` exit non-zero when any live process has one.
PROBLEM_STATES = ("failed", "unsupported")
#: Exit codes: all well / a patch failed or is unsupported somewhere (or an activation failed) /
#: no live process file found (nothing to judge).
OK, PROBLEMS, NOTHING = 0, 1, 2


# --------------------------------------------------------------------------- reading
def read_directories(directories: list[str], stale_after: float = STALE_AFTER_S) -> dict[str, Any]:
    """Every report file in ``directories`` judged live or stale, here: ``{"processes",
    "stale", "unreadable"}`` (a process seen in several directories counts once, its newest file)."""
    here, now = identity(), time.time()
    found: dict[tuple[Any, ...], dict[str, Any]] = {}
    unreadable = []
    for directory in directories:
        try:
            names = sorted(entry.name for entry in os.scandir(directory) if entry.name.endswith(".json"))
        except OSError as exc:
            unreadable.append({"file": directory, "error": f"{type(exc).__name__}: {exc}"})
            continue
        for name in names:
            if name.startswith("."):
                continue  # a temporary file being written
            path = os.path.join(directory, name)
            try:
                with open(path, "rb") as f:
                    data = json.loads(f.read())
                if not isinstance(data, dict) or data.get("format") != FORMAT:
                    raise ValueError(f"not a report file of format {FORMAT}")
                key = (data["host"], data["boot_id"], data["pidns"], data["pid"], data["start"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                unreadable.append({"file": path, "error": f"{type(exc).__name__}: {exc}"})
                continue
            data["file"] = path
            if key not in found or found[key]["written"] < data["written"]:
                found[key] = data
    processes: list[dict[str, Any]] = []
    stale: list[dict[str, Any]] = []
    for data in found.values():
        data.update(judge(data, here, now, stale_after))
        (processes if data["live"] else stale).append(data)
    return {"processes": processes, "stale": stale, "unreadable": unreadable}


def judge(data: dict[str, Any], here: dict[str, Any], now: float, stale_after: float) -> dict[str, Any]:
    """``{"live", "liveness", "role", "title"}`` of the process that wrote ``data``, judged on the
    host ``here`` (``_report_file.identity()``) at ``now``. A live local process's title is read
    afresh: Ray and vLLM retitle their processes after start-up."""
    shown = data.get("title") or ""
    local = (data["host"], data["boot_id"], data["pidns"]) == (here["host"], here["boot_id"], here["pidns"])
    if local:
        if data["start"] is None:  # written where /proc is not: only whether the pid exists
            live, reused = _running(data["pid"]), False
        else:
            started = start_time(data["pid"])
            live, reused = started == data["start"], started is not None and started != data["start"]
        liveness = "running" if live else "process gone" + (" (its pid was reused)" if reused else "")
        shown = (title(data["pid"]) if live else "") or shown
    else:
        age = now - data["written"]
        live = not stale_after or age <= stale_after
        liveness = f"written {_age(age)} ago on another host" + ("" if live else " (stale)")
    return {"live": live, "liveness": liveness, "title": shown, "role": role(data.get("argv") or [], shown)}


def _running(pid: int) -> bool:
    """Without /proc: whether ``pid`` exists."""
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
