"""The start-up observer watches the top-level package of every built-in patch target."""

from __future__ import annotations

import verl_npu_autopatch
from verl_npu_autopatch import catalog


def test_every_builtin_target_is_under_a_watched_package() -> None:
    tops = {target.module.partition(".")[0] for patch in catalog.builtin() for target in patch.targets}
    assert tops - verl_npu_autopatch.WATCHED == set()
    assert {"tensordict", "torch_npu", "megatron"} <= tops


def test_the_miss_path_is_one_frozenset_lookup() -> None:
    observer = verl_npu_autopatch.Observer()
    assert type(observer.watched) is frozenset
    assert observer.find_spec("json") is None and observer.find_spec("torch") is None
