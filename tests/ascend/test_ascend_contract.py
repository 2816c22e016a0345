"""The patch contract (``tests/support/contract.py``) for the patches whose targets are vllm-ascend
or a vLLM release other than the installed one: their modules cannot be installed here, so the
release's own files are loaded (with the CPU doubles) by the fixtures of their tests, and the
contract runs on those modules as on imported ones."""

from __future__ import annotations

import types
from typing import Any

import pytest

from tests.ascend.test_ascend_310p_sampler_record_stream import sampler_310p  # noqa: F401  (fixture)
from tests.ascend.test_ascend_attention_buffers_keep_mapped import camem_buffers  # noqa: F401  (fixture)
from tests.ascend.test_ascend_camem_sleep_sync import camem_023  # noqa: F401  (fixture)
from tests.ascend.test_ascend_dispatcher_expert_ids_sleep import dispatching  # noqa: F401  (fixture)
from tests.ascend.test_ascend_dsv4_dummy_tid2eid import dsv4_moe  # noqa: F401  (fixture)
from tests.ascend.test_ascend_dsv4_dummy_wo_a import loading  # noqa: F401  (fixture)
from tests.ascend.test_ascend_dsv4_rope_plain_swa import rope  # noqa: F401  (fixture)
from tests.ascend.test_ascend_fused_moe_copies import moe  # noqa: F401  (fixture)
from tests.ascend.test_ascend_gate_fp32_in_place import linear  # noqa: F401  (fixture)
from tests.ascend.test_ascend_mooncake_aborted_receive import connector  # noqa: F401  (fixture)
from tests.ascend.test_ascend_mooncake_hybrid_send_counts import hybrid  # noqa: F401  (fixture)
from tests.ascend.test_ascend_mooncake_sleep_reregister import sleeping  # noqa: F401  (fixture)
from tests.ascend.test_ascend_mooncake_truncate_rehash import truncating  # noqa: F401  (fixture)
from tests.ascend.test_ascend_mxfp8_reload_in_place import mxfp8  # noqa: F401  (fixture)
from tests.ascend.test_ascend_routed_experts_capture import release  # noqa: F401  (fixture)
from tests.ascend.test_ascend_routed_experts_dp_padding_trim import paired  # noqa: F401  (fixture)
from tests.ascend.test_ascend_sampler_record_stream import sampler  # noqa: F401  (fixture)
from tests.ascend.test_ascend_wake_expert_layout import waking  # noqa: F401  (fixture)
from tests.ascend.test_verl_ascend_coexistence import glm  # noqa: F401  (fixture)
from tests.ascend.test_vllm_engine_partial_wake_up import core_023  # noqa: F401  (fixture)
from tests.ascend.test_vllm_routed_experts_padding_slots import capturer  # noqa: F401  (fixture)
from tests.support import contract
from verl_npu_autopatch.patches import (
    ascend_310p_sampler_record_stream,
    ascend_attention_buffers_keep_mapped,
    ascend_camem_sleep_sync,
    ascend_dispatcher_expert_ids_sleep,
    ascend_dsv4_dummy_tid2eid,
    ascend_dsv4_dummy_wo_a,
    ascend_dsv4_rope_plain_swa,
    ascend_fused_moe_copies,
    ascend_gate_fp32_in_place,
    ascend_glm52,
    ascend_mooncake_aborted_receive,
    ascend_mooncake_hybrid_send_counts,
    ascend_mooncake_sleep_reregister,
    ascend_mooncake_truncate_rehash,
    ascend_mxfp8_reload_in_place,
    ascend_routed_experts_capture,
    ascend_routed_experts_dp_padding_trim,
    ascend_sampler_record_stream,
    ascend_wake_expert_layout,
    vllm_engine_partial_wake_up,
    vllm_routed_experts_padding_slots,
)


def _applied(patches: list[Any]) -> dict[str, set[str]]:
    live = contract.live_patches(patches)
    assert [p.name for p in live] == [p.name for p in patches]  # the fixture made every target importable
    return {p.name: contract.check_contract(p).changed for p in live}


def test_camem_on_vllm_ascend_0_23(camem_023: types.ModuleType) -> None:  # noqa: F811  (the fixture)
    assert _applied(ascend_camem_sleep_sync.PATCHES) == {
        "ascend.camem_sleep_sync": {"vllm_ascend.device_allocator.camem:CaMemAllocator.sleep"}
    }


def test_partial_wake_up_on_vllm_0_23_changes_its_target_and_its_secondary_site(core_023: types.ModuleType) -> None:  # noqa: F811
    core = "vllm.v1.engine.core"
    assert _applied(vllm_engine_partial_wake_up.PATCHES) == {
        "vllm.engine_partial_wake_up": {f"{core}:EngineCore.wake_up", f"{core}:DPEngineCoreProc.execute_dummy_batch"}
    }


