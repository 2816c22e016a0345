"""``fleet --ray [ADDRESS] DIR...``: read DIR on every alive node of a Ray cluster, the way
``doctor --ray`` probes them (one task pinned to each node, ``num_cpus=0``).

Each node reads and judges its own files (``fleet.read_directories``), so whether a process is
still running is checked on the host that runs it. The task is a nested function, shipped by
value: it imports ``verl_npu_autopatch`` by name on the node, and a node without the package is
named rather than failing the whole gather.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.cli import fleet, ray_session
from verl_npu_autopatch.cli.ray_doctor import TIMEOUT_S
from verl_npu_autopatch.engine.text import cut, describe, safe_str

__all__ = ["gather", "read_nodes"]


def _make_reader(directories: list[str], stale_after: float) -> Callable[[], dict[str, Any]]:
    """The function each node's task runs."""

    def read() -> dict[str, Any]:
        import importlib

        try:
            fleet = importlib.import_module("verl_npu_autopatch.cli.fleet")
        except ImportError as exc:  # no helper here (shipped by value): the type and message name it
            return {"error": f"verl_npu_autopatch cannot be imported on this node ({exc})", "missing": True}
        return fleet.read_directories(directories, stale_after)

    return read


def gather(
    address: str,
    directories: list[str],
    stale_after: float,
    timeout: float | None = None,
    runtime_env: dict[str, Any] | None = None,
    connect_timeout: float | None = None,
    progress: ray_session.Progress | None = None,
) -> dict[str, Any]:
    """``fleet.read_directories``'s answer over every alive node of the cluster at ``address``
    (``{"error"}`` if Ray cannot be used), the readers in ``runtime_env`` (e.g. the package's wheel
    where a node's image lacks it); a node that cannot answer is listed as unreadable, and one
    without the package also under ``without_package``. ``cluster``: what was reached. The
    connection is bounded by ``connect_timeout`` (``timeout`` when given, else
    ``ray_session.CONNECT_TIMEOUT_S``), the nodes' answers by ``timeout`` (else ``TIMEOUT_S``)."""
    job = {
        "address": address,
        "timeout": timeout or TIMEOUT_S,
        "work": f"{__name__}:read_nodes",
        "arguments": {"directories": directories, "stale_after": stale_after},
    }
    connect_timeout = connect_timeout or timeout or ray_session.CONNECT_TIMEOUT_S
    found = ray_session.run(job, runtime_env, connect_timeout, progress or ray_session.Progress("fleet --ray"))
    if found.get("error"):
        return {"error": found["error"], "cluster": found.get("cluster")}
    return {**found["result"], "cluster": found["cluster"]}


def read_nodes(
    ray: Any,
    runtime_env: dict[str, Any] | None,
    timeout: float,
    progress: Callable[[int, int], None],
    directories: list[str],
    stale_after: float,
) -> dict[str, Any]:
    """One reader pinned to each alive node, in ``runtime_env`` (None: the driver's); their
    answers merged. ``progress(done, total)`` after each answer; a node that has not answered
    within ``timeout`` seconds is cancelled and listed as unreadable."""
    found: dict[str, list[Any]] = {"processes": [], "stale": [], "unreadable": [], "without_package": []}
    seen: set[tuple[Any, ...]] = set()
    reader = _make_reader(directories, stale_after)
    for node, answer, error in ray_session.on_every_node(ray, reader, runtime_env, timeout, progress):
        where = f"node {node['NodeID'][:8]} ({node.get('NodeManagerAddress', '?')})"
        if error is not None:  # a node that cannot answer is named, the others still count
            answer = {"error": describe(error)}
        if type(answer) is dict and answer.get("missing") is True:
            found["without_package"].append(where)
        for key, items in _checked(answer, where).items():
            found[key] += [item for item in items if _new(item, seen)]
    return found


def _new(item: dict[str, Any], seen: set[tuple[Any, ...]]) -> bool:
    """Whether ``item`` (a process, or an unreadable file) was not gathered yet: two nodes on one
    host (or sharing a filesystem) may read the same files."""
    key = tuple(item.get(k) for k in ("file", "host", "boot_id", "pidns", "pid", "start"))
    if key in seen:
        return False
    seen.add(key)
    return True


def _checked(answer: object, where: str) -> dict[str, list[dict[str, Any]]]:
    """A node's answer with each entry checked as ``fleet`` checks a file (the node may run another
    version of the package, or a broken one): what does not pass is one unreadable entry naming it."""
    if type(answer) is not dict or answer.get("error"):
        error = answer.get("error") if type(answer) is dict else f"an answer of type {type(answer).__name__}"
        return {"unreadable": [{"file": where, "error": cut(safe_str(error))}]}
    found: dict[str, list[dict[str, Any]]] = {"processes": [], "stale": [], "unreadable": []}
    rejected = 0
    for key in ("processes", "stale"):
        for item in _items(answer, key):
            judged = fleet.judged(item)
            found[key] += [judged] if judged else []
            rejected += not judged
    for item in _items(answer, "unreadable"):
        if type(item) is dict and type(item.get("file")) is str and type(item.get("error")) is str:
            found["unreadable"].append({"file": cut(item["file"]), "error": cut(item["error"])})
        else:
            rejected += 1
    if rejected:
        found["unreadable"].append({"file": where, "error": f"{rejected:,} entries of its answer are not valid"})
    return found


def _items(answer: dict[str, Any], key: str) -> list[Any]:
    items = answer.get(key)
    return items if type(items) is list else []
