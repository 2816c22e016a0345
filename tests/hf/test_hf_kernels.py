"""Our NPU kernels (run on the CPU test double) against the real transformers models."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from tests.hf.conftest import PRESENT, builders, randomize
from verl_npu_autopatch.patches import transformers_npu
from verl_npu_autopatch.patches.transformers_npu import kernels as npu_kernels

#: Emulated op each kernel kind must call once patched.
OPS = {
    "rms_norm": "npu_rms_norm",
    "rms_norm_gated": "npu_rms_norm",
    "mlp": "npu_swiglu",
    "rotary": "npu_rotary_mul",
    "experts": "npu_grouped_matmul[group_type=2]",  # only the weight-gradient GMM proves backward ran
}


def _run(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids)
    value = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    value.float().sin().sum().backward()
    return value.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


FP32 = dict(rtol=1e-3, atol=1e-4)


def _shared_targets(family: str) -> dict[str, str]:
    """``{our patch: the other family's patch}`` for targets whose live class is defined in another
    family's modeling module (transformers 4.57 ``qwen2_5_vl`` reuses ``Qwen2RMSNorm``): that
    family's patch owns them, ours yields."""
    module = importlib.import_module(transformers_npu.module_name(family))
    shared = {}
    for kind, variants in transformers_npu.MODELS[family]:
        for qualname in variants:
            cls = getattr(module, qualname.split(".")[0], None)
            if isinstance(cls, type):
                other = cls.__module__.rpartition(".modeling_")[2]
                if other != family:
                    shared[transformers_npu.patch_name(family, kind)] = transformers_npu.patch_name(other, kind)
                break
    return shared


def _relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return float((value.double() - exact.double()).norm() / exact.double().norm().clamp_min(1e-12))


@pytest.mark.parametrize("family", PRESENT)
def test_patched_model_matches_unpatched(family: str, npu: Any, make_engine: Any) -> None:
    model = randomize(builders()[family]())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    reference, reference_grads = _run(model, ids)
    assert not npu.calls, "the unpatched model must not touch torch_npu"

    engine = make_engine()
    ours = {n: r for n, r in engine.records.items() if n.startswith(f"transformers.{family}.")}
    shared = _shared_targets(family)
    assert {n: r.state for n, r in ours.items()} == {n: "yielded" if n in shared else "applied" for n in ours}, {
        n: r.reason for n, r in ours.items()
    }
    for name, owner in shared.items():
        assert ours[name].reason.startswith(f"target owned by {owner}"), ours[name].reason
    # Built again once patched: transformers 5.x picks a model's default experts implementation
    # (ours, when the user chose none) as the model is built.
    model = randomize(builders()[family]())
    output, grads = _run(model, ids)

    torch.testing.assert_close(output, reference, **FP32)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], **FP32, msg=lambda m, n=name: f"{n}: {m}")
    used = {OPS[kind] for kind in transformers_npu.kinds(family) if kind in OPS}
    if "experts" in transformers_npu.kinds(family):
        used |= {"npu_moe_token_permute", "npu_moe_token_unpermute"}
    assert {op for op in used if npu.calls[op] == 0} == set(), dict(npu.calls)

    engine.revert()
    npu.calls.clear()
    _run(model, ids)
    assert not npu.calls, "revert() must restore the upstream code"


@pytest.mark.parametrize("family", [f for f in ("qwen3", "qwen3_moe", "qwen3_next") if f in PRESENT])
def test_bfloat16_error_stays_within_upstream_error(family: str, npu: Any, make_engine: Any) -> None:
    """In bf16, our kernels' distance to the fp32 result is no worse than upstream's own bf16 error."""
    model = randomize(builders()[family]())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    exact, exact_grads = _run(model, ids)
    model.to(torch.bfloat16)
    upstream, upstream_grads = _run(model, ids)
    engine = make_engine()
    assert all(r.state == "applied" for n, r in engine.records.items() if n.startswith(f"transformers.{family}."))
    ours, our_grads = _run(model, ids)
    assert npu.calls["npu_rms_norm"] > 0

    pairs = [("output", ours, upstream, exact)] + [
        (n, our_grads[n], upstream_grads[n], exact_grads[n]) for n in exact_grads
    ]
    for name, mine, theirs, truth in pairs:
        assert mine.dtype == theirs.dtype == torch.bfloat16, name
        assert _relative_error(mine, truth) <= 2 * _relative_error(theirs, truth) + 2e-3, name