@pytest.mark.parametrize("patch", ascend_glm52.PATCHES, ids=lambda patch: patch.name)
def test_glm52_on_vllm_ascend_0_23(glm: types.SimpleNamespace, patch: Any) -> None:  # noqa: F811
    changed = _applied([patch])[patch.name]
    declared = {str(t) for t in (*patch.targets, *patch.reach.secondary)}
    assert changed and changed <= declared, changed


@pytest.mark.parametrize("sampler", ["0.23.0", "0.25.1rc1"], indirect=True)
def test_sampler_record_stream(sampler: types.ModuleType) -> None:  # noqa: F811
    assert _applied(ascend_sampler_record_stream.PATCHES) == {
        "ascend.sampler_record_stream": {f"{ascend_sampler_record_stream.SAMPLER}:random_sample"}
    }


@pytest.mark.parametrize("sampler_310p", ["0.18.0", "0.25.1rc1", "0.30.0rc2"], indirect=True)
def test_310p_sampler_record_stream(sampler_310p: types.ModuleType) -> None:  # noqa: F811
    assert _applied(ascend_310p_sampler_record_stream.PATCHES) == {
        "ascend.310p_sampler_record_stream": {f"{ascend_310p_sampler_record_stream.SAMPLER}:_random_sample_310p"}
    }


@pytest.mark.parametrize("connector", ["0.23.0", "0.30.0rc2"], indirect=True)
def test_mooncake_aborted_receive(connector: types.ModuleType) -> None:  # noqa: F811
    method = f"{connector.__name__}:MooncakeConnectorScheduler.request_finished"
    assert _applied(ascend_mooncake_aborted_receive.PATCHES) == {"ascend.mooncake_aborted_receive": {method}}


@pytest.mark.parametrize("truncating", ["0.23.0", "0.30.0rc2"], indirect=True)
def test_mooncake_truncate_rehash(truncating: types.ModuleType) -> None:  # noqa: F811
    method = f"{truncating.__name__}:MooncakeConnectorScheduler._truncate_request_for_prefill"
    assert _applied(ascend_mooncake_truncate_rehash.PATCHES) == {"ascend.mooncake_truncate_rehash": {method}}


@pytest.mark.parametrize("hybrid", ["0.21.0rc1", "0.30.0rc2"], indirect=True)
def test_mooncake_hybrid_send_counts_changes_its_target_and_its_secondary_site(hybrid: types.ModuleType) -> None:  # noqa: F811
    name = hybrid.__name__
    assert _applied(ascend_mooncake_hybrid_send_counts.PATCHES) == {
        "ascend.mooncake_hybrid_send_counts": {
            f"{name}:MooncakeConnectorWorker.start_load_kv",
            f"{name}:KVCacheRecvingThread.add_request",
        }
    }


@pytest.mark.parametrize("sleeping", ["0.18.0", "0.30.0rc2"], indirect=True)
def test_mooncake_sleep_reregister_changes_the_worker_and_the_transfer_engine(sleeping: types.SimpleNamespace) -> None:  # noqa: F811
    worker, engine = ascend_mooncake_sleep_reregister.WORKER, ascend_mooncake_sleep_reregister.ENGINE
    assert _applied(ascend_mooncake_sleep_reregister.PATCHES) == {
        "ascend.mooncake_sleep_reregister": {
            f"{worker}:NPUWorker.sleep",
            f"{worker}:NPUWorker.wake_up",
            f"{engine}:GlobalTE.register_buffer",
        }
    }


@pytest.mark.parametrize("dispatching", ["0.23.0.post1", "0.26.0rc1"], indirect=True)
def test_dispatcher_expert_ids_sleep_changes_the_dispatcher_and_camem(dispatching: types.SimpleNamespace) -> None:  # noqa: F811
    family = ascend_dispatcher_expert_ids_sleep
    assert _applied(family.PATCHES) == {
        "ascend.dispatcher_expert_ids_sleep": {
            f"{family.DISPATCHER}:TokenDispatcherWithAll2AllV.__init__",
            f"{family.CAMEM}:CaMemAllocator.wake_up",
        }
    }


@pytest.mark.parametrize("waking", ["0.13.0", "0.25.1rc1"], indirect=True)
def test_wake_expert_layout(waking: types.SimpleNamespace) -> None:  # noqa: F811
    target = f"{ascend_wake_expert_layout.WORKER}:NPUWorker.wake_up"
    assert _applied(ascend_wake_expert_layout.PATCHES) == {"ascend.wake_expert_layout": {target}}


@pytest.mark.parametrize("mxfp8", ["0.23.0", "0.25.1rc1"], indirect=True)
def test_mxfp8_reload_in_place(mxfp8: types.SimpleNamespace) -> None:  # noqa: F811
    target = f"{ascend_mxfp8_reload_in_place.MXFP8}:{ascend_mxfp8_reload_in_place.METHOD}"
    assert _applied(ascend_mxfp8_reload_in_place.PATCHES) == {"ascend.mxfp8_reload_in_place": {target}}


