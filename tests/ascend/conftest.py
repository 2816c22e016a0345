"""Fixtures for the vllm-ascend / vLLM patch tests: downloaded releases and CPU test doubles."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import tiers

tiers.require(__file__)  # before importing what this environment may lack

from tests.ascend import doubles  # noqa: E402
from tests.support import upstream  # noqa: E402
from verl_npu_autopatch.engine import lifecycle as process_engine  # noqa: E402

# The process-wide engine (installed by the .pth) must decide "inactive" now, before any test
# double named torch_npu appears in sys.modules; tests use their own Engine instances.
process_engine.activate("tests/ascend")
assert process_engine.report().status == "inactive", process_engine.report().reason


def _preload_vllm() -> None:
    """Import (and configure once) the vLLM / transformers parts the tests use, before any test
    double named torch_npu exists: their import-time probes must see the real CPU host."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import layernorm, linear  # noqa: F401

    with set_current_vllm_config(VllmConfig()):
        layernorm.RMSNorm(8)


_preload_vllm()


@pytest.fixture(scope="session")
def releases() -> dict[str, tuple[Path, Path]]:
    """Every release of the decision table: label → (vllm-ascend source root, vLLM source root),
    downloaded and extracted by ``scripts/compat-matrix``'s own code (cached in .cache/upstream)."""
    script = upstream.matrix_script()
    found = {}
    for release in script.RELEASES:
        try:
            found[release.label] = script.fetch_release(release)
        except OSError as exc:  # only when PyPI truly cannot be reached
            pytest.skip(f"cannot download {release.ascend.filename} / {release.vllm.filename} from PyPI: {exc}")
    return found


@pytest.fixture
def npu() -> Iterator[None]:
    """The torch_npu / torch.npu / acl.rt test doubles, installed for one test."""
    with doubles.installed():
        yield


@pytest.fixture(params=["0.23.0", "0.23.0.post1"])
def layernorm(request: pytest.FixtureRequest, releases: dict, npu: None) -> Iterator[ModuleType]:
    """The release's layernorm.py (0.23.0 and 0.23.0.post1), with the torch_npu doubles and the
    ``maybe_chunk_residual`` double registered."""
    doubles.register_maybe_chunk_residual()
    yield from doubles.load_layernorm(releases[request.param][0])