def test_vision_mlp_of_qwen2_5_vl(npu: Any, make_engine: Any) -> None:
    if "qwen2_5_vl" not in PRESENT:
        pytest.fail("transformers without qwen2_5_vl: update the family table")
    from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl as conf
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as mod

    config = conf.Qwen2_5_VLVisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        patch_size=2,
        temporal_patch_size=1,
        in_channels=3,
        spatial_merge_size=2,
        out_hidden_size=32,
        window_size=4,
        fullatt_block_indexes=[0],
    )
    config._attn_implementation = "eager"
    tower = randomize(mod.Qwen2_5_VisionTransformerPretrainedModel(config))
    pixels = torch.randn(16, 12, generator=torch.Generator().manual_seed(2))
    grid = torch.tensor([[1, 4, 4]])

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        tower.zero_grad(set_to_none=True)
        out = tower(pixels, grid_thw=grid)
        out = out.pooler_output if hasattr(out, "pooler_output") else out
        out.sin().sum().backward()
        return out.detach(), tower.blocks[0].mlp.gate_proj.weight.grad.clone()

    reference = run()
    engine = make_engine()
    assert engine.records["transformers.qwen2_5_vl.vision_mlp"].state == "applied"
    patched = run()
    assert npu.calls["npu_swiglu"] > 0
    torch.testing.assert_close(patched, reference, rtol=1e-4, atol=1e-5)


def _dense_experts(tokens, index, weights, gate_up, down):
    """Dense reference: every token through each of its experts, weighted and summed."""
    out = torch.zeros_like(tokens)
    for slot in range(index.shape[1]):
        w1 = gate_up[index[:, slot]]  # [T, H, 2I]
        w2 = down[index[:, slot]]  # [T, I, H]
        gate, up = torch.einsum("th,thn->tn", tokens, w1).chunk(2, dim=-1)
        hidden = torch.einsum("ti,tih->th", torch.nn.functional.silu(gate) * up, w2)
        out = out + hidden * weights[:, slot, None]
    return out


