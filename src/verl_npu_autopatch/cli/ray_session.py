"""The Ray side of ``doctor --ray`` and ``fleet --ray``, run in a child process the command can
abandon.

``ray.init(address=...)`` retries an unreachable or wrong address for many minutes inside Ray's
C++ client (14 minutes were seen), which writes its warnings to the process's file descriptor 2;
neither can be bounded or silenced from Python. So the command line never imports Ray: it starts
``python -c`` running :func:`child` (the job on its stdin, its stderr in a temporary file) and
reads its answers, one JSON object a line, with deadlines:

* ``connected`` (the cluster reached: its address, session, how ``auto`` found it) within the
  connection timeout (``--timeout``, else :data:`CONNECT_TIMEOUT_S`);
* ``nodes`` (``done`` of ``total`` answered: the progress line), then ``result`` or ``error``,
  within the node timeout plus :data:`GRACE_S` (the child names the nodes late by the node timeout).

A child past a deadline is killed with its process group; the command prints one line: the
address, the wait and Ray's last warning. Before connecting, the child resolves ``auto`` as Ray does
(:func:`resolve`) and tries a TCP connection to the address: nothing listening there is one line at
once. A process that is a connected Ray driver already (the API used from a job) does the work
itself (:func:`in_process`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from verl_npu_autopatch.cli.summary import StatusLine
from verl_npu_autopatch.engine.text import cut, describe, printable, safe_str

__all__ = [
    "CONNECT_TIMEOUT_S",
    "NoAnswer",
    "Progress",
    "cluster_lines",
    "in_process",
    "on_every_node",
    "resolve",
    "run",
    "wait_all",
]

#: How long reaching the cluster may take when ``--timeout`` is not given (a wrong port that
#: accepts connections, e.g. the dashboard's, is retried by Ray for minutes).
CONNECT_TIMEOUT_S = 60.0
#: How long a plain TCP connection to the address may take, at most (a host that drops packets).
TCP_TIMEOUT_S = 10.0
#: Time the child gets beyond the node timeout to list the nodes, collect and send the answers.
GRACE_S = 60.0
#: Time the child gets to shut Ray down after its answer before it is killed.
EXIT_S = 10.0
#: The longest text kept from Ray's own stderr for the one-line failure.
RAY_SAID_CHARS = 300
#: How ``auto`` was resolved, by the source that gave the address.
FOUND_BY = {"RAY_ADDRESS": "RAY_ADDRESS", "current": "the latest `ray start` here", "running": "the one running here"}


# --------------------------------------------------------------------------- the address
class Unreachable(ConnectionError):
    """Nothing answers at the address, or ``auto`` found no cluster: the message says why."""


def resolve(
    address: str,
    environ: Mapping[str, str],
    current: Callable[[], str | None],
    running: Callable[[], list[str]],
) -> tuple[str, str | None, list[str]]:
    """``(the address to connect to, how auto found it or None, the other clusters running on this
    host)``, in the order Ray resolves ``auto``: ``RAY_ADDRESS``; the address the latest ``ray start``
    here wrote (``current``); a cluster whose processes run here (``running``, the first in sorted
    order where Ray takes any). :class:`Unreachable` when ``auto`` finds nothing."""
    if address != "auto":
        return address, None, []
    from_env = environ.get("RAY_ADDRESS", "").strip()
    if from_env and from_env != "auto":
        return from_env, "RAY_ADDRESS", []
    found = sorted(set(running()))
    latest = current()
    if latest:
        return latest, "current", [a for a in found if a != latest]
    if found:
        return found[0], "running", found[1:]
    raise Unreachable("no Ray cluster found on this host (RAY_ADDRESS is unset, no `ray start` here): pass its ADDRESS")


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port``, ``[v6]:port`` or ``ray://host:port``; None otherwise."""
    match = re.fullmatch(r"(?:ray://)?\[?([^\[\]/\s]+?)\]?:(\d{1,5})/?", address)
    return (match[1], int(match[2])) if match else None


def _reachable(address: str, timeout: float) -> str | None:
    """Why nothing answers a TCP connection at ``address`` (None: something listens, or the
    address is not ``host:port``, e.g. ``local``)."""
    parsed = _host_port(address)
    if parsed is None:
        return None
    try:
        with socket.create_connection(parsed, timeout=min(timeout, TCP_TIMEOUT_S)):
            return None
    except ConnectionRefusedError:  # the commonest mistake: the one line says so
        return "connection refused: nothing listens there (is Ray running? `ray status` on the head node)"
    except TimeoutError:
        return f"no TCP connection within {min(timeout, TCP_TIMEOUT_S):g} s (a firewall, or the wrong host?)"
    except OSError as exc:  # a name that does not resolve, a network that is unreachable: its own words
        return describe(exc)


