"""docs/compatibility.md is the live truth for the verl suite's patches: on each release a registered
loader (``tests/support/release_loaders.py``) loads, the live decision (the contract's first decision,
through the engine's own pipeline) equals the static rule's cell on the same release's files, the tree
the decision table reads. The torch side of the patches whose check also reads torch's code: the live
decision on the installed torch (CPU 2.13.0), where the other project's code leaves the decision to
torch, equals torch's cell for that release (read from the macOS wheel the table reads, whose files
are the installed ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import contract, release_loaders, upstream
from tests.verl.helpers import release_root
from verl_npu_autopatch.authoring.fingerprints import UpstreamTree
from verl_npu_autopatch.authoring.spec import Patch
from verl_npu_autopatch.patches import megatron_async_save_format, torch_npu_nested_tensor_intercept

LOADERS, FAMILIES = release_loaders.suite("tests.verl", globals())  # the loaders' fixtures put here
#: Every (patch, loader, release) whose loader reads a release of the table (not a stand-in).
CASES = [case for case in release_loaders.cases(FAMILIES, LOADERS) if case[1].project is not None]


def test_every_release_loaded_is_a_column_of_the_table() -> None:
    script = upstream.matrix_script()
    columns = {(a.project, a.version) for a in script.RUNTIME_RELEASES}
    assert CASES and {(loader.project, release) for _, loader, release in CASES} <= columns


def equals_the_table_cell(
    request: pytest.FixtureRequest, patch: Patch, loader: release_loaders.Loader, release: str
) -> None:
    """The live decision on the loaded release is the static rule's cell on its files."""
    assert patch.static is not None and loader.project is not None
    cell = patch.static.decide(UpstreamTree((release_root(loader.project, release),), {loader.project: release}))
    (live,) = contract.live_patches([patch])
    assert contract.check_contract(live).state == release_loaders.STATES[cell.action], cell.reason


# One test per loader: test_the_live_decision_equals_the_table_cell_on_<fixture>[<patch>-<release>].
globals().update(release_loaders.tests("test_the_live_decision_equals_the_table_cell_on", equals_the_table_cell, CASES))


#: The installed torch's release (``2.13.0+cpu`` → ``2.13.0``): a column of torch's section.
TORCH = torch.__version__.partition("+")[0]


def torch_cell(patch: Patch) -> str:
    """The state of ``patch``'s torch rule (``StaticRule.also``) on the installed torch's release."""
    assert patch.static is not None
    (rule,) = patch.static.also
    return release_loaders.STATES[rule.decide(UpstreamTree((release_root("torch", TORCH),), {"torch": TORCH})).action]


def test_the_installed_torch_is_a_column_whose_files_the_table_reads() -> None:
    script = upstream.matrix_script()
    assert TORCH in [a.version for a in script.RUNTIME_RELEASES if a.project == "torch"]
    installed = Path(torch.__file__).parent.parent
    files = script.runtime_files("torch")
    assert set(files) == {"torch/distributed/checkpoint/filesystem.py", "torch/nested/__init__.py"}
    for name in files:  # the macOS wheel's pure-Python file is the Linux CPU wheel's, byte for byte
        assert (release_root("torch", TORCH) / name).read_bytes() == (installed / name).read_bytes(), name


def test_async_save_formats_torch_side_equals_torchs_cell(megatron_writer: Any) -> None:
    megatron_writer("0.12.1")  # its writer omits the argument: torch's _write_item decides
    (patch,) = megatron_async_save_format.PATCHES
    (live,) = contract.live_patches([patch])
    assert contract.check_contract(live).state == torch_cell(patch) == "applied"


def test_nested_intercepts_torch_side_equals_torchs_cell(
    torch_npu_standin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_TORCH_NPU_INTERCEPT", "0")  # as torch_npu 2.7.1.post11 on: torch.nested decides
    (patch,) = torch_npu_nested_tensor_intercept.PATCHES
    (live,) = contract.live_patches([patch])
    assert contract.check_contract(live).state == torch_cell(patch) == "fixed-upstream"
