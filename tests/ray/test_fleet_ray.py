"""``VERL_NPU_AUTOPATCH_REPORT_DIR`` set in a Ray ``runtime_env`` reaches the actors' processes, and
``verl-npu-autopatch fleet --ray ADDRESS DIR`` gathers their report files from every node of the
local two-node cluster of ``conftest.py`` (the head's Python has the package, the bare node's gets
it from a pip ``runtime_env``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.children import FIXTURE_SITE, clean_env

if TYPE_CHECKING:
    from tests.ray.conftest import Cluster


def fleet(python: Path, cluster: Cluster, *args: str) -> tuple[int, dict[str, Any]]:
    command = [str(python.parent / "verl-npu-autopatch"), "fleet", "--ray", cluster.address, "--json", *args]
    proc = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=900, check=False)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_fleet_gathers_the_actors_reports_from_every_node(
    runner_python: Path, cluster: Cluster, wheel: Path, tmp_path: Path
) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    class Holder:
        def __init__(self) -> None:
            import vllm.model  # noqa: F401  (activates the engine in this worker: it writes its report)

        def pid(self) -> int:
            import os

            return os.getpid()

    report_dir = tmp_path / "reports"
    env_vars = {
        "PYTHONPATH": str(FIXTURE_SITE),
        "VERL_NPU_AUTOPATCH_DEVICE": "npu",
        "VERL_NPU_AUTOPATCH_REPORT_DIR": str(report_dir),
    }
    actors = []
    for node, runtime_env in (
        (cluster.head_id, {"env_vars": env_vars}),
        (cluster.bare_id, {"env_vars": env_vars, "pip": [str(wheel)]}),
    ):
        pinned = NodeAffinitySchedulingStrategy(node, soft=False)
        actor = ray.remote(num_cpus=0)(Holder).options(scheduling_strategy=pinned, runtime_env=runtime_env).remote()
        actors.append(actor)
    pids = ray.get([a.pid.remote() for a in actors], timeout=600)
    try:
        code, data = fleet(runner_python, cluster, str(report_dir), "--runtime-env", json.dumps({"pip": [str(wheel)]}))
        bare_code, bare = fleet(runner_python, cluster, str(report_dir))  # the bare node cannot read: named
    finally:
        for actor in actors:
            ray.kill(actor)
    assert code == 0 and data["unreadable"] == [] and data["problems"] == []
    assert sorted(p["pid"] for p in data["processes"]) == sorted(pids)  # both nodes read the same host's files
    assert data["roles"] == {"Ray worker": 2}
    assert all(p["title"].startswith("ray::Holder") for p in data["processes"])
    assert all(p["records"]["fixture.forward"]["state"] == "applied" for p in data["processes"])
    assert bare_code == 0 and sorted(p["pid"] for p in bare["processes"]) == sorted(pids)
    [unreadable] = bare["unreadable"]
    assert unreadable["file"].startswith(f"node {cluster.bare_id[:8]}") and "cannot be imported" in unreadable["error"]


def test_fleet_ray_dir_reads_dir_on_the_cluster_auto_finds_and_names_the_nodes_without_the_package(
    runner_python: Path, cluster: Cluster, tmp_path: Path
) -> None:
    """The documented ``fleet --ray DIR`` (``--ray`` alone: auto, here through ``RAY_ADDRESS``):
    DIR is read on every node, the cluster reached is named, and the bare node is named with how to
    ship the package, not told to set the report variable (issue 39)."""
    command = [str(runner_python.parent / "verl-npu-autopatch"), "fleet", "--ray", str(tmp_path)]
    env = clean_env(RAY_ADDRESS=cluster.address)
    proc = subprocess.run([*command, "--json"], env=env, capture_output=True, text=True, timeout=900, check=False)
    data = json.loads(proc.stdout)
    assert proc.returncode == 2 and proc.stderr == ""  # no live process
    assert data["cluster"]["address"] == cluster.address and data["cluster"]["nodes"] == 2
    assert data["sources"][0].startswith(f"{tmp_path} on every node of the Ray cluster at {cluster.address}")
    [bare] = data["without_package"]
    assert bare.startswith(f"node {cluster.bare_id[:8]} (")
    text = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False).stdout
    words = " ".join(text.split())
    assert f"verl-npu-autopatch is missing on 1 node(s): {bare}." in words
    assert """--runtime-env '{"pip": ["/path/to/verl_npu_autopatch-0.1.0-py3-none-any.whl"]}'""" in words
    assert "is VERL_NPU_AUTOPATCH_REPORT_DIR set" not in words
