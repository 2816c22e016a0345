"""``verl-npu-autopatch doctor --ray ADDRESS``, run as users run it (the runner venv's console
script, a second driver) against the local two-node cluster of ``conftest.py``: the head node's
Python has the package, the bare node's does not."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.children import FIXTURE_SITE, clean_env

if TYPE_CHECKING:
    from tests.ray.conftest import Cluster


def doctor(python: Path, cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(python.parent / "verl-npu-autopatch"), "doctor", "--ray", cluster.address, *args]
    return subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=900, check=False)


def doctor_json(python: Path, cluster: Cluster, *args: str) -> tuple[int, dict[str, Any]]:
    proc = doctor(python, cluster, "--json", *args)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def by_node(data: dict[str, Any], cluster: Cluster) -> tuple[dict[str, Any], dict[str, Any]]:
    nodes = {n["node_id"]: n for n in data["nodes"]}
    assert set(nodes) == {cluster.head_id, cluster.bare_id}
    return nodes[cluster.head_id], nodes[cluster.bare_id]


def test_a_node_without_the_package_is_reported_and_fails(runner_python: Path, cluster: Cluster) -> None:
    code, data = doctor_json(runner_python, cluster)
    head, bare = by_node(data, cluster)
    assert code == 1
    assert head["installed"] is True and head["version"] == "0.1.0" and head["hook"] == "observer"
    assert head["python"] == str(runner_python)
    assert data["environment"]["verl_npu_autopatch"] == "0.1.0"  # where doctor --ray ran, as every --json says
    assert bare["installed"] is False and bare["python"] == str(cluster.bare_prefix / "bin" / "python")
    assert "cannot be imported" in bare["error"]
    assert [d["field"] for d in data["disagreements"]] == ["installed"]
    assert any("verl-npu-autopatch is not installed" in p and cluster.bare_id[:8] in p for p in data["problems"])


def test_table_marks_the_odd_node(runner_python: Path, cluster: Cluster) -> None:
    proc = doctor(runner_python, cluster)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    (head_row,) = [line for line in lines if line.startswith(cluster.head_id[:8] + " (head)")]
    (bare_row,) = [line for line in lines if line.startswith(cluster.bare_id[:8] + " ")]
    assert head_row.split()[3:6] == ["yes", "0.1.0", "observer"]
    assert bare_row.split()[2:4] == ["NO", "*"]
    assert "DISAGREEMENTS (cells marked * differ from the majority):" in lines
    assert f"  installed: {cluster.head_id[:8]} (head): true; {cluster.bare_id[:8]}: false" in lines
    assert "PROBLEMS:" in lines


def test_wheel_in_the_runtime_env_puts_the_package_on_every_node(
    runner_python: Path, cluster: Cluster, wheel: Path
) -> None:
    code, data = doctor_json(runner_python, cluster, "--runtime-env", json.dumps({"pip": [str(wheel)]}))
    head, bare = by_node(data, cluster)
    assert (code, data["problems"], data["disagreements"]) == (0, [], []), data["problems"]
    for node in (head, bare):
        assert node["installed"] is True and node["version"] == "0.1.0"
        assert node["hook"] == "observer"  # the .pth ran in the probe's worker
        assert node["device"] == "none (torch_npu not installed)"
    assert Path(bare["python"]).is_relative_to(cluster.bare_temp)  # the runtime_env's venv on that node


def test_master_switch_in_runtime_env_vars_shows_on_every_node(
    runner_python: Path, cluster: Cluster, wheel: Path
) -> None:
    env = {"pip": [str(wheel)], "env_vars": {"VERL_NPU_AUTOPATCH": "0"}}
    code, data = doctor_json(runner_python, cluster, "--runtime-env", json.dumps(env))
    assert code == 0, data["problems"]
    for node in by_node(data, cluster):
        assert node["hook"] == "switched off" and node["device"] == "-"
        assert node["configuration"]["enabled"] is False
        assert node["would_apply"] == []


def test_device_npu_shows_which_patches_would_apply(runner_python: Path, cluster: Cluster, wheel: Path) -> None:
    env = {"pip": [str(wheel)], "env_vars": {"PYTHONPATH": str(FIXTURE_SITE)}}
    code, data = doctor_json(runner_python, cluster, "--runtime-env", json.dumps(env), "--device", "npu")
    assert code == 0, data["problems"]
    assert data["runtime_env"]["env_vars"]["VERL_NPU_AUTOPATCH_DEVICE"] == "npu"
    for node in by_node(data, cluster):
        assert node["device"] == "npu (forced)"
        assert "fixture.forward" in node["would_apply"]  # the test plugin, found through PYTHONPATH
        assert "fixture.optin" not in node["would_apply"]  # opt-in
        assert node["patches"]["fixture.gated"] == "gated"


def test_package_shipped_by_py_modules_is_flagged(
    runner_python: Path, cluster: Cluster, wheel: Path, tmp_path: Path
) -> None:
    """py_modules puts the package on PYTHONPATH, whose .pth files Python never processes: it
    imports on the bare node, but nothing installs the observer there."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path, [n for n in archive.namelist() if n.startswith("verl_npu_autopatch/")])
    env = {"py_modules": [str(tmp_path / "verl_npu_autopatch")]}
    code, data = doctor_json(runner_python, cluster, "--runtime-env", json.dumps(env))
    head, bare = by_node(data, cluster)
    assert code == 1
    assert head["hook"] == "observer"
    assert bare["installed"] is True and bare["hook"] == "NOT RUN"
    assert "runtime_resources/py_modules_files" in bare["status"]["package"]
    assert [d["field"] for d in data["disagreements"]] == ["hook"]
    assert any("start-up hook did not run" in p and cluster.bare_id[:8] in p for p in data["problems"])


