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

from verl_npu_autopatch import fleet
from verl_npu_autopatch._text import cut, describe, safe_str
from verl_npu_autopatch.ray_doctor import TIMEOUT_S

__all__ = ["gather"]


def _make_reader(directories: list[str], stale_after: float) -> Callable[[], dict[str, Any]]:
    """The function each node's task runs."""

    def read() -> dict[str, Any]:
        import importlib

        try:
            fleet = importlib.import_module("verl_npu_autopatch.fleet")
        except ImportError as exc:
            return {
                "error": f"verl_npu_autopatch cannot be imported on this node ({exc})"
            }  # no helper here: shipped by value
        return fleet.read_directories(directories, stale_after)

    return read


def gather(
    address: str,
    directories: list[str],
    stale_after: float,
    timeout: float | None = None,
    runtime_env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``fleet.read_directories``'s answer over every alive node of the cluster at ``address``
    (``{"error"}`` if Ray cannot be used), the readers in ``runtime_env`` (e.g. the package's wheel
    where a node's image lacks it); a node that cannot answer is listed as unreadable."""
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError as exc:
        return {"error": f"ray is not installed in this environment ({describe(exc)})"}
    started = not ray.is_initialized()
    found: dict[str, list[dict[str, Any]]] = {"processes": [], "stale": [], "unreadable": []}
    seen: set[tuple[Any, ...]] = set()
    try:
        if started:
            import logging  # ray imported it already

            ray.init(address=address, runtime_env=runtime_env, log_to_driver=False, logging_level=logging.ERROR)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        remote = ray.remote(num_cpus=0, max_calls=1, max_retries=0)(_make_reader(directories, stale_after))
        options = {"runtime_env": runtime_env} if runtime_env and not started else {}  # else: the job's already
        refs = [
            remote.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False), **options
            ).remote()
            for n in nodes
        ]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout or TIMEOUT_S)
        for node, ref in zip(nodes, refs, strict=True):
            where = f"node {node['NodeID'][:8]} ({node.get('NodeManagerAddress', '?')})"
            try:
                if ref not in ready:
                    ray.cancel(ref, force=True)
                    raise TimeoutError(f"no answer within {timeout or TIMEOUT_S:g} s (--timeout)")
                answer = ray.get(ref)
            except Exception as exc:  # a node that cannot answer is named, the others still count
                answer = {"error": describe(exc)}
            for key, items in _checked(answer, where).items():
                found[key] += [item for item in items if _new(item, seen)]
    except Exception as exc:
        return {"error": f"cannot read the Ray cluster at {address!r}: {describe(exc)}"}
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
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
