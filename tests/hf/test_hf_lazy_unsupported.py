"""Laziness (a family never imported is never touched) and unexpected shapes (``unsupported``,
never a crash)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf.conftest import PRESENT, randomize
from verl_npu_autopatch.patches import transformers_npu
from verl_npu_autopatch.patches.transformers_npu import owners

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_only_the_imported_family_is_patched_and_the_rest_costs_nothing() -> None:
    code = textwrap.dedent(
        """
        import json, sys, time
        from verl_npu_autopatch.engine.config import Config
        from verl_npu_autopatch.engine.lifecycle import Engine
        from verl_npu_autopatch.patches import liger_arbitration as liger, transformers_npu
        engine = Engine([*transformers_npu.PATCHES, *liger.PATCHES], Config(device="npu"))
        start = time.perf_counter()
        engine.activate("test")
        activation_ms = (time.perf_counter() - start) * 1e3
        heavy_after_activation = sorted(m for m in ("torch", "transformers", "liger_kernel",
            "verl_npu_autopatch.patches.transformers_npu.kernels") if m in sys.modules)
        import transformers.models.qwen3.modeling_qwen3
        print(json.dumps({
            "activation_ms": activation_ms,
            "heavy_after_activation": heavy_after_activation,
            "states": {n: r.state for n, r in engine.records.items()},
            "reasons": {n: r.reason for n, r in engine.records.items()},
            "modules": sorted(m for m in sys.modules if m.startswith("transformers.models.")),
        }))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["heavy_after_activation"] == []
    states = out["states"]
    for family in transformers_npu.MODELS:
        for kind in transformers_npu.kinds(family):
            name = transformers_npu.patch_name(family, kind)
            if family == "qwen3":
                assert states[name] == "applied", out["reasons"][name]
            else:
                assert states[name] == "pending", (name, out["reasons"][name])
                assert out["reasons"][name] == f"waiting for {transformers_npu.module_name(family)}"
                assert transformers_npu.module_name(family) not in out["modules"]
    assert states["liger.arbitration"] == "pending"
    print(f"activation with {len(states)} patches: {out['activation_ms']:.2f} ms")


def test_monkeypatched_classes_of_unexpected_shape_are_unsupported(monkeypatch: Any, make_engine: Any) -> None:
    from transformers.models.qwen3 import modeling_qwen3 as mod

    class Qwen3RMSNorm(torch.nn.Module):
        def forward(self, hidden_states, residual):
            return hidden_states + residual

    class Qwen3MLP(mod.Qwen3MLP):
        def forward(self, x):
            return self.down_proj(self.up_proj(x))

    monkeypatch.setattr(mod, "Qwen3RMSNorm", Qwen3RMSNorm)
    monkeypatch.setattr(mod, "Qwen3MLP", Qwen3MLP)
    monkeypatch.delattr(mod, "apply_rotary_pos_emb")
    engine = make_engine()
    records = {k: engine.records[transformers_npu.patch_name("qwen3", k)] for k in ("rms_norm", "mlp", "rotary")}
    assert {k: r.state for k, r in records.items()} == dict.fromkeys(records, "unsupported")
    assert (
        "expected" in records["rms_norm"].reason
        and "forward(self, hidden_states, residual)" in records["rms_norm"].reason
    )
    assert "down_proj(act_fn(gate_proj(x)) * up_proj(x))" in records["mlp"].reason
    assert "has no attribute 'apply_rotary_pos_emb'" in records["rotary"].reason
    assert not any(owners._module_of(v).startswith("verl") for v in (Qwen3MLP.forward,))


def test_module_of_unexpected_shape_imports_fine_and_is_unsupported(monkeypatch: Any, make_engine: Any) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.delitem(sys.modules, "odd_qwen3_moe", raising=False)
    engine = make_engine(transformers_npu.family_patches("qwen3_moe", module="odd_qwen3_moe"), strict=False)
    assert {r.state for r in engine.records.values()} == {"pending"}
    import odd_qwen3_moe  # the patches run inside this import; it must still succeed

    states = {n.rsplit(".", 1)[1]: (r.state, r.reason) for n, r in engine.records.items()}
    assert {k: s for k, (s, _) in states.items()} == dict.fromkeys(
        ("rms_norm", "mlp", "rotary", "experts"), "unsupported"
    )
    assert "rsqrt" in states["rms_norm"][1] or "forward(self, hidden_states)" in states["rms_norm"][1]
    assert "rotate-half" in states["rotary"][1]
    assert "top_k_index" in states["experts"][1] and "routing_weights" in states["experts"][1]
    assert odd_qwen3_moe.Qwen3MoeMLP.forward.__module__ == "odd_qwen3_moe"


@pytest.mark.parametrize("shared", [False, True])
def test_legacy_moe_block_api(shared: bool, npu: Any, monkeypatch: Any, make_engine: Any) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    import legacy_qwen3_moe as legacy

    (experts,) = [
        p
        for p in transformers_npu.family_patches("qwen3_moe", module="legacy_qwen3_moe")
        if p.name.endswith(".experts")
    ]
    block = randomize(legacy.Qwen3MoeSparseMoeBlock(16, 8, num_experts=4, top_k=2, shared=shared))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(5))

    def run() -> list[torch.Tensor]:
        block.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_()
        hidden, logits = block(inp)
        (hidden.sin().sum() + logits.cos().sum()).backward()
        return [hidden.detach(), logits.detach(), inp.grad] + [p.grad for p in block.parameters()]

    reference = run()
    engine = make_engine([experts])
    record = engine.records[experts.name]
    assert (record.state, record.target) == ("applied", "legacy_qwen3_moe:Qwen3MoeSparseMoeBlock.forward")
    patched = run()
    assert npu.calls["npu_moe_token_permute"] == 1 and npu.calls["npu_grouped_matmul[group_type=2]"] == 2
    for got, want in zip(patched, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_every_present_family_is_in_the_table() -> None:
    import transformers.models as models

    root = Path(models.__file__).parent
    wanted = [
        "qwen2",
        "qwen2_5_vl",
        "qwen3",
        "qwen3_moe",
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_moe",
    ]
    assert sorted(PRESENT) == sorted(f for f in wanted if (root / f / f"modeling_{f}.py").exists())
    # Only the families newer than transformers 4.57 may be missing (4.57.6 is the oldest we test).
    assert set(wanted) - set(PRESENT) <= {"qwen3_5", "qwen3_5_moe"}, PRESENT
