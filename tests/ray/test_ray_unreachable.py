"""``doctor --ray`` and ``fleet --ray`` at an address where no Ray cluster answers, run as users
run them (the runner venv's console script): one line, exit 2, nothing of Ray's own logging on the
screen, and back within ``--timeout`` (no cluster needed).

Before issue 39, ``doctor --ray 127.0.0.1:1 --timeout 5`` was still running after 60 s (832 s in
the report), its stderr filling with Ray's C++ warnings ("Failed to connect to GCS at address ...
within 5 seconds", "Failed to get cluster ID from GCS server").
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.children import clean_env


def command(python: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run(
        [str(python.parent / "verl-npu-autopatch"), *args],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,  # generous: the assertions are on the output and the exit status
        check=False,
    )
    return proc, time.monotonic() - started


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """``127.0.0.1:PORT`` where a socket accepts connections and never says a word (a wrong port:
    Ray's client retries such an address for minutes)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield f"127.0.0.1:{server.getsockname()[1]}"


@pytest.mark.parametrize("subcommand", [["doctor", "--ray"], ["fleet", "--ray"]])
def test_nobody_listening_is_one_line_at_once(runner_python: Path, subcommand: list[str], tmp_path: Path) -> None:
    directory = [str(tmp_path)] if subcommand[0] == "fleet" else []
    proc, _ = command(runner_python, *subcommand, "127.0.0.1:1", *directory, "--timeout", "5")
    assert proc.returncode == 2
    assert proc.stderr == ""  # none of Ray's C++ warnings
    assert proc.stdout.splitlines() == [
        f"{subcommand[0]}{' --ray' if subcommand[0] == 'doctor' else ''}: cannot reach the Ray cluster at "
        "127.0.0.1:1: connection refused: nothing listens there (is Ray running? `ray status` on the head node)"
    ]


@pytest.mark.parametrize("subcommand", ["doctor", "fleet"])
def test_an_address_that_never_answers_is_abandoned_at_the_timeout(
    runner_python: Path, subcommand: str, silent_listener: str, tmp_path: Path
) -> None:
    directory = [str(tmp_path)] if subcommand == "fleet" else []
    proc, took = command(runner_python, subcommand, "--ray", silent_listener, *directory, "--timeout", "5")
    assert proc.returncode == 2 and proc.stderr == ""
    [line] = proc.stdout.splitlines()
    assert line.startswith(f"{subcommand}{' --ray' if subcommand == 'doctor' else ''}: cannot reach the Ray cluster")
    assert f"at {silent_listener} within 5 s: " in line
    assert took < 40, took  # 5 s and the interpreters' start; Ray alone retries for minutes
    proc, _ = command(runner_python, subcommand, "--ray", silent_listener, *directory, "--timeout", "5", "--json")
    assert proc.returncode == 2 and proc.stderr == ""
    assert f"at {silent_listener} within 5 s: " in json.loads(proc.stdout)["error"]
