"""``--ray``'s child process and its deadlines, without Ray: how ``auto`` is resolved, the TCP
check, the parent reading a child that answers, hangs or dies, the progress line, the cluster
named on the screen (``ray_session``; the same against a real cluster: ``tests/ray``)."""

from __future__ import annotations

import io
import json
import socket
import sys
import time
from typing import Any

import pytest

from verl_npu_autopatch.cli import ray_doctor, ray_session
from verl_npu_autopatch.cli.ray_session import Progress, Unreachable, resolve

JOB = {"address": "10.0.0.1:6379", "timeout": 5.0, "work": "m:f", "arguments": {}, "connect_timeout": 30.0}


def _resolve(address: str, env: dict[str, str], current: str | None, running: list[str]) -> tuple[Any, ...]:
    return resolve(address, env, lambda: current, lambda: running)


def test_auto_is_resolved_as_ray_does_and_names_the_other_clusters() -> None:
    assert _resolve("10.0.0.1:6379", {"RAY_ADDRESS": "x:1"}, "y:1", ["z:1"]) == ("10.0.0.1:6379", None, [])
    assert _resolve("auto", {"RAY_ADDRESS": "x:1"}, "y:1", ["z:1"]) == ("x:1", "RAY_ADDRESS", [])
    assert _resolve("auto", {}, "y:1", ["z:1", "y:1"]) == ("y:1", "current", ["z:1"])
    assert _resolve("auto", {}, None, ["z:1", "b:2", "z:1"]) == ("b:2", "running", ["z:1"])
    with pytest.raises(Unreachable, match=r"no Ray cluster found on this host .*pass its ADDRESS"):
        _resolve("auto", {"RAY_ADDRESS": ""}, None, [])


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.1:6379", ("10.0.0.1", 6379)),
        ("head.example:6379", ("head.example", 6379)),
        ("ray://head:10001", ("head", 10001)),
        ("[::1]:6379", ("::1", 6379)),
        ("local", None),
        ("/some/dir", None),
    ],
)
def test_host_port(address: str, expected: tuple[str, int] | None) -> None:
    assert ray_session._host_port(address) == expected


def test_nothing_listening_is_told_at_once_and_a_listener_passes() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert ray_session._reachable(f"127.0.0.1:{port}", 5) is None
    started = time.monotonic()
    why = ray_session._reachable(f"127.0.0.1:{port}", 5)  # closed now
    assert why is not None and why.startswith("connection refused: nothing listens there")
    assert time.monotonic() - started < 2


def _child(script: str) -> list[str]:
    """A stand-in child: reads the job, then runs ``script`` (``say(event, **fields)`` writes one answer)."""
    prelude = (
        "import json, sys, time\n"
        "job = json.loads(sys.stdin.read())\n"
        "def say(event, **fields):\n"
        "    print(json.dumps({'event': event, **fields}), flush=True)\n"
    )
    return [sys.executable, "-c", prelude + script]


def _run(script: str, **job: Any) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    found = ray_session._run_child({**JOB, **job}, Progress("t", io.StringIO()), _child(script))
    return found, time.monotonic() - started


RAY_LINE = "[2026-12-04 16:40:34,111 W 518 518] rpc_client.h:153: Failed to connect to GCS at address 10.0.0.1:6379"


def test_a_connection_that_hangs_is_abandoned_at_the_timeout_with_rays_last_word() -> None:
    script = f"sys.stderr.write({RAY_LINE!r} + '\\n'); sys.stderr.flush(); time.sleep(120)"
    found, took = _run(script, connect_timeout=4.0)
    assert found == {
        "error": "cannot reach the Ray cluster at 10.0.0.1:6379 within 4 s: Failed to connect to GCS at address "
        "10.0.0.1:6379"
    }
    assert took < 10
    found, _ = _run("time.sleep(120)", connect_timeout=1.0)
    assert found["error"].endswith("within 1 s: no answer (is it the head's GCS port, 6379 by default?)")


def test_the_address_auto_resolved_to_is_named_in_the_failure() -> None:
    resolved = "say('resolved', address='10.0.0.9:6379 (auto: the latest `ray start` here)'); "
    found, _ = _run(resolved + "time.sleep(120)", address="auto", connect_timeout=2.0)
    assert found["error"].startswith(
        "cannot reach the Ray cluster at 10.0.0.9:6379 (auto: the latest `ray start` here) within 2 s: no answer"
    )
    found, _ = _run(resolved + "say('error', error='connection refused', reached=False)", address="auto")
    assert found == {
        "error": "cannot reach the Ray cluster at 10.0.0.9:6379 (auto: the latest `ray start` here): connection refused"
    }


def test_after_connecting_the_node_timeout_and_grace_bound_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_session, "GRACE_S", 0.5)
    cluster = {"address": "10.0.0.1:6379", "session": "s", "found_by": None, "others": []}
    found, took = _run(f"say('connected', cluster={cluster!r}); time.sleep(120)", timeout=1.0)
    assert found["error"].startswith("the Ray cluster at 10.0.0.1:6379 stopped answering: nothing within 1.5 s")
    assert found["cluster"] == cluster and took < 10


def test_answers_are_read_and_the_nodes_counted() -> None:
    cluster = {"address": "10.0.0.1:6379", "session": "s", "found_by": None, "others": []}
    script = (
        f"say('connected', cluster={cluster!r}); say('nodes', done=0, total=2); say('nodes', done=2, total=2); "
        "print('noise', file=sys.stderr); say('result', result={'big': 'x' * 3_000_000})"  # longer than one read
    )
    found, _ = _run(script)
    assert found == {"cluster": {**cluster, "nodes": 2}, "result": {"big": "x" * 3_000_000}}


