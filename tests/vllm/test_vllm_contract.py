"""The patch contract (``tests/support/contract.py``) for every built-in patch whose target imports
in this suite's environment, on the real upstream modules."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import contract, verl_upstream
from tests.vllm.test_verl_vllm_coexistence import common, verl, verl_root  # noqa: F401  (fixtures)
from verl_npu_autopatch.authoring.spec import Patch
from verl_npu_autopatch.patches import verl_defer_duplicates

LIVE = contract.live_patches()


@pytest.mark.parametrize("patch", LIVE, ids=lambda patch: patch.name)
def test_the_patch_keeps_its_contract(patch: Patch) -> None:
    contract.check_contract(patch)


def test_what_each_vllm_patch_decides_on_this_vllm() -> None:
    """vLLM 0.32 ships the rotary guard and the partial wake-up fix, and no RoutedExpertsManager
    any more (its capture path stores no padding row); the MoE weight loader applies."""
    decided = {p.name: contract.check_contract(p).state for p in LIVE if "vllm" in p.groups}
    assert decided == {
        "vllm.moe_weight_loader": "applied",
        "vllm.rotary_flash_attn_guard": "fixed-upstream",
        "vllm.engine_partial_wake_up": "fixed-upstream",
        "vllm.routed_experts_padding_slots": "fixed-upstream",
    }


def test_verl_defer_duplicates_on_verl_0_9_1(verl: Any) -> None:  # noqa: F811  (the fixture)
    """verl's own ``npu_vllm_patch`` module (release 0.9.1) imported, its ``apply_npu_vllm_patches`` not run."""
    module = verl_upstream.patch_module()
    (patch,) = contract.live_patches(verl_defer_duplicates.PATCHES)
    finding = contract.check_contract(patch)
    assert (finding.state, finding.changed) == ("applied", {f"{module.__name__}:patch_vllm013_rotary_emb"})
