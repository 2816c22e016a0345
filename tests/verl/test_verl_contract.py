"""The patch contract (``tests/support/contract.py``) for every built-in patch whose target imports
in this suite's environment, on the real upstream modules."""

from __future__ import annotations

import pytest

from tests.support import contract
from verl_npu_autopatch.spec import Patch

LIVE = contract.live_patches()


@pytest.mark.parametrize("patch", LIVE, ids=lambda patch: patch.name)
def test_the_patch_keeps_its_contract(patch: Patch) -> None:
    contract.check_contract(patch)


def test_tensordict_sync_is_live_and_applies_on_tensordict_0_9_1() -> None:
    assert [(p.name, contract.check_contract(p).state) for p in LIVE] == [("tensordict.npu_sync", "applied")]
