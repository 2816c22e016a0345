"""The patch contract (``tests/support/contract.py``) for the patches of vllm-ascend and of vLLM
releases other than the installed one: their targets cannot be installed here, so it runs on every
release its family's registered loader (``tests/support/release_loaders.py``) loads from the
release's own files; and no such patch is neither live here nor registered."""

from __future__ import annotations

import types

import pytest

from tests.support import contract, release_loaders
from verl_npu_autopatch.authoring.spec import Patch, Target

LIVE = {patch.name for patch in contract.live_patches()}
LOADERS, FAMILIES = release_loaders.suite("tests.ascend", globals())  # the loaders' fixtures put here
CASES = release_loaders.cases(FAMILIES, LOADERS)
#: The top-level packages whose patches are this suite's, with every patch of the ``ascend`` group.
PACKAGES = {"vllm_ascend", "vllm"}


def ours(patch: Patch) -> bool:
    """Whether ``patch`` is this suite's concern: vllm-ascend's, or a target under :data:`PACKAGES`."""
    return "ascend" in patch.groups or any(t.module.partition(".")[0] in PACKAGES for t in patch.targets)


# One test per loader: test_the_patch_keeps_its_contract_on_<fixture>[<patch>-<release>].
globals().update(
    release_loaders.tests("test_the_patch_keeps_its_contract_on", release_loaders.keeps_the_contract, CASES)
)


def test_every_patch_of_the_suite_is_live_here_or_has_a_loader() -> None:
    assert release_loaders.uncovered(FAMILIES, ours, LIVE, LOADERS) == []
    assert {loader.family for loader in LOADERS} <= {name for name, _ in FAMILIES}  # no loader of a lost family
    assert all(loader.param for loader in LOADERS)  # each loads the release its request.param names


def test_a_new_family_with_neither_is_reported_until_it_registers_a_loader() -> None:
    """Two synthetic families, vllm-ascend's and one of a vLLM module the installed vLLM lacks: both
    uncovered; vllm-ascend's covered once a loader names it, with one generated test per loader."""
    new = Patch(name="ascend.new", summary="", targets=(Target.parse("vllm_ascend.new:f"),), fix=lambda site: None)
    gone = Patch(name="vllm.gone", summary="", targets=(Target.parse("vllm.gone:f"),), fix=lambda site: None)
    families = [*FAMILIES, ("ascend_new", [new]), ("vllm_gone", [gone])]
    assert release_loaders.uncovered(families, ours, LIVE, LOADERS) == ["ascend.new", "vllm.gone"]
    family = types.ModuleType("verl_npu_autopatch.patches.ascend_new")
    family.PATCHES = [new]  # type: ignore[attr-defined]
    register = release_loaders.loads(family, "vllm-ascend", ("0.23.0", "0.30.0rc2"), {"0.23.0": {"x:f"}}, param=True)
    before = list(release_loaders.REGISTRY)
    try:

        def new_module(request: pytest.FixtureRequest) -> None: ...

        register(new_module)
        (added,) = [loader for loader in release_loaders.REGISTRY if loader not in before]
        assert (added.family, added.module, added.exact(new, "0.23.0")) == ("ascend_new", __name__, {"x:f"})
        assert release_loaders.uncovered(families, ours, LIVE, [*LOADERS, added]) == ["vllm.gone"]
        generated = release_loaders.tests(
            "test_x_on", release_loaders.keeps_the_contract, release_loaders.cases(families, [added])
        )
        (mark,) = [m for m in generated["test_x_on_new_module"].pytestmark if m.name == "parametrize"]
        assert list(generated) == ["test_x_on_new_module"]
        assert mark.args == (("patch", "new_module"), [(new, "0.23.0"), (new, "0.30.0rc2")])
        assert mark.kwargs["indirect"] == ["new_module"]
    finally:
        release_loaders.REGISTRY[:] = before
