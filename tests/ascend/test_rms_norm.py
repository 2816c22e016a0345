"""``ascend.rms_norm_residual`` on the real ``vllm_ascend/ops/layernorm.py`` of 0.23.0 / 0.23.0.post1.

The release file runs unchanged as ``vllm_ascend.ops.layernorm`` on top of the installed vLLM; its
three vllm-ascend imports (``device_op``, ``ops.triton.layernorm_gated``, ``utils``) are stub
modules, torch_npu and ``maybe_chunk_residual`` are CPU test doubles (tests/ascend/doubles.py).
"""

from __future__ import annotations

from types import ModuleType

import torch

from tests.ascend import doubles
from tests.support import upstream
from verl_npu_autopatch.patches import ascend_glm52

PATCH = [p for p in ascend_glm52.PATCHES if p.name == "ascend.rms_norm_residual"]
HIDDEN, EPS = 64, 1e-6


def make_layer(module: ModuleType, dtype: torch.dtype) -> torch.nn.Module:
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        layer = module.AscendRMSNorm(HIDDEN, eps=EPS)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 1.5, HIDDEN))
    return layer.to(dtype)


def reference_rms_norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm by definition: h / sqrt(mean(h²) + eps) * weight, in float64."""
    h64 = h.double()
    return h64 / torch.sqrt(h64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def test_unpatched_release_uses_the_fused_kernel(layernorm):
    layer = make_layer(layernorm, torch.float32)
    x, residual = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    layernorm.AscendRMSNorm.forward_oot(layer, x, residual)
    assert "torch_npu.npu_add_rms_norm" in doubles.names()
    assert "torch_npu.npu_rms_norm" not in doubles.names()


def test_residual_path_is_explicit_add_then_rms_norm(layernorm):
    engine = upstream.run_engine(PATCH, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert engine.report()["ascend.rms_norm_residual"].state == "applied"
    layer = make_layer(layernorm, torch.bfloat16)
    torch.manual_seed(0)
    x = torch.randn(7, HIDDEN, dtype=torch.bfloat16) * 3
    residual = torch.randn(7, HIDDEN, dtype=torch.bfloat16) * 3
    doubles.EVENTS.clear()

    out, new_residual = layer.forward_oot(x, residual)

    assert "torch_npu.npu_add_rms_norm" not in doubles.names()
    assert "torch_npu.npu_rms_norm" in doubles.names()
    # The residual is the bf16 sum, and the output the RMSNorm of exactly that sum.
    assert torch.equal(new_residual, x + residual)
    expected = reference_rms_norm(x + residual, layer.weight)
    torch.testing.assert_close(out.double(), expected, rtol=1.6e-2, atol=1e-2)
    assert out.dtype == torch.bfloat16
    # ...which is not what the fused kernel (float32 sum inside) returns.
    fused, _, _ = doubles.npu_add_rms_norm(x, residual, layer.weight, EPS)
    assert not torch.equal(out, fused)


def test_release_chunks_the_residual_before_adding(layernorm):
    upstream.run_engine(PATCH, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    layer = make_layer(layernorm, torch.float32)
    doubles.TP.update(size=2, rank=1, pad=1)  # 5 tokens over 2 ranks: x holds rank 1's 3 rows
    x, residual = torch.randn(3, HIDDEN), torch.randn(5, HIDDEN)

    out, new_residual = layer.forward_oot(x, residual)

    chunk = torch.cat([residual, torch.zeros(1, HIDDEN)])[3:]  # padded, second half
    assert "torch.ops.vllm.maybe_chunk_residual" in doubles.names()
    torch.testing.assert_close(new_residual, x + chunk)
    torch.testing.assert_close(out.double(), reference_rms_norm(x + chunk, layer.weight))


def test_without_residual_the_release_code_runs(layernorm):
    upstream.run_engine(PATCH, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    layer = make_layer(layernorm, torch.float32)
    x = torch.randn(4, HIDDEN)
    out = layer.forward_oot(x)
    assert doubles.names() == ["torch_npu.npu_rms_norm"]
    torch.testing.assert_close(out.double(), reference_rms_norm(x, layer.weight))


def test_idempotent_and_revertible(layernorm):
    original = layernorm.AscendRMSNorm.__dict__["forward_oot"]
    first = upstream.run_engine(PATCH, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    patched = layernorm.AscendRMSNorm.__dict__["forward_oot"]
    assert patched is not original and patched.__wrapped__ is original
    second = upstream.run_engine(PATCH, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert second.report()["ascend.rms_norm_residual"].state == "applied"
    assert "already in place" in second.report()["ascend.rms_norm_residual"].reason
    assert layernorm.AscendRMSNorm.__dict__["forward_oot"] is patched
    assert first.revert() == ["ascend.rms_norm_residual"]
    assert layernorm.AscendRMSNorm.__dict__["forward_oot"] is original
