"""A real two-node Ray cluster on this machine, for the runtime_env and ``doctor --ray`` tests.

Run these tests with the runner environment's pytest (it has Ray and virtualenv)::

    PY=$(python3 tests/support/venvs.py ensure runner) && $PY -m pytest tests/ray

* The **head** node is started in the test process by ``ray.init()``, so its workers run the
  runner environment's Python, which has the freshly built wheel installed (like a cluster image
  with the package baked in).
* The **bare** node is a second raylet joined with ``ray start --address ... --block`` from a venv
  that has Ray but *not* the package (like a node whose image lacks it). It has its own temp dir,
  so a pip runtime_env on it is built there, cloned from the bare venv: whatever
  ``verl_npu_autopatch`` a worker on that node imports came from the runtime_env.

Each module gets its own cluster; teardown stops the bare node by its process id, shuts Ray down
and kills any process still holding one of the cluster's temp dirs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import tiers, venvs
from tests.support.children import clean_env

tiers.require(__file__)  # the runner environment: Ray

#: Extra packages of the bare node's venv: the runner env's Ray (see ``venvs.SPECS["runner"]``).
BARE_NODE_PACKAGES = ("ray==2.60.0", "virtualenv")


@dataclass
class Cluster:
    """Where the test cluster is and what it is made of."""

    address: str
    head_id: str
    bare_id: str
    head_temp: Path
    bare_temp: Path
    bare_prefix: Path


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The freshly built wheel, copied out of ``dist/`` (other test sessions rebuild it there)."""
    built = venvs.build_wheel()
    return Path(shutil.copy(built, tmp_path_factory.mktemp("wheel") / built.name))


@pytest.fixture(scope="session")
def runner_python(wheel: Path) -> Path:
    """The runner venv (this interpreter's), with the freshly built wheel installed into it."""
    env = venvs.ensure_env("runner", wheel)
    if Path(sys.prefix).resolve() != env.resolve():
        raise RuntimeError(
            f"tests/ray must run under the runner venv {env} (the head node's workers use this interpreter); "
            "use: PY=$(python3 tests/support/venvs.py ensure runner) && $PY -m pytest tests/ray"
        )
    return venvs.env_python(env)


@pytest.fixture(scope="session")
def bare_python() -> Path:
    """A Python 3.11 venv with Ray, wrapt and packaging, and without verl-npu-autopatch."""
    python = venvs.env_python(venvs.ensure_env("base", None, extra=BARE_NODE_PACKAGES))
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "-q", "verl-npu-autopatch"], check=True, capture_output=True
    )
    return python


def _cluster_pids(*dirs: Path) -> list[int]:
    """Processes whose command line names one of ``dirs`` (every raylet, store, worker and agent
    of the test cluster does: their session dirs live there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(str(d) in command for d in dirs):
            found.append(int(entry.name))
    return found


@contextlib.contextmanager
def local_cluster(bare_python: Path) -> Iterator[Cluster]:
    """Start the head (``ray.init``) and the bare node; stop both, leaving nothing running."""
    import ray

    head_temp = Path(tempfile.mkdtemp(prefix="vnr", dir="/tmp"))  # short: Ray's socket paths live here
    bare_temp = Path(tempfile.mkdtemp(prefix="vnb", dir="/tmp"))
    bare_node, log = None, (bare_temp / "ray-start.log").open("w")
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name in [n for n in os.environ if n.startswith("VERL_NPU_AUTOPATCH") or n == "PYTHONPATH"]:
                patch.delenv(name)  # the head's workers inherit this process's environment
            context = ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(head_temp), log_to_driver=False)
        address = context.address_info["gcs_address"]
        head_id = context.address_info["node_id"]
        bare_node = subprocess.Popen(
            [
                str(bare_python.parent / "ray"),
                "start",
                "--address",
                address,
                "--num-cpus",
                "1",
                "--block",
                "--temp-dir",
                str(bare_temp),
                "--disable-usage-stats",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_env(RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0"),
            start_new_session=True,
        )
        deadline = time.monotonic() + 180
        while True:
            others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head_id]
            if others:
                break
            if bare_node.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the bare node did not join:\n" + (bare_temp / "ray-start.log").read_text())
            time.sleep(0.5)
        yield Cluster(address, head_id, others[0], head_temp, bare_temp, bare_python.parents[1])
    finally:
        if bare_node is not None:  # first, while the head's GCS still answers
            bare_node.send_signal(signal.SIGTERM)
            try:
                bare_node.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(bare_node.pid, signal.SIGKILL)
                bare_node.wait(10)
        log.close()
        ray.shutdown()
        deadline = time.monotonic() + 30
        while _cluster_pids(head_temp, bare_temp) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in _cluster_pids(head_temp, bare_temp):  # strays: ours, found by our temp dirs
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(head_temp, ignore_errors=True)
        shutil.rmtree(bare_temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(runner_python: Path, bare_python: Path) -> Iterator[Cluster]:
    with local_cluster(bare_python) as running:
        yield running
