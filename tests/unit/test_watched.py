"""The start-up observer watches the top-level package of every place a built-in patch touches,
and the built-in families are exactly the public modules found in ``patches/``."""

from __future__ import annotations

from pathlib import Path

from verl_npu_autopatch import patches
from verl_npu_autopatch.bootstrap import startup
from verl_npu_autopatch.engine import catalog


def test_every_builtin_site_is_under_a_watched_package() -> None:
    touched = [target for patch in catalog.builtin() for target in patch.touches()]
    computed = [sites.module for patch in catalog.builtin() for sites in patch.reach.computed]
    tops = {module.partition(".")[0] for module in [*(target.module for target in touched), *computed]}
    assert "liger_kernel.transformers.monkey_patch" in computed
    assert tops - startup.WATCHED == set()
    assert {"tensordict", "torch_npu", "megatron", "vllm_ascend"} <= tops
    # triggers and secondary sites are covered too, not only targets
    assert {str(t) for t in touched} >= {
        "vllm_ascend.patch.worker:__file__",
        "vllm.v1.engine.core:DPEngineCoreProc.execute_dummy_batch",
    }


def test_the_catalog_holds_every_public_module_of_patches_and_no_helper() -> None:
    folder = Path(patches.__file__).parent  # a family is a public module or subpackage of patches/
    on_disk = {p.stem for p in folder.glob("*.py")} | {p.parent.name for p in folder.glob("*/__init__.py")}
    on_disk = {name for name in on_disk if not name.startswith("_")}
    found = [m.__name__.rpartition(".")[2] for m in catalog.families()]
    assert set(found) == on_disk and len(found) == len(on_disk)
    assert not any(name.startswith("_") for name in found)


def test_the_miss_path_is_one_frozenset_lookup() -> None:
    assert type(startup.WATCHED) is frozenset
    assert startup.OBSERVER.find_spec("json") is None and startup.OBSERVER.find_spec("torch") is None
    assert startup.OBSERVER.mode != "guarding"  # no activation under way in this process
