"""The start-up observer watches the top-level package of every built-in patch target."""

from __future__ import annotations

from verl_npu_autopatch import _startup as startup
from verl_npu_autopatch import catalog


def test_every_builtin_target_is_under_a_watched_package() -> None:
    tops = {target.module.partition(".")[0] for patch in catalog.builtin() for target in patch.targets}
    assert tops - startup.WATCHED == set()
    assert {"tensordict", "torch_npu", "megatron"} <= tops


def test_the_miss_path_is_one_frozenset_lookup() -> None:
    assert type(startup.WATCHED) is frozenset
    assert startup.observe("json") is None and startup.observe("torch") is None
    assert startup.find_spec is startup.observe  # observing, not guarding, in this process