# --------------------------------------------------------------------------- the child
def child() -> int:
    """The child's side: read the job (JSON on stdin), connect, run it, answer on stdout."""
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # whatever Ray or a task prints goes where Ray's logs go, never into the answers

    def send(event: str, **fields: Any) -> None:
        answers.write(json.dumps({"event": event, **fields}) + "\n")
        answers.flush()

    job = json.loads(sys.stdin.read())
    try:
        import ray
    except ImportError as exc:
        send("error", error=f"ray is not installed in this environment ({describe(exc)})", reached=False)
        return 0
    try:
        cluster = _connect(ray, job, send)
    except Exception as exc:
        send("error", error=safe_str(exc) if isinstance(exc, Unreachable) else _why(exc), reached=False)
        return 0
    send("connected", cluster=cluster)
    try:
        result = _work(ray, job, None, lambda done, total: send("nodes", done=done, total=total))
    except Exception as exc:
        send("error", error=describe(exc), reached=True)
        return 0
    send("result", result=result)
    with contextlib.suppress(Exception):  # the answer is out; the parent kills a shutdown that hangs
        ray.shutdown()
    return 0


def _why(exc: BaseException) -> str:
    """``exc`` described, with the last line of its first cause's (``ray.init`` raises "Failed to
    connect", from an error whose last line says why: e.g. the cluster's token is missing)."""
    cause = exc.__cause__
    lines = [line.strip() for line in safe_str(cause).splitlines() if line.strip()] if cause else []
    return describe(exc) + (f" ({cut(lines[-1], RAY_SAID_CHARS)})" if lines else "")


def _connect(ray: Any, job: dict[str, Any], send: Callable[..., None]) -> dict[str, Any]:
    """``ray.init`` as a job with its ``runtime_env``, Ray's logging quiet; what was reached. The
    address ``auto`` resolved to is sent first (``resolved``): the parent's messages name it."""
    import logging  # ray imported it already

    services = ray._private.services
    current, running = (lambda: services.find_bootstrap_address(None)), services.find_gcs_addresses
    target, found_by, others = resolve(job["address"], os.environ, current, lambda: sorted(running()))
    if found_by:
        send("resolved", address=f"{target} (auto: {FOUND_BY[found_by]})")
    why = _reachable(target, job["connect_timeout"])
    if why:
        raise Unreachable(why)
    ray.init(address=target, runtime_env=job["runtime_env"], log_to_driver=False, logging_level=logging.ERROR)
    return {**_reached(ray, target), "found_by": FOUND_BY.get(found_by or ""), "others": others}


def _reached(ray: Any, target: str) -> dict[str, Any]:
    """The address and session of the cluster this driver is connected to."""
    reached: dict[str, Any] = {"address": target, "session": None}
    try:
        reached["address"] = ray.get_runtime_context().gcs_address or target
        reached["session"] = ray._private.worker.global_worker.node.session_name
    except Exception:  # a Ray client (ray://) connection has no local node: the address given stands
        pass
    return reached


def _work(
    ray: Any, job: dict[str, Any], runtime_env: dict[str, Any] | None, progress: Callable[[int, int], None]
) -> Any:
    """The job's ``work`` (``"module:function"``, named by the command that made the job) over
    every alive node: ``function(ray, runtime_env, timeout, progress, **arguments)``, the tasks in
    ``runtime_env`` (None: the driver's)."""
    module, _, function = job["work"].partition(":")
    work = getattr(importlib.import_module(module), function)
    return work(ray, runtime_env, job["timeout"], progress, **job["arguments"])


def in_process(
    ray: Any, job: dict[str, Any], runtime_env: dict[str, Any] | None, progress: Callable[[int, int], None]
) -> dict[str, Any]:
    """The job in this process, a connected Ray driver: its tasks run in ``runtime_env``."""
    cluster = {**_reached(ray, job["address"]), "found_by": None, "others": []}

    def counted(done: int, total: int) -> None:
        cluster["nodes"] = total
        progress(done, total)

    return {"cluster": cluster, "result": _work(ray, job, runtime_env, counted)}


class NoAnswer(TimeoutError):
    """A node whose task did not answer within the timeout (it was cancelled)."""


