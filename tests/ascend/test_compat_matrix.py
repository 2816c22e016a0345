"""``docs/compatibility.md`` is what ``scripts/compat-matrix`` computes from the real releases."""

from __future__ import annotations

import upstream

from verl_npu_autopatch.patches import ascend_capture


def test_committed_table_is_current(releases):
    script = upstream.matrix_script()
    rows = script.compute()  # the same download/extract code, cached by the `releases` fixture
    committed = script.DOC.read_text(encoding="utf-8")
    assert script.render(rows) == committed, "stale: run python3 scripts/compat-matrix --write"

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