def test_errors_and_a_child_that_dies_are_one_line() -> None:
    found, _ = _run("say('error', error='connection refused: nothing listens there', reached=False)")
    assert found == {
        "error": "cannot reach the Ray cluster at 10.0.0.1:6379: connection refused: nothing listens there"
    }
    found, _ = _run("sys.stderr.write('Segmentation fault\\n'); sys.exit(139)")
    assert found == {
        "cluster": None,
        "error": "the process reading the Ray cluster at 10.0.0.1:6379 ended without an answer: Segmentation fault",
    }


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal_after_the_delay() -> None:
    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = Progress("doctor --ray", stream, delay=0)
        progress.show("1/8 nodes answered")
        progress.show("2/8 nodes answered")
        progress.clear()
    assert pipe.getvalue() == ""
    text = terminal.getvalue()
    assert text.startswith("\rdoctor --ray: 1/8 nodes answered (0 s)\rdoctor --ray: 2/8 nodes answered (0 s)")
    assert text.endswith("\r" + " " * len("doctor --ray: 2/8 nodes answered (0 s)") + "\r")
    late = Terminal()
    Progress("doctor --ray", late, delay=60).show("1/8 nodes answered")  # quick work shows nothing
    assert late.getvalue() == ""


def test_the_screen_names_the_cluster_reached_and_the_others_auto_could_have_chosen() -> None:
    cluster = {"address": "10.0.0.1:6379", "session": "session_1", "found_by": "RAY_ADDRESS", "others": []}
    assert ray_session.cluster_lines("auto", cluster) == (
        "the Ray cluster at 10.0.0.1:6379 (auto: RAY_ADDRESS), session session_1",
        [],
    )
    cluster = {**cluster, "found_by": "the latest `ray start` here", "others": ["10.0.0.1:7000"]}
    where, notes = ray_session.cluster_lines("auto", cluster)
    assert where.startswith("the Ray cluster at 10.0.0.1:6379 (auto: the latest `ray start` here)")
    assert notes == [
        "note: 2 Ray clusters run on this host; auto reached 10.0.0.1:6379, not 10.0.0.1:7000: "
        "pass ADDRESS (or set RAY_ADDRESS) to choose"
    ]
    assert ray_session.cluster_lines("auto", None) == ("the Ray cluster at auto", [])


def _node(installed: bool) -> dict[str, Any]:
    node = {"NodeID": ("ab" if installed else "cd") * 14, "NodeManagerAddress": "10.0.0.2"}
    found = {"installed": installed, "python": "/py", "error": None if installed else "cannot be imported"}
    if installed:
        found["status"] = {
            "version": "0.1.0",
            "device": "none",
            "configuration": {"enabled": True},
            "observer_installed": True,
            "distributions": {},
            "patches": [],
        }
    return ray_doctor.summarize(node, found)


def test_doctor_ray_names_the_cluster_and_how_to_ship_the_package(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = {"address": "10.0.0.1:6379", "session": "s1", "found_by": "RAY_ADDRESS", "others": ["10.0.0.1:7000"]}
    entries = [_node(True), _node(False)]
    data = {"address": "auto", "runtime_env": None, "cluster": cluster, "nodes": entries}
    data["disagreements"] = ray_doctor.disagreements(entries)
    data["problems"] = ray_doctor.problems(entries, data["disagreements"])
    monkeypatch.setattr(ray_doctor, "probe_cluster", lambda *args: data)
    args = argparse_namespace(ray="auto")
    assert ray_doctor.main(args, "m:f") == ray_doctor.PROBLEMS
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "verl-npu-autopatch doctor --ray: 2 alive node(s) in the Ray cluster at 10.0.0.1:6379 (auto: RAY_ADDRESS), "
        "session s1"
    )
    assert lines[1].startswith("note: 2 Ray clusters run on this host; auto reached 10.0.0.1:6379, not 10.0.0.1:7000")
    assert "verl-npu-autopatch is missing on 1 node(s): cdcdcdcd." in lines
    assert '  --runtime-env \'{"pip": ["/path/to/verl_npu_autopatch-0.1.0-py3-none-any.whl"]}\'' in lines


def argparse_namespace(**given: Any) -> Any:
    from argparse import Namespace

    return Namespace(**{"ray": "auto", "runtime_env": None, "device": None, "json": False, "timeout": None, **given})


def test_the_job_names_its_work_and_the_child_runs_it_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child imports the work by the name the command gave (no import of the commands here)."""
    seen: list[Any] = []
    monkeypatch.setattr(ray_session, "run", lambda job, env, connect, progress: seen.append(job) or {"error": "x"})
    ray_doctor.probe_cluster("a:1", None, "m:f", 7.0, 3.0, Progress("t", io.StringIO()))
    assert seen == [
        {"address": "a:1", "timeout": 7.0, "work": f"{ray_doctor.__name__}:probe_nodes", "arguments": {"status": "m:f"}}
    ]
    work = json.loads(json.dumps(seen[0]))["work"].partition(":")
    assert callable(getattr(sys.modules[work[0]], work[2]))


def test_a_failed_ray_init_says_why_from_its_cause() -> None:
    """``ray.init`` raises "Failed to connect" from an error whose last line has the reason (Ray
    2.60 with token authentication and no token: seen against the test cluster)."""
    cause = RuntimeError(
        "Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n  ...\n"
        "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token is missing\n"
    )
    try:
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from cause
    except ConnectionError as exc:
        assert ray_session._why(exc) == (
            "ConnectionError: Failed to connect to Ray cluster at 10.0.0.1:6379 (ray.exceptions.AuthenticationError: "
            "RPC error: InvalidAuthToken: Authentication token is missing)"
        )
    assert ray_session._why(ValueError("plain")) == "ValueError: plain"