def on_every_node(
    ray: Any,
    work: Callable[[], Any],
    runtime_env: dict[str, Any] | None,
    timeout: float,
    progress: Callable[[int, int], None],
) -> list[tuple[dict[str, Any], Any, BaseException | None]]:
    """``work`` once on each alive node (head first): a task pinned there (``num_cpus=0``), in
    ``runtime_env`` (None: the driver's). ``(node, answer, error)`` per node; a node that has not
    answered within ``timeout`` seconds is cancelled, its error a :class:`NoAnswer`."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    nodes.sort(key=lambda n: ("node:__internal_head__" not in n.get("Resources", {}), n["NodeID"]))
    remote = ray.remote(num_cpus=0, max_calls=1, max_retries=0)(work)
    options = {"runtime_env": runtime_env} if runtime_env else {}
    refs = [
        remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False), **options).remote()
        for n in nodes
    ]
    ready = wait_all(ray, refs, timeout, progress)
    answers: list[tuple[dict[str, Any], Any, BaseException | None]] = []
    for node, ref in zip(nodes, refs, strict=True):
        if ref not in ready:
            ray.cancel(ref, force=True)
            answers.append((node, None, NoAnswer(f"no answer within {timeout:g} s (--timeout)")))
            continue
        try:
            answers.append((node, ray.get(ref), None))
        except Exception as exc:  # e.g. RuntimeEnvSetupError: the runtime_env failed on that node
            answers.append((node, None, exc))
    return answers


def wait_all(ray: Any, refs: list[Any], timeout: float, progress: Callable[[int, int], None]) -> set[Any]:
    """The refs done within ``timeout`` seconds; ``progress(done, total)`` at the start and after each."""
    deadline, ready, pending = time.monotonic() + timeout, set[Any](), list(refs)
    progress(0, len(refs))
    while pending and (left := deadline - time.monotonic()) > 0:
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        ready.update(done)
        if done:
            progress(len(ready), len(refs))
    return ready


def connected_ray() -> Any:
    """This process's ``ray`` module when it is a connected driver (never imports Ray)."""
    ray = sys.modules.get("ray")
    try:
        return ray if ray is not None and ray.is_initialized() else None
    except Exception:  # a half-imported or foreign module named ray: not a connection to use
        return None


# --------------------------------------------------------------------------- the parent
class Progress(StatusLine):
    """One line on stderr, rewritten in place, once the work took longer than ``delay`` seconds;
    only when stderr is a terminal (never in a pipe, a file or a log)."""

    def __init__(self, label: str, stream: IO[str] | None = None, delay: float | None = None) -> None:
        super().__init__(sys.stderr if stream is None else stream, delay)
        try:
            self.enabled = self.stream.isatty()
        except Exception:  # a replaced stream without isatty: no progress line
            self.enabled = False
        self.label = label

    def show(self, text: str) -> None:
        elapsed = self.due() if self.enabled else None
        if elapsed is None:
            return
        width = shutil.get_terminal_size((120, 24)).columns - 1
        self.write(printable(f"{self.label}: {text} ({elapsed:.0f} s)")[:width])


def run(job: dict[str, Any], runtime_env: dict[str, Any] | None, connect_timeout: float, progress: Progress) -> Any:
    """``{"cluster", "result"}`` of ``job`` (``address``, ``timeout``: the node wait, ``work`` and its
    ``arguments``: see :func:`_work`) on the cluster, or ``{"error"}``: one line. Never waits longer than
    ``connect_timeout`` for the cluster, nor ``job["timeout"] + GRACE_S`` for the answers."""
    ray = connected_ray()
    try:
        if ray is not None:
            return in_process(ray, job, runtime_env, lambda done, total: _progress(progress, done, total))
        return _run_child({**job, "runtime_env": runtime_env, "connect_timeout": connect_timeout}, progress)
    finally:
        progress.clear()


def _progress(progress: Progress, done: int, total: int) -> None:
    progress.show(f"{done:,}/{total:,} nodes answered")


