"""The patch contract (``tests/support/contract.py``) for every built-in patch whose target imports
in this suite's environment, on the real upstream modules; and for the verl patches that need vLLM,
on every release their registered loader (``tests/support/release_loaders.py``) loads."""

from __future__ import annotations

import pytest

from tests.support import contract, release_loaders
from tests.vllm.test_verl_vllm_coexistence import common, verl_root  # noqa: F401  (fixtures the verl loader uses)
from verl_npu_autopatch.authoring.spec import Patch

LIVE = contract.live_patches()
LOADERS, FAMILIES = release_loaders.suite("tests.vllm", globals())  # the loaders' fixtures put here
#: The top-level packages of the verl patches this suite covers (those the verl suite leaves to it).
PACKAGES = {"verl", "megatron", "tensordict", "torch_npu"}


def ours(patch: Patch) -> bool:
    """Whether ``patch`` is this suite's concern: a verl-side patch that needs vLLM."""
    return "vllm" in patch.groups and any(t.module.partition(".")[0] in PACKAGES for t in patch.targets)


@pytest.mark.parametrize("patch", LIVE, ids=lambda patch: patch.name)
def test_the_patch_keeps_its_contract(patch: Patch) -> None:
    contract.check_contract(patch)


# One test per loader: test_the_patch_keeps_its_contract_on_<fixture>[<patch>-<release>].
globals().update(
    release_loaders.tests(
        "test_the_patch_keeps_its_contract_on",
        release_loaders.keeps_the_contract,
        release_loaders.cases(FAMILIES, LOADERS),
    )
)


def test_every_verl_patch_needing_vllm_is_live_here_or_has_a_loader() -> None:
    assert [name for name, patches in FAMILIES for p in patches if ours(p)]  # the concern is not empty
    assert release_loaders.uncovered(FAMILIES, ours, {p.name for p in LIVE}, LOADERS) == []


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
