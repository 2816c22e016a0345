"""The package delivered by a Ray ``runtime_env={"pip": [<wheel>], "env_vars": {...}}``, seen from
inside real Ray workers on a local cluster (see ``conftest.py``).

Everything runs on the *bare* node, whose own Python lacks the package: so the observer, the
patches and the ``spawn`` child below can only come from the wheel the runtime_env installed.
The fixture packages (the fake ``vllm`` and the test-only plugin) reach the workers through
``env_vars`` ``PYTHONPATH``; the ``.pth`` itself comes from the runtime_env's site-packages.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tests.ray import ray_probe
from tests.support.children import FIXTURE_SITE, ROOT

if TYPE_CHECKING:
    from tests.ray.conftest import Cluster

#: What the workers need on PYTHONPATH: the fixture packages and ``tests.ray.ray_probe``.
WORKER_PATH = os.pathsep.join([str(FIXTURE_SITE), str(ROOT)])
NPU = {"VERL_NPU_AUTOPATCH_DEVICE": "npu"}
#: A worker's start-up hooks before the first watched import: a placeholder for each time ``site``
#: read the ``.pth`` (once, or twice in a venv: cpython#75723).
PLACEHOLDERS = (["placeholder"], ["placeholder", "placeholder"])


def runtime_env(wheel: Path | None, **env_vars: str) -> dict[str, Any]:
    env: dict[str, Any] = {"env_vars": {"PYTHONPATH": WORKER_PATH, **env_vars}}
    if wheel is not None:
        env["pip"] = [str(wheel)]
    return env


def on_bare_node(cluster: Cluster, function: Any, env: dict[str, Any]) -> dict[str, Any]:
    """Run ``function`` in a fresh worker on the bare node inside ``env``."""
    task = ray.remote(num_cpus=0, max_calls=1)(function)
    pinned = NodeAffinitySchedulingStrategy(cluster.bare_id, soft=False)
    return ray.get(task.options(scheduling_strategy=pinned, runtime_env=env).remote(), timeout=600)


def runtime_venv(cluster: Cluster, seen: dict[str, Any]) -> Path:
    """The worker's venv, checked to be a pip runtime_env built on the bare node."""
    prefix = Path(seen["prefix"])
    assert prefix.is_relative_to(cluster.bare_temp), prefix
    assert "/runtime_resources/pip/" in prefix.as_posix()
    assert Path(seen["executable"]).parent == prefix / "bin"
    return prefix


def test_the_bare_node_python_lacks_the_package(cluster: Cluster) -> None:
    seen = on_bare_node(cluster, ray_probe.startup, runtime_env(None, **NPU))
    assert Path(seen["prefix"]) == cluster.bare_prefix
    assert seen["package_file"] is None
    assert seen["hooks"] == [] and seen["startup_loaded"] is False


def test_runtime_env_wheel_installs_the_observer_in_workers(cluster: Cluster, wheel: Path) -> None:
    seen = on_bare_node(cluster, ray_probe.startup, runtime_env(wheel, **NPU))
    venv = runtime_venv(cluster, seen)
    assert seen["hooks"] in PLACEHOLDERS and seen["startup_loaded"] is False  # nothing imported yet
    assert Path(seen["package_file"]).is_relative_to(venv)
    assert seen["installed_from"] == wheel.as_uri()  # pip's direct_url.json: installed from that file
    assert seen["pytest_findable"] is False  # the venv is a clone of the bare node's env, not the runner's
    assert seen["environ"] == {"VERL_NPU_AUTOPATCH_DEVICE": "npu"}


def test_watched_import_applies_the_patches_with_npu_forced_by_env_vars(cluster: Cluster, wheel: Path) -> None:
    seen = on_bare_node(cluster, ray_probe.watched_import, runtime_env(wheel, **NPU))
    runtime_venv(cluster, seen["startup"])
    assert seen["startup"]["hooks"] in PLACEHOLDERS
    assert (seen["status"], seen["device"]) == ("active", "npu (forced)")
    assert seen["states"]["fixture.forward"] == "applied"
    assert seen["forward"] == 12  # upstream x + 1, plus ten
    assert seen["observer"] == "watching"  # activation over: it stays only for re-executions of patched modules


def test_without_env_vars_a_cpu_worker_stays_inactive(cluster: Cluster, wheel: Path) -> None:
    seen = on_bare_node(cluster, ray_probe.watched_import, runtime_env(wheel))
    assert seen["startup"]["hooks"] in PLACEHOLDERS
    assert seen["status"] == "inactive"
    assert seen["forward"] == 2


def test_master_switch_in_env_vars_turns_it_off_in_workers(cluster: Cluster, wheel: Path) -> None:
    seen = on_bare_node(cluster, ray_probe.watched_import, runtime_env(wheel, VERL_NPU_AUTOPATCH="0", **NPU))
    venv = runtime_venv(cluster, seen["startup"])
    assert Path(seen["startup"]["package_file"]).is_relative_to(venv)  # installed, but switched off
    assert seen["startup"]["hooks"] in PLACEHOLDERS  # it reads the switch at the first watched import
    assert seen["status"] == "inactive" and seen["states"] == {}  # report(): "switched off by VERL_NPU_AUTOPATCH"
    assert seen["forward"] == 2


def test_spawn_child_of_an_actor_is_patched(cluster: Cluster, wheel: Path) -> None:
    actor_class = ray.remote(num_cpus=0)(ray_probe.SpawningActor)
    pinned = NodeAffinitySchedulingStrategy(cluster.bare_id, soft=False)
    actor = actor_class.options(scheduling_strategy=pinned, runtime_env=runtime_env(wheel, **NPU)).remote()
    try:
        seen = ray.get(actor.run.remote(), timeout=600)
    finally:
        ray.kill(actor)
    actor_side, child = seen["actor"], seen["child"]
    venv = runtime_venv(cluster, seen["actor_start"])
    assert seen["actor_start"]["hooks"] in PLACEHOLDERS
    assert actor_side["states"]["fixture.forward"] == "applied" and actor_side["forward"] == 12
    # the child is a fresh interpreter of the runtime_env (not a fork): its own start-up hook ran
    assert child["pid"] != actor_side["pid"] and seen["child_exitcode"] == 0
    assert child["startup"]["executable"] == str(venv / "bin" / "python")
    assert child["startup"]["hooks"] in PLACEHOLDERS
    assert child["states"]["fixture.forward"] == "applied"
    assert child["forward"] == 12
