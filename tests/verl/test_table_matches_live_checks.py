"""docs/compatibility.md is the live truth for the verl suite's patches: on each release these tests
load, the live decision (the contract's first decision, through the engine's own pipeline) equals
the static rule's cell on the same release's files, the tree the decision table reads."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from tests.support import contract
from tests.verl.helpers import release_root
from tests.verl.test_megatron_async_save_format import megatron_writer  # noqa: F401  (fixture)
from tests.verl.test_megatron_expert_bias_fp32 import megatron_release  # noqa: F401  (fixture)
from tests.verl.test_megatron_layer_offset import megatron_layers  # noqa: F401  (fixture)
from tests.verl.test_verl_checkpoint_send_reoffload import verl_workers  # noqa: F401  (fixture)
from tests.verl.test_verl_distillation_log_prob_floor import verl_losses  # noqa: F401  (fixture)
from tests.verl.test_verl_npu_version_probe import verl_device  # noqa: F401  (fixture)
from verl_npu_autopatch.patches import (
    megatron_async_save_format,
    megatron_expert_bias_fp32,
    megatron_layer_offset,
    verl_checkpoint_send_reoffload,
    verl_distillation_log_prob_floor,
    verl_npu_version_probe,
)
from verl_npu_autopatch.patches._fingerprints import UpstreamTree

#: family, the fixture loading its target from a release, the project, the releases it loads.
CASES: list[tuple[ModuleType, str, str, str]] = [
    *((megatron_expert_bias_fp32, "megatron_release", "megatron-core", v) for v in ("0.12.1", "0.16.1", "0.17.0")),
    *((megatron_layer_offset, "megatron_layers", "megatron-core", v) for v in ("0.12.1", "0.16.1", "0.17.0")),
    *((megatron_async_save_format, "megatron_writer", "megatron-core", v) for v in ("0.12.1", "0.13.1", "0.17.0")),
    *((verl_distillation_log_prob_floor, "verl_losses", "verl", v) for v in ("0.8.0", "0.9.0", "0.9.1")),
    *((verl_npu_version_probe, "verl_device", "verl", v) for v in ("0.8.0", "0.9.1")),
    *((verl_checkpoint_send_reoffload, "verl_workers", "verl", v) for v in ("0.8.0", "0.9.0", "0.9.1")),
]
STATES = {"apply": "applied", "fixed-upstream": "fixed-upstream", "unsupported": "unsupported"}


@pytest.mark.parametrize(
    ("family", "loader", "project", "version"), CASES, ids=lambda v: getattr(v, "__name__", str(v)).rsplit(".")[-1]
)
def test_the_live_decision_equals_the_table_cell(
    request: pytest.FixtureRequest, family: ModuleType, loader: str, project: str, version: str
) -> None:
    load: Any = request.getfixturevalue(loader)
    load(version)
    (patch,) = family.PATCHES
    assert patch.static is not None
    cell = patch.static.decide(UpstreamTree((release_root(project, version),), {project: version}))
    (live,) = contract.live_patches([patch])
    assert contract.check_contract(live).state == STATES[cell.action], cell.reason
