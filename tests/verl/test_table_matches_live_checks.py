"""docs/compatibility.md is the live truth for the verl suite's patches: on each release these tests
load, the live decision (the contract's first decision, through the engine's own pipeline) equals
the static rule's cell on the same release's files, the tree the decision table reads. The torch
side of the patches whose check also reads torch's code: the live decision on the installed torch
(CPU 2.13.0), where the other project's code leaves the decision to torch, equals torch's cell for
that release (read from the macOS wheel the table reads, whose files are the installed ones)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.support import contract, upstream
from tests.verl.helpers import release_root
from tests.verl.test_megatron_async_save_format import megatron_writer  # noqa: F401  (fixture)
from tests.verl.test_megatron_expert_bias_fp32 import megatron_release  # noqa: F401  (fixture)
from tests.verl.test_megatron_layer_offset import megatron_layers  # noqa: F401  (fixture)
from tests.verl.test_torch_npu_nested_tensor_intercept import standin, torch_npu_standin  # noqa: F401  (fixtures)
from tests.verl.test_verl_checkpoint_send_reoffload import verl_workers  # noqa: F401  (fixture)
from tests.verl.test_verl_distillation_log_prob_floor import verl_losses  # noqa: F401  (fixture)
from tests.verl.test_verl_npu_version_probe import verl_device  # noqa: F401  (fixture)
from verl_npu_autopatch.authoring.fingerprints import UpstreamTree
from verl_npu_autopatch.authoring.spec import Patch
from verl_npu_autopatch.patches import (
    megatron_async_save_format,
    megatron_expert_bias_fp32,
    megatron_layer_offset,
    torch_npu_nested_tensor_intercept,
    verl_checkpoint_send_reoffload,
    verl_distillation_log_prob_floor,
    verl_npu_version_probe,
)

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


#: The installed torch's release (``2.13.0+cpu`` → ``2.13.0``): a column of torch's section.
TORCH = torch.__version__.partition("+")[0]


def torch_cell(patch: Patch) -> str:
    """The state of ``patch``'s torch rule (``StaticRule.also``) on the installed torch's release."""
    assert patch.static is not None
    (rule,) = patch.static.also
    return STATES[rule.decide(UpstreamTree((release_root("torch", TORCH),), {"torch": TORCH})).action]


def test_the_installed_torch_is_a_column_whose_files_the_table_reads() -> None:
    script = upstream.matrix_script()
    assert TORCH in [a.version for a in script.RUNTIME_RELEASES if a.project == "torch"]
    installed = Path(torch.__file__).parent.parent
    files = script.runtime_files("torch")
    assert set(files) == {"torch/distributed/checkpoint/filesystem.py", "torch/nested/__init__.py"}
    for name in files:  # the macOS wheel's pure-Python file is the Linux CPU wheel's, byte for byte
        assert (release_root("torch", TORCH) / name).read_bytes() == (installed / name).read_bytes(), name


def test_async_save_formats_torch_side_equals_torchs_cell(megatron_writer: Any) -> None:  # noqa: F811
    megatron_writer("0.12.1")  # its writer omits the argument: torch's _write_item decides
    (patch,) = megatron_async_save_format.PATCHES
    (live,) = contract.live_patches([patch])
    assert contract.check_contract(live).state == torch_cell(patch) == "applied"


def test_nested_intercepts_torch_side_equals_torchs_cell(standin: None, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setenv("STANDIN_TORCH_NPU_INTERCEPT", "0")  # as torch_npu 2.7.1.post11 on: torch.nested decides
    (patch,) = torch_npu_nested_tensor_intercept.PATCHES
    (live,) = contract.live_patches([patch])
    assert contract.check_contract(live).state == torch_cell(patch) == "fixed-upstream"
