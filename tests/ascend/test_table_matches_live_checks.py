"""docs/compatibility.md is the live truth for the suite's patches: on every release a registered
loader (``tests/support/release_loaders.py``) loads, a column of the decision table (a vllm-ascend
release and its paired vLLM), the live decision (the contract's first decision, through the
engine's pipeline) equals the static rule's cell on the same release's files."""

from __future__ import annotations

import pytest

from tests.support import contract, release_loaders, upstream
from verl_npu_autopatch.authoring.fingerprints import UpstreamTree
from verl_npu_autopatch.authoring.spec import Patch

LOADERS, FAMILIES = release_loaders.suite("tests.ascend", globals())  # the loaders' fixtures put here
#: Every (patch, loader, release) whose loader reads a release of the table (not a stand-in).
CASES = [case for case in release_loaders.cases(FAMILIES, LOADERS) if case[1].project is not None]


def test_every_release_loaded_is_a_column_of_the_table() -> None:
    labels = {release.label for release in upstream.matrix_script().RELEASES}
    assert CASES and {(loader.project, release) for _, loader, release in CASES} <= {("vllm-ascend", x) for x in labels}


def equals_the_table_cell(
    request: pytest.FixtureRequest, patch: Patch, loader: release_loaders.Loader, release: str
) -> None:
    """The live decision on the loaded release is the static rule's cell on its column's files."""
    (column,) = [r for r in upstream.matrix_script().RELEASES if r.label == release]
    roots = request.getfixturevalue("releases")[release]
    assert patch.static is not None
    cell = patch.static.decide(UpstreamTree(roots, {"vllm-ascend": column.ascend.version, "vllm": column.vllm.version}))
    (live,) = contract.live_patches([patch])
    assert contract.check_contract(live).state == release_loaders.STATES[cell.action], cell.reason


# One test per loader: test_the_live_decision_equals_the_table_cell_on_<fixture>[<patch>-<release>].
globals().update(release_loaders.tests("test_the_live_decision_equals_the_table_cell_on", equals_the_table_cell, CASES))