def _run_child(job: dict[str, Any], progress: Progress, command: list[str] | None = None) -> dict[str, Any]:
    """``command`` (default: :func:`child` in this interpreter) run with ``job``, its answers read."""
    here = str(Path(__file__).resolve().parents[1])  # the parent's own copy of the package, first
    code = f"import sys; sys.path.insert(0, {here!r}); from verl_npu_autopatch.cli.ray_session import child; child()"
    env = {k: v for k, v in os.environ.items() if k != "VERL_NPU_AUTOPATCH_REPORT_DIR"}  # no job process
    with tempfile.TemporaryFile() as ray_said:
        proc = subprocess.Popen(
            command or [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=ray_said,
            env=env,
            start_new_session=True,  # its process group is killed with it
        )
        try:
            return _read_answers(proc, job, progress, ray_said)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile: nothing to kill
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()


def _read_answers(
    proc: subprocess.Popen[bytes], job: dict[str, Any], progress: Progress, ray_said: IO[bytes]
) -> dict[str, Any]:
    """The child's answers until its result, an error, its end or a deadline."""
    assert proc.stdin is not None and proc.stdout is not None
    with contextlib.suppress(BrokenPipeError):  # a child that died at once: its end is read below
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
    address, connect_timeout = job["address"], job["connect_timeout"]
    wait, deadline = connect_timeout, time.monotonic() + connect_timeout
    cluster: dict[str, Any] | None = None
    pending, lines = bytearray(), list[bytes]()
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = _ray_said(ray_said) or "no answer" + (
                "" if cluster else " (is it the head's GCS port, 6379 by default?)"
            )
            if cluster is None:
                return {"error": f"cannot reach the Ray cluster at {address} within {wait:g} s: {reason}"}
            what = f"stopped answering: nothing within {wait:g} s of connecting: {reason}"
            return {"cluster": cluster, "error": f"the Ray cluster at {cluster['address']} {what}"}
        if selector.select(min(left, 0.5)):
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                reason = _ray_said(ray_said) or f"exit status {proc.wait()}"
                where = f"the Ray cluster at {cluster['address'] if cluster else address}"
                return {"cluster": cluster, "error": f"the process reading {where} ended without an answer: {reason}"}
            start = len(pending)
            pending += chunk
            while (end := pending.find(b"\n", start)) >= 0:
                lines.append(bytes(pending[: end + 1]))
                del pending[: end + 1]
                start = 0
        for line in lines:
            answer = json.loads(line)
            if answer["event"] == "resolved":
                address = answer["address"]
            elif answer["event"] == "connected":
                cluster = answer["cluster"]
                wait = job["timeout"] + GRACE_S
                deadline = time.monotonic() + wait
            elif answer["event"] == "nodes":
                _progress(progress, answer["done"], answer["total"])
                if cluster is not None:
                    cluster["nodes"] = answer["total"]
            elif answer["event"] == "error":
                if not answer["reached"]:
                    return {"error": f"cannot reach the Ray cluster at {address}: {answer['error']}"}
                return {"cluster": cluster, "error": f"cannot use the Ray cluster at {address}: {answer['error']}"}
            else:
                try:
                    proc.wait(EXIT_S)
                except subprocess.TimeoutExpired:  # its Ray shutdown hangs: the answer is in, it is killed
                    pass
                return {"cluster": cluster, "result": answer["result"]}
        lines.clear()
        if cluster is None:
            progress.show(f"reaching the Ray cluster at {address}")
        elif "nodes" not in cluster:
            progress.show(f"connected to {cluster['address']}, listing the nodes")


#: The prefix of a line of Ray's C++ log (``[2026-12-04 16:40:34,111 W 518 518] rpc_client.h:153: ``).
_RAY_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*(?:\([^)]*\)\s*)?[\w.]+:\d+:\s*")


def _ray_said(stream: IO[bytes]) -> str:
    """The last line Ray wrote to the child's stderr, without its log prefix, cut and escaped."""
    stream.seek(0, os.SEEK_END)
    stream.seek(max(0, stream.tell() - 64 * 1024))
    text = stream.read().decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    return printable(cut(_RAY_LOG_PREFIX.sub("", lines[-1]), RAY_SAID_CHARS))


# --------------------------------------------------------------------------- what to show
def cluster_lines(given: str, cluster: dict[str, Any] | None) -> tuple[str, list[str]]:
    """``(where, notes)``: ``the Ray cluster at ADDRESS (session S)`` naming the address reached
    (and ``auto``'s source), and a note when ``auto`` had several clusters to choose from."""
    if not cluster:
        return f"the Ray cluster at {printable(given)}", []
    session = f", session {cluster['session']}" if cluster.get("session") else ""
    how = f" (auto: {cluster['found_by']})" if cluster.get("found_by") else ""
    where = f"the Ray cluster at {cluster['address']}{how}{session}"
    notes = []
    if cluster.get("others"):
        others = ", ".join(cluster["others"])
        notes.append(
            f"note: {len(cluster['others']) + 1} Ray clusters run on this host; auto reached {cluster['address']}, "
            f"not {others}: pass ADDRESS (or set RAY_ADDRESS) to choose"
        )
    return printable(where), [printable(n) for n in notes]
