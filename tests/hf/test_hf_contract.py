"""The patch contract (``tests/support/contract.py``) for every built-in patch whose target imports
in this suite's environment, on the real upstream modules."""

from __future__ import annotations

import dataclasses

import pytest

from tests.support import contract
from verl_npu_autopatch import catalog
from verl_npu_autopatch.patches import liger
from verl_npu_autopatch.spec import Patch

LIVE = contract.live_patches()


@pytest.mark.parametrize("patch", LIVE, ids=lambda patch: patch.name)
def test_the_patch_keeps_its_contract(patch: Patch) -> None:
    contract.check_contract(patch)


def test_every_transformers_and_liger_patch_is_live_here() -> None:
    assert {p.name for p in LIVE} == {p.name for p in catalog.builtin() if "transformers" in p.groups}


def test_liger_declares_every_attribute_it_rebinds() -> None:
    """Liger's arbitration rebinds, besides its target, ``_apply_liger_kernel`` and, found in the
    live module, the apply function of each of our families and each dispatch-table entry
    holding one; without that declaration the contract fails."""
    (patch,) = liger.PATCHES
    finding = contract.check_contract(patch)
    computed = {site for site in finding.changed if "apply_liger_kernel_to_" in site or liger.TABLE in site}
    assert finding.state == "applied" and len(computed) == 24, sorted(finding.changed)
    assert finding.changed == {str(patch.targets[0]), str(patch.secondary[0]), *computed}
    with pytest.raises(AssertionError, match="changed"):
        contract.check_contract(dataclasses.replace(patch, computed=()))
