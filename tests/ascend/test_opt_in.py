"""The GLM-5.2 set is opt-in: off by default, on through either variable, through a real engine."""

from __future__ import annotations

import pytest

from tests.support import upstream
from verl_npu_autopatch.engine import catalog
from verl_npu_autopatch.patches import (
    ascend_camem_sleep_sync,
    ascend_glm52,
    ascend_routed_experts_capture,
    vllm_engine_partial_wake_up,
)

OURS = [
    *ascend_glm52.PATCHES,
    *ascend_camem_sleep_sync.PATCHES,
    *ascend_routed_experts_capture.PATCHES,
    *vllm_engine_partial_wake_up.PATCHES,
]
NAMES = {p.name for p in OURS}


def test_families_are_in_the_catalog():
    assert {ascend_glm52, ascend_camem_sleep_sync, ascend_routed_experts_capture, vllm_engine_partial_wake_up} <= set(
        catalog.families()
    )
    assert {p.name for p in catalog.builtin()} >= NAMES
    assert all(not p.default and "glm52" in p.groups for p in OURS)


@pytest.mark.parametrize(
    ("env", "off"),
    [
        ({}, NAMES),
        ({"VERL_NPU_AUTOPATCH_ENABLE": "glm52"}, set()),
        ({"VERL_VLLM_ASCEND_GLM52_PATCH": "1"}, set()),
        ({"VERL_VLLM_ASCEND_GLM52_PATCH": "true"}, set()),
        ({"VERL_VLLM_ASCEND_GLM52_PATCH": "0"}, NAMES),
        (
            {"VERL_NPU_AUTOPATCH_ENABLE": "glm52", "VERL_NPU_AUTOPATCH_DISABLE": "ascend"},
            NAMES - {"vllm.engine_partial_wake_up"},
        ),
        ({"VERL_NPU_AUTOPATCH_ENABLE": "ascend.camem_sleep_sync"}, NAMES - {"ascend.camem_sleep_sync"}),
    ],
)
def test_opt_in(env, off):
    states = upstream.run_engine(OURS, **env).report().states()
    assert {name for name, state in states.items() if state == "disabled"} == off
