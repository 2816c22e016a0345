"""``verl-npu-autopatch doctor --ray [ADDRESS]``: the ``status`` probe on every alive node of a
Ray cluster, compared node by node.

One probe task is pinned to each alive node (``NodeAffinitySchedulingStrategy``, ``num_cpus=0``,
a fresh worker per probe), optionally inside a given ``runtime_env``. The probe is pickled by
value and imports only the standard library until it has checked that ``verl_npu_autopatch`` can
be found, so a node without the package is reported rather than failing to unpickle the task;
then it runs the status function its caller named (``module:function``, the command line's
``status``). Ray is imported lazily here and is never a dependency of the package.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.cli import ray_session
from verl_npu_autopatch.cli.doctor import TIMED_OUT
from verl_npu_autopatch.cli.summary import show, table
from verl_npu_autopatch.engine.text import describe

#: How long to wait for all probes (a pip ``runtime_env`` is built on each node first).
TIMEOUT_S = 900.0

#: The longest error text kept from a probe that could not run (a runtime_env failure: pip's
#: output, its cause at the end, which ``_short`` shows).
RUNTIME_ENV_CHARS = 20_000

#: Per-node facts compared across nodes; any difference is a disagreement.
COMPARED = ("installed", "version", "hook", "device", "configuration", "distributions")

#: Exit codes: every node has the package and all agree / a problem was found / Ray unusable /
#: a node's probe did not answer within the timeout (``TIMED_OUT``, the same code as ``doctor``'s).
OK, PROBLEMS, UNUSABLE = 0, 1, 2


def _make_probe(status: str) -> Callable[[], dict[str, Any]]:
    """The function each probe task runs; it reports what ``status`` (``"module:function"``, a
    function of no arguments returning ``status --json``'s data) returns on the node. It is a
    nested function so that cloudpickle ships it by value: unpickling it on a node must not import
    ``verl_npu_autopatch``."""

    def probe() -> dict[str, Any]:
        import importlib
        import importlib.util
        import os
        import socket
        import sys

        found: dict[str, Any] = {
            "python": sys.executable,
            "prefix": sys.prefix,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "installed": False,
            "error": None,
            "status": None,
        }
        try:
            spec = importlib.util.find_spec("verl_npu_autopatch")
        except Exception as exc:  # the package's own text helpers cannot be relied on here: the type only
            spec, found["error"] = None, f"looking for verl_npu_autopatch raised {type(exc).__name__}"
        if spec is None:
            found["error"] = found["error"] or "verl_npu_autopatch cannot be imported by this interpreter"
            return found
        found["installed"] = True
        found["package"] = spec.origin
        try:
            module, _, function = status.partition(":")
            found["status"] = getattr(importlib.import_module(module), function)()
        except Exception as exc:
            try:
                from verl_npu_autopatch.engine.text import describe

                found["error"] = f"the status probe raised {describe(exc)}"
            except Exception:  # the package itself cannot be imported: the type names the failure
                found["error"] = f"the status probe raised {type(exc).__name__}"
        return found

    return probe


# --------------------------------------------------------------------------- summarising
def _hook(status: dict[str, Any]) -> str:
    """Did the start-up hook run in the probe's (fresh) worker process?"""
    if not status["configuration"]["enabled"]:
        return "switched off"  # the placeholder may still wait: it reads the switch at the first watched import
    if status["observer_installed"]:
        return "observer"
    return "NOT RUN"


def summarize(node: dict[str, Any], found: dict[str, Any] | None, error: str | None = None) -> dict[str, Any]:
    """One node's row: what the probe found there (or why it could not run)."""
    entry: dict[str, Any] = {
        "node_id": node["NodeID"],
        "address": node.get("NodeManagerAddress", ""),
        "hostname": node.get("NodeManagerHostname", ""),
        "head": "node:__internal_head__" in node.get("Resources", {}),
        "python": (found or {}).get("python"),
        "installed": None if found is None else bool(found["installed"]),
        "error": error or (found or {}).get("error"),
        "version": None,
        "hook": None,
        "device": None,
        "configuration": None,
        "distributions": None,
        "would_apply": [],
        "patches": {},
        "verify": None,
        "status": None,
    }
    status = (found or {}).get("status")
    if status:
        entry.update(
            version=status["version"],
            hook=_hook(status),
            device=status["device"],
            configuration={k: v for k, v in status["configuration"].items() if k != "warnings"},
            distributions=status["distributions"],
            would_apply=[p["name"] for p in status["patches"] if p["state"] == "would apply"],
            patches={p["name"]: p["state"] for p in status["patches"]},
            verify=status.get("verify"),  # doctor --ray --verify only
            status=status,
        )
    return entry


def _label(entry: dict[str, Any]) -> str:
    return entry["node_id"][:8] + (" (head)" if entry["head"] else "")


def _majority(values: list[str]) -> str:
    """The most common value; on a tie, the one seen first (the head node comes first)."""
    counts = Counter(values)
    best = max(counts.values())
    return next(v for v in values if counts[v] == best)


def _compared(entries: list[dict[str, Any]], field: str) -> dict[str, str]:
    """``{node label: JSON of field}`` over the nodes where ``field`` is known: ``installed``
    wherever the probe ran, the rest wherever the package answered."""
    known = "installed" if field == "installed" else "status"
    return {_label(e): json.dumps(e[field], sort_keys=True) for e in entries if e[known] is not None}


def disagreements(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Facts that differ between nodes: ``{"field", "majority", "values": {node label: value}}``."""
    found = []
    compared = {field: _compared(entries, field) for field in COMPARED}
    probed = [e for e in entries if e["status"] is not None]
    for name in dict.fromkeys(name for e in probed for name in e["patches"]):
        compared[f"patch {name}"] = {_label(e): json.dumps(e["patches"].get(name, "absent")) for e in probed}
    for field, values in compared.items():
        if len(set(values.values())) > 1:
            found.append(
                {
                    "field": field,
                    "majority": json.loads(_majority(list(values.values()))),
                    "values": {label: json.loads(value) for label, value in values.items()},
                }
            )
    return found


def _short(error: str) -> str:
    """First and last line of an error (a runtime_env failure's cause is at the end)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"


def problems(entries: list[dict[str, Any]], disagreeing: list[dict[str, Any]]) -> list[str]:
    """Why the exit status is non-zero, one line each (empty when all is well)."""
    found = []
    for entry in entries:
        where = f"node {_label(entry)} ({entry['address']}, python {entry['python'] or '?'})"
        if entry["installed"] is None:
            found.append(f"{where}: the probe did not run: {_short(entry['error'])}")
        elif not entry["installed"]:
            found.append(f"{where}: verl-npu-autopatch is not installed ({entry['error']})")
        elif entry["error"]:
            found.append(f"{where}: {_short(entry['error'])}")
        elif entry["hook"] == "NOT RUN":
            found.append(
                f"{where}: the package imports but its start-up hook did not run in a fresh worker "
                "(.pth not processed: package shipped on PYTHONPATH via py_modules/working_dir, or python -S?)"
            )
        if entry["verify"] is not None and not entry["verify"]["ok"]:
            found.append(f"{where}: doctor --verify: {verify_summary(entry['verify'])}")
    found += [f"nodes disagree on {d['field']}" for d in disagreeing]
    return found


def verify_summary(report: dict[str, Any]) -> str:
    """One line for a node's ``doctor --verify`` report: how many checks passed, which failed."""
    if report["error"]:
        return f"could not run: {_short(report['error'])}"
    results = report["results"]
    where = f" on {report['device']}" if report["device"] else ""
    if not results:  # a node without the NPU stack: nothing to check there
        return f"no checks ran{where}"
    failed = sorted({r["name"] for r in results if not r["passed"]})
    text = f"{len(results) - sum(not r['passed'] for r in results)}/{len(results)} checks passed{where}"
    return text + (f"; MISMATCH: {', '.join(failed)}" if failed else "")


# --------------------------------------------------------------------------- running
def probe_nodes(
    ray: Any,
    runtime_env: dict[str, Any] | None,
    timeout: float,
    progress: Callable[[int, int], None],
    status: str,
) -> list[dict[str, Any]]:
    """One probe pinned to each alive node (head first), each task in ``runtime_env`` (None: the
    driver's); a summary per node. ``progress(done, total)`` after each answer; a node that has not
    answered within ``timeout`` seconds is cancelled and named."""
    entries = []
    for node, found, error in ray_session.on_every_node(ray, _make_probe(status), runtime_env, timeout, progress):
        if isinstance(error, ray_session.NoAnswer):
            entries.append({**summarize(node, None, str(error)), "timed_out": True})
        elif error is not None:
            entries.append(summarize(node, None, describe(error, RUNTIME_ENV_CHARS).strip()))
        else:
            entries.append(summarize(node, found))
    return entries


def probe_cluster(
    address: str,
    runtime_env: dict[str, Any] | None,
    status: str,
    timeout: float = TIMEOUT_S,
    connect_timeout: float = ray_session.CONNECT_TIMEOUT_S,
    progress: ray_session.Progress | None = None,
) -> dict[str, Any]:
    """Connect to the cluster at ``address`` (within ``connect_timeout`` seconds) as a job with
    ``runtime_env`` (so local ``py_modules``/``working_dir`` are uploaded as for any job), run
    ``status`` (see :func:`_make_probe`) on every alive node (each within ``timeout``), compare.
    The Ray side runs in a child process (:mod:`._ray_session`) unless this process is a
    connected driver already."""
    data: dict[str, Any] = {"address": address, "runtime_env": runtime_env}
    job = {"address": address, "timeout": timeout, "work": f"{__name__}:probe_nodes", "arguments": {"status": status}}
    found = ray_session.run(job, runtime_env, connect_timeout, progress or ray_session.Progress("doctor --ray"))
    if found.get("cluster"):
        data["cluster"] = found["cluster"]
    if found.get("error"):
        return {**data, "error": found["error"]}
    entries = found["result"]
    disagreeing = disagreements(entries)
    return {**data, "nodes": entries, "disagreements": disagreeing, "problems": problems(entries, disagreeing)}


def exit_code(data: dict[str, Any]) -> int:
    if data.get("error") or not data.get("nodes"):
        return UNUSABLE
    if any(e.get("timed_out") for e in data["nodes"]):
        return TIMED_OUT
    return PROBLEMS if data["problems"] else OK


# --------------------------------------------------------------------------- printing
COLUMNS = (
    ("address", "address"),
    ("installed", "installed"),
    ("version", "version"),
    ("start-up hook", "hook"),
    ("device", "device"),
    ("would apply", "would_apply"),
)


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, list):
        return ", ".join(value) or "-"
    return str(value)


def _odd_ones(entries: list[dict[str, Any]], field: str) -> set[str]:
    """Labels of the nodes whose ``field`` differs from the majority."""
    values = _compared(entries, field)
    if len(set(values.values())) < 2:
        return set()
    majority = _majority(list(values.values()))
    return {label for label, value in values.items() if value != majority}


def render(data: dict[str, Any]) -> str:
    """The node-by-node table (cells that differ from the majority marked ``*``), then the
    disagreements and problems."""
    if data.get("error"):
        return f"doctor --ray: {data['error']}"
    where, notes = ray_session.cluster_lines(data["address"], data.get("cluster"))
    if not data["nodes"]:
        return "\n".join([f"doctor --ray: no alive node in {where}", *notes])
    entries = data["nodes"]
    odd = {field: _odd_ones(entries, field) for _, field in COLUMNS}
    rows = [
        [_label(e)] + [_text(e[field]) + (" *" if _label(e) in odd[field] else "") for _, field in COLUMNS]
        for e in entries
    ]
    env = f", runtime_env {json.dumps(data['runtime_env'])}" if data["runtime_env"] else ""
    lines = [f"verl-npu-autopatch doctor --ray: {len(entries)} alive node(s) in {where}{env}", *notes, ""]
    lines += [table(rows, ["node"] + [name for name, _ in COLUMNS]), "", "python per node:"]
    lines += [f"  {_label(e)}: {e['python'] or '?'}" for e in entries]
    if any(e["verify"] is not None for e in entries):
        lines += ["", "doctor --verify per node (each check: --json):"]
        lines += [f"  {_label(e)}: {verify_summary(e['verify'])}" for e in entries if e["verify"] is not None]
    if data["disagreements"]:
        lines += ["", "DISAGREEMENTS (cells marked * differ from the majority):"]
        for item in data["disagreements"]:
            values = "; ".join(f"{node}: {json.dumps(v)}" for node, v in item["values"].items())
            lines.append(f"  {item['field']}: {values}")
    if data["problems"]:
        lines += ["", "PROBLEMS:"] + [f"  {text}" for text in data["problems"]]
        lines += ship_hint([_label(e) for e in entries if e["installed"] is False], data["runtime_env"])
    else:
        lines += ["", "all nodes have verl-npu-autopatch and agree"]
    return "\n".join(lines)


def main(args: Any, status: str) -> int:
    """The ``doctor --ray`` branch of the command line: ``args`` as parsed by it, ``status`` the
    ``"module:function"`` each node runs (its ``status``)."""
    if args.ray is None:
        print("doctor: --runtime-env needs --ray", file=sys.stderr)
        return UNUSABLE
    runtime_env: dict[str, Any] | None = args.runtime_env  # a JSON object (``help_text.json_object``)
    if args.device:
        runtime_env = dict(runtime_env or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), "VERL_NPU_AUTOPATCH_DEVICE": args.device}
    timeout = getattr(args, "timeout", None)
    progress = ray_session.Progress("doctor --ray")
    connect_timeout = timeout or ray_session.CONNECT_TIMEOUT_S
    data = probe_cluster(args.ray, runtime_env, status, timeout or TIMEOUT_S, connect_timeout, progress)
    if args.json:  # where doctor --ray ran, as every --json says (each node's own is in its status)
        from verl_npu_autopatch.cli.bug_report import environment

        data["environment"] = environment()
    print(json.dumps(data, indent=2)) if args.json else show(render(data))
    return exit_code(data)


def ship_hint(missing: list[str], runtime_env: dict[str, Any] | None, who: str = "the probes") -> list[str]:
    """How to give ``who`` on the nodes in ``missing`` (their labels) the package: a pip
    ``runtime_env`` (an empty line first)."""
    if not missing:
        return []
    from verl_npu_autopatch._version import __version__

    wheel = f"/path/to/verl_npu_autopatch-{__version__}-py3-none-any.whl"
    shipped = " (the runtime_env given does not install it there)" if runtime_env else ""
    return [
        "",
        f"verl-npu-autopatch is missing on {len(missing):,} node(s): {', '.join(missing)}{shipped}.",
        f"Run {who} with it: its wheel in a pip runtime_env, at a path every node can read (docs/installing.md):",
        f"  --runtime-env '{json.dumps({'pip': [wheel]})}'",
    ]