def test_runtime_env_without_ray_is_refused(runner_python: Path) -> None:
    proc = subprocess.run(
        [str(runner_python.parent / "verl-npu-autopatch"), "doctor", "--runtime-env", "{}"],
        env=clean_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and "--runtime-env needs --ray" in proc.stderr


def test_verify_runs_the_doctor_child_on_every_node(runner_python: Path, cluster: Cluster, wheel: Path) -> None:
    """``--verify`` with ``--ray``: each node's probe runs the doctor child with verification there
    (no torch on these nodes: no kernel patch applies; the fixture patch that does is listed as
    having no tiny-input check)."""
    env = json.dumps({"pip": [str(wheel)], "env_vars": {"PYTHONPATH": str(FIXTURE_SITE)}})
    code, data = doctor_json(runner_python, cluster, "--runtime-env", env, "--device", "npu", "--verify")
    assert code == 0, data["problems"]
    for node in by_node(data, cluster):
        verify = node["verify"]
        assert (verify["ok"], verify["error"], verify["results"]) == (True, None, [])
        assert {"name": "fixture.forward", "reason": "no tiny-input check for this patch"} in verify["not_checked"]
    lines = doctor(runner_python, cluster, "--runtime-env", env, "--device", "npu", "--verify").stdout.splitlines()
    assert "doctor --verify per node (each check: --json):" in lines
    assert f"  {cluster.head_id[:8]} (head): no checks ran" in lines


def test_a_node_whose_kernel_disagrees_is_a_problem() -> None:
    """What ``--ray --verify`` makes of a node whose verification found a mismatch (the node's
    report as ``doctor --verify --json`` gives it)."""
    from verl_npu_autopatch.cli import ray_doctor

    row = {"name": "transformers.qwen3.rms_norm", "passed": True, "error": None}
    report = {"ok": False, "error": None, "device": "npu", "results": [row, {**row, "passed": False}]}
    status = {
        "version": "0.1.0",
        "device": "npu (torch_npu installed)",
        "configuration": {"enabled": True},
        "observer_installed": True,
        "distributions": {},
        "patches": [],
        "verify": report,
    }
    node = {"NodeID": "abcdef0123", "NodeManagerAddress": "10.0.0.2"}
    entry = ray_doctor.summarize(node, {"installed": True, "python": "/py", "status": status})
    assert ray_doctor.problems([entry], []) == [
        "node abcdef01 (10.0.0.2, python /py): doctor --verify: 1/2 checks passed on npu; "
        "MISMATCH: transformers.qwen3.rms_norm"
    ]


def test_auto_names_the_cluster_it_reached(runner_python: Path, cluster: Cluster) -> None:
    """``--ray`` alone (``auto``) with ``RAY_ADDRESS`` set: the first line names the address reached,
    how auto found it and the session, not "at auto" (issue 39); nothing on a stderr that is not a
    terminal."""
    command = [str(runner_python.parent / "verl-npu-autopatch"), "doctor", "--ray"]
    env = clean_env(RAY_ADDRESS=cluster.address)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 1 and proc.stderr == ""
    first = proc.stdout.splitlines()[0]
    assert first.startswith(
        f"verl-npu-autopatch doctor --ray: 2 alive node(s) in the Ray cluster at {cluster.address} "
        "(auto: RAY_ADDRESS), session session_"
    )
    proc = subprocess.run([*command, "--json"], env=env, capture_output=True, text=True, timeout=900, check=False)
    data = json.loads(proc.stdout)
    assert data["address"] == "auto" and data["cluster"]["address"] == cluster.address
    assert data["cluster"]["nodes"] == 2 and data["cluster"]["found_by"] == "RAY_ADDRESS"
    assert data["cluster"]["session"].startswith("session_") and data["cluster"]["others"] == []


def test_progress_goes_to_a_terminal_and_only_there(runner_python: Path, cluster: Cluster) -> None:
    """stderr a terminal (a pty): a progress line (nodes k/n), rewritten in place and cleared at the
    end; stdout (a pipe) holds only the report."""
    import os
    import pty
    import threading

    main, secondary = pty.openpty()
    said: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # EIO: the last writer closed the terminal
                return
            if not chunk:
                return
            said.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    # the CLI itself, with the progress line due at once (a quick cluster answers within the usual delay)
    code = (
        "import sys; from verl_npu_autopatch.cli import main as cli, summary; summary.PROGRESS_AFTER_S = 0; "
        f"sys.exit(cli.main(['doctor', '--ray', {cluster.address!r}, '--json']))"
    )
    command = [str(runner_python), "-c", code]
    try:
        proc = subprocess.run(
            command, env=clean_env(), stdout=subprocess.PIPE, stderr=secondary, text=True, timeout=900, check=False
        )
    finally:
        os.close(secondary)
        reader.join(10)
        os.close(main)
    text = b"".join(said).decode()
    assert json.loads(proc.stdout)["nodes"]  # the JSON whole: no progress in it
    assert "doctor --ray: " in text and "nodes answered" in text, text
    assert text.endswith("\r"), text  # the line cleared


def test_a_cluster_that_refuses_the_driver_is_one_line_saying_why(runner_python: Path, cluster: Cluster) -> None:
    """The test cluster has Ray's token authentication (Ray 2.60's default); a shell without
    ``RAY_AUTH_MODE=token`` cannot connect: one line with Ray's reason, nothing of its logging."""
    env = {k: v for k, v in clean_env().items() if k != "RAY_AUTH_MODE"}
    command = [str(runner_python.parent / "verl-npu-autopatch"), "doctor", "--ray", cluster.address, "--timeout", "60"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stderr == ""
    [line] = proc.stdout.splitlines()
    assert line.startswith(f"doctor --ray: cannot reach the Ray cluster at {cluster.address}: ConnectionError: ")
    assert "InvalidAuthToken: Authentication token is missing or incorrect" in line


def test_probe_cluster_from_a_connected_driver_uses_its_connection(cluster: Cluster) -> None:
    """Called from a process that is a Ray driver already (this test process: the head's
    ``ray.init``), the probes run from it, no child; the cluster and its nodes are named."""
    from verl_npu_autopatch.cli import ray_doctor

    data = ray_doctor.probe_cluster(cluster.address, None, "verl_npu_autopatch.cli.main:status_data", 300.0)
    assert {n["node_id"] for n in data["nodes"]} == {cluster.head_id, cluster.bare_id}
    assert data["cluster"]["address"] == cluster.address and data["cluster"]["nodes"] == 2
    assert [d["field"] for d in data["disagreements"]] == ["installed"]