@pytest.mark.parametrize("linear", ["0.23.0", "0.27.1rc1"], indirect=True)
def test_gate_fp32_in_place(linear: types.ModuleType) -> None:  # noqa: F811
    method = f"{linear.__name__}:AscendUnquantizedLinearMethod.process_weights_after_loading"
    assert _applied(ascend_gate_fp32_in_place.PATCHES) == {"ascend.gate_fp32_in_place": {method}}


@pytest.mark.parametrize("rope", ["0.23.0", "0.30.0rc2"], indirect=True)
def test_dsv4_rope_plain_swa(rope: types.ModuleType) -> None:  # noqa: F811
    init = f"{ascend_dsv4_rope_plain_swa.MODULE}:{ascend_dsv4_rope_plain_swa.METHOD}"
    assert _applied(ascend_dsv4_rope_plain_swa.PATCHES) == {"ascend.dsv4_rope_plain_swa": {init}}


@pytest.mark.parametrize("capturer", ["0.23.0", "0.30.0rc2"], indirect=True)
def test_routed_experts_padding_slots(capturer: types.ModuleType) -> None:  # noqa: F811
    assert _applied(vllm_routed_experts_padding_slots.PATCHES) == {
        "vllm.routed_experts_padding_slots": {f"{capturer.__name__}:RoutedExpertsManager.store_batch"}
    }


@pytest.mark.parametrize("release", ["0.23.0"], indirect=True)
def test_routed_experts_capture(release: object) -> None:  # noqa: F811
    target = f"{ascend_routed_experts_capture.CAPTURER}:RoutedExpertsCapturer.capture"
    assert _applied(ascend_routed_experts_capture.PATCHES) == {"ascend.routed_experts_capture": {target}}


@pytest.mark.parametrize("paired", ["0.23.0", "0.30.0rc2"], indirect=True)
def test_routed_experts_dp_padding_trim(paired: types.ModuleType) -> None:  # noqa: F811
    """Over vLLM 0.23.0's own capture, and over vllm-ascend 0.30.0rc2's (which that release imports)."""
    target = f"{paired.__name__}:RoutedExpertsCapturer.capture"
    assert _applied(ascend_routed_experts_dp_padding_trim.PATCHES) == {
        "ascend.routed_experts_dp_padding_trim": {target}
    }


@pytest.mark.parametrize(
    ("moe", "names"),
    [("0.24.0rc1", ascend_fused_moe_copies.NAMES), ("0.26.0rc1", ascend_fused_moe_copies.NAMES[:1])],
    indirect=["moe"],
)
def test_fused_moe_copies(moe: types.SimpleNamespace, names: tuple[str, ...]) -> None:  # noqa: F811
    """The sites are the early model modules' copies of the names vllm-ascend replaced, each holding
    vllm-ascend's (unmarked) value."""
    expected = {f"{model}:{name}" for model in moe.models for name in names}
    assert _applied(ascend_fused_moe_copies.PATCHES) == {"ascend.fused_moe_copies": expected}


@pytest.mark.parametrize("dsv4_moe", ["0.23.0.post1", "0.27.1rc1"], indirect=True)
def test_dsv4_dummy_tid2eid(dsv4_moe: types.ModuleType) -> None:  # noqa: F811
    init = f"{dsv4_moe.__name__}:{ascend_dsv4_dummy_tid2eid.METHOD}"
    assert _applied(ascend_dsv4_dummy_tid2eid.PATCHES) == {"ascend.dsv4_dummy_tid2eid": {init}}


@pytest.mark.parametrize("loading", ["0.23.0.post1", "0.27.1rc1"], indirect=True)
def test_dsv4_dummy_wo_a(loading: types.SimpleNamespace) -> None:  # noqa: F811
    """Only vLLM's dummy loader changes; vllm-ascend's ``linear.py`` (read beside it) stays as shipped."""
    target = f"{ascend_dsv4_dummy_wo_a.LOADER}:{ascend_dsv4_dummy_wo_a.METHOD}"
    assert _applied(ascend_dsv4_dummy_wo_a.PATCHES) == {"ascend.dsv4_dummy_wo_a": {target}}


@pytest.mark.parametrize("camem_buffers", ["0.27.1rc1"], indirect=True)
def test_attention_buffers_keep_mapped(camem_buffers: types.SimpleNamespace) -> None:  # noqa: F811
    """The function and the DSA module's ``from ... import`` copy of it (``Reach.copies_in``)."""
    family = ascend_attention_buffers_keep_mapped
    expected = {f"{module}:{family.FUNCTION}" for module in (family.UTILS, family.COPIERS[0])}
    assert _applied(family.PATCHES) == {"ascend.attention_buffers_keep_mapped": expected}
