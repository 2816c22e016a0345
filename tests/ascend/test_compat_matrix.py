"""``docs/compatibility.md`` is what ``scripts/compat-matrix`` computes from the real releases."""

from __future__ import annotations

import upstream

from verl_npu_autopatch.patches import ascend_capture


def test_committed_table_is_current(releases):
    script = upstream.matrix_script()
    rows = script.compute()  # the same download/extract code, cached by the `releases` fixture
    committed = script.DOC.read_text(encoding="utf-8")
    runtime = script.compute_runtime()  # the tensordict / torch_npu / megatron-core section
    assert script.render(rows) + script.render_runtime(runtime) == committed, (
        "stale: run python3 scripts/compat-matrix --write"
    )

    cells = {name: {label: state for label, (state, _) in row.items()} for name, _, row in rows}
    assert (
        cells["ascend.rms_norm_residual"]["0.23.0"] == cells["ascend.rms_norm_residual"]["0.23.0.post1"] == ("applies")
    )
    assert cells["ascend.camem_sleep_sync"]["0.30.0rc2"] == "fixed-upstream"
    assert cells["ascend.camem_sleep_sync"]["0.23.0"] == "applies"
    indexer = cells["ascend.sfa_indexer_scale"]
    assert [indexer[v] for v in ("0.18.0", "0.21.0rc1", "0.23.0", "0.30.0rc2")] == [
        "unsupported",
        "applies",
        "applies",
        "unsupported",
    ]
    assert cells["ascend.routed_experts_capture"]["0.18.0"] == "gated"
    assert cells["vllm.engine_partial_wake_up"]["0.30.0rc2"] == "fixed-upstream"


def test_gate_uses_the_patch_requirements():
    script = upstream.matrix_script()
    (patch,) = ascend_capture.PATCHES
    reason = script.gate(patch, {"vllm-ascend": "0.20.2rc1"})
    assert reason == "needs vllm-ascend>=0.21.0rc1; found vllm-ascend 0.20.2rc1"
    assert script.gate(patch, {"vllm-ascend": "0.21.0rc1"}) is None


def test_runtime_fix_rows_decide_from_the_real_release_sources():
    script = upstream.matrix_script()
    cells = {name: {version: state for version, state, _ in row} for _, name, row in script.compute_runtime()}
    sync = cells["tensordict.npu_sync"]
    assert [sync[v] for v in ("0.8.0", "0.8.3", "0.9.1")] == ["applies"] * 3
    assert sync["0.10.0"] == sync["0.15.3"] == "fixed-upstream"  # 0.15 moved _sync_all into a mixin
    nested = cells["torch_npu.nested_tensor_intercept"]
    assert [nested[v] for v in ("2.1.0.post17", "2.5.1.post1", "2.6.0.post5")] == ["applies"] * 3
    assert {nested[v] for v in ("2.7.1.post11", "2.9.1", "2.12.0.post3", "2.13.0", "2.14.0")} == {"fixed-upstream"}
    mtp = cells["megatron.mtp_postprocess"]
    assert [mtp[v] for v in ("0.15.3", "0.16.0", "0.16.1", "0.17.0rc0", "0.17.0", "0.19.2")] == [
        "unsupported",
        "applies",
        "applies",
        "fixed-upstream",
        "fixed-upstream",
        "fixed-upstream",
    ]
