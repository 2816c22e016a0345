"""The patch contract (``tests/support/contract.py``) for every built-in patch of this suite: on the
real upstream modules where its target imports here (tensordict), else on every release its family's
registered loader (``tests/support/release_loaders.py``) loads; and no patch of the suite has neither."""

from __future__ import annotations

import types

import pytest

from tests.support import contract, release_loaders
from verl_npu_autopatch.authoring.spec import Patch, Target

LIVE = contract.live_patches()
LOADERS, FAMILIES = release_loaders.suite("tests.verl", globals())  # the loaders' fixtures put here
CASES = release_loaders.cases(FAMILIES, LOADERS)
#: The top-level packages whose patches are this suite's (a patch that also needs vLLM is tests/vllm's).
PACKAGES = {"verl", "megatron", "tensordict", "torch_npu"}


def ours(patch: Patch) -> bool:
    """Whether ``patch`` is this suite's concern: a target under :data:`PACKAGES`, no vLLM needed."""
    return "vllm" not in patch.groups and any(t.module.partition(".")[0] in PACKAGES for t in patch.targets)


@pytest.mark.parametrize("patch", LIVE, ids=lambda patch: patch.name)
def test_the_patch_keeps_its_contract(patch: Patch) -> None:
    contract.check_contract(patch)


def test_tensordict_sync_is_live_and_applies_on_tensordict_0_9_1() -> None:
    assert [(p.name, contract.check_contract(p).state) for p in LIVE] == [("tensordict.npu_sync", "applied")]


# One test per loader: test_the_patch_keeps_its_contract_on_<fixture>[<patch>-<release>].
globals().update(
    release_loaders.tests("test_the_patch_keeps_its_contract_on", release_loaders.keeps_the_contract, CASES)
)


def test_every_patch_of_the_suite_is_live_here_or_has_a_loader() -> None:
    assert release_loaders.uncovered(FAMILIES, ours, {p.name for p in LIVE}, LOADERS) == []
    assert {loader.family for loader in LOADERS} <= {name for name, _ in FAMILIES}  # no loader of a lost family


def test_a_new_family_with_neither_is_reported_until_it_registers_a_loader() -> None:
    """A synthetic megatron family: uncovered, then covered once a loader names it."""
    new = Patch(name="megatron.new", summary="", targets=(Target.parse("megatron.core.new:f"),), fix=lambda site: None)
    families = [*FAMILIES, ("megatron_new", [new])]
    assert release_loaders.uncovered(families, ours, {p.name for p in LIVE}, LOADERS) == ["megatron.new"]
    family = types.ModuleType("verl_npu_autopatch.patches.megatron_new")
    register = release_loaders.loads(family, "megatron-core", ("0.17.0",))
    before = list(release_loaders.REGISTRY)
    try:
        register(lambda: None)
        (added,) = [loader for loader in release_loaders.REGISTRY if loader not in before]
        assert (added.family, added.module) == ("megatron_new", __name__)
        assert release_loaders.uncovered(families, ours, {p.name for p in LIVE}, [*LOADERS, added]) == []
        cases = release_loaders.cases(families, [added])
        assert [(p.name, release) for p, _, release in cases] == [("megatron.new", "0.17.0")]
    finally:
        release_loaders.REGISTRY[:] = before