def test_grouped_matmul_backward_matches_dense_autograd(npu: Any, monkeypatch: Any) -> None:
    npu.allow_float64(monkeypatch)  # gradcheck's precision; every layout/dtype rule still holds
    g = torch.Generator().manual_seed(3)
    experts, k_dim, n_dim = 4, 6, 5
    counts = torch.tensor([3, 0, 4, 2])  # an empty expert must get a zero weight gradient
    owner = torch.repeat_interleave(torch.arange(experts), counts)
    x = torch.randn(int(counts.sum()), k_dim, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(experts, k_dim, n_dim, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(int(counts.sum()), n_dim, generator=g, dtype=torch.float64)

    y = npu_kernels.grouped_matmul(x, w, counts)
    (y * upstream).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    y_ref = torch.einsum("mk,mkn->mn", x_ref, w_ref[owner])
    (y_ref * upstream).sum().backward()

    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)
    assert torch.count_nonzero(w.grad[1]) == 0
    assert npu.calls["npu_grouped_matmul[group_type=0]"] == 2 and npu.calls["npu_grouped_matmul[group_type=2]"] == 1
    assert torch.autograd.gradcheck(
        lambda a, b: npu_kernels.grouped_matmul(a, b, counts),
        (x.detach().requires_grad_(), w.detach().requires_grad_()),
    )


def test_routed_experts_forward_and_backward_match_dense(npu: Any, monkeypatch: Any) -> None:
    npu.allow_float64(monkeypatch)  # a math check in double precision; every other rule still holds
    g = torch.Generator().manual_seed(4)
    tokens_n, hidden, inter, experts, top_k = 10, 6, 4, 5, 2
    tokens = torch.randn(tokens_n, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(tokens_n, experts, generator=g, dtype=torch.float64, requires_grad=True)
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    gate_up = torch.randn(experts, hidden, 2 * inter, generator=g, dtype=torch.float64, requires_grad=True)
    down = torch.randn(experts, inter, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    leaves = (tokens, logits, gate_up, down)

    out = npu_kernels.routed_experts(tokens, index, weights, gate_up, down)
    grads = torch.autograd.grad(out.sin().sum(), leaves, retain_graph=True)
    ref = _dense_experts(tokens, index, weights, gate_up, down)
    ref_grads = torch.autograd.grad(ref.sin().sum(), leaves)

    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert npu.calls["npu_moe_token_permute"] == 1 and npu.calls["npu_moe_token_unpermute"] == 1


def test_non_silu_mlp_keeps_upstream_forward(npu: Any, make_engine: Any) -> None:
    from transformers.activations import ACT2FN
    from transformers.models.qwen3 import modeling_qwen3

    config = modeling_qwen3.Qwen3Config(hidden_size=8, intermediate_size=12, hidden_act="gelu")
    mlp = randomize(modeling_qwen3.Qwen3MLP(config))
    x = torch.randn(3, 8)
    reference = mlp(x)
    engine = make_engine()
    assert engine.records["transformers.qwen3.mlp"].state == "applied"
    torch.testing.assert_close(mlp(x), reference)
    assert npu.calls["npu_swiglu"] == 0
    mlp.act_fn = ACT2FN["silu"]
    mlp(x)
    assert npu.calls["npu_swiglu"] == 1


def test_one_kernel_table_serves_every_kind() -> None:
    """Every kind a family lists has its row in ``KERNELS`` and every row is used; the patch
    summaries and Liger's switches are read from it."""
    from verl_npu_autopatch.patches import liger_arbitration as liger

    listed = {kind for family in transformers_npu.MODELS for kind in transformers_npu.kinds(family)}
    assert listed == set(transformers_npu.KERNELS)
    for patch in transformers_npu.PATCHES:
        family, kind = patch.name.split(".")[1:]
        kernel = transformers_npu.KERNELS[kind]
        assert patch.summary == f"{family}: {kernel.summary} torch_npu calls as {kernel.mirrors}."
    assert liger.LIGER_SWITCH == {"rms_norm": "rms_norm", "mlp": "swiglu", "experts": "swiglu", "rotary": "rope"}


def test_rotary_on_the_kernels_hub_form(npu: Any, make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.25 (with ``kernels``) makes ``apply_rotary_pos_emb`` a hub layer instance
    (``(*args, **kwargs)``): ours replaces what the model module calls, wraps the plain function,
    and revert puts the hub layer back. Should the hub map an NPU rotary kernel, ours would bypass
    it: the record says unsupported and names it."""
    from transformers.models.qwen3 import modeling_qwen3 as module

    hub_layer = module.apply_rotary_pos_emb
    layer = getattr(type(hub_layer), "kernel_layer_name", None)
    if layer is None:  # a plain function here (no `kernels`, or an older transformers): the hf-5.25 env runs this
        assert callable(hub_layer) and not isinstance(hub_layer, torch.nn.Module)
        return
    function = transformers_npu.hub_function(hub_layer)
    assert function is not hub_layer and function.__name__ == "apply_rotary_pos_emb"
    engine = make_engine([p for p in transformers_npu.PATCHES if p.name == "transformers.qwen3.rotary"])
    assert engine.records["transformers.qwen3.rotary"].state == "applied"
    assert module.apply_rotary_pos_emb.__wrapped__ is function
    engine.revert()
    assert module.apply_rotary_pos_emb is hub_layer

    hub = importlib.import_module("transformers.integrations.hub_kernels")
    mapping = hub.get_kernel_mapping_transformers()
    monkeypatch.setitem(mapping, layer, {**mapping[layer], "npu": "an NPU rotary kernel"})
    engine = make_engine([p for p in transformers_npu.PATCHES if p.name == "transformers.qwen3.rotary"])
    record = engine.records["transformers.qwen3.rotary"]
    assert record.state == "unsupported" and "an NPU rotary kernel" in record.reason
    assert module.apply_rotary_pos_emb is hub_layer
