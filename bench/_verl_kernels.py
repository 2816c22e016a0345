"""``bench/kernels.py --against verl``: our kernels and verl 0.9.1's ``npu_patch`` side by side.

verl's released ``verl/models/transformers/npu_patch.py`` is downloaded (sha256-checked) by
``scripts/compat-matrix``'s own code and imported as it is, over bare ``verl`` packages (its
package ``__init__`` chain imports Ray, Hydra, ...), exactly as ``tests/hf`` loads it. Both sides
call the same stubbed ``torch_npu`` (``kernels.stub_torch_npu``: right-shaped outputs, nothing
computed) and the same integer ``torch.histc`` stand-in (CPU torch counts floating tensors only;
the NPU counts integers): what differs is each side's own work around the ops.

* **Per call**: each kernel of ours against verl's function for the same module, paired rounds in
  rotating order; the ratio is the median over rounds of ours / verl.
* **Bytes per MoE layer** at Qwen3-30B-A3B's shape: every aten op's fresh storage counted by a
  ``TorchDispatchMode`` over one forward and one backward of the routed experts (the router
  included), the bytes saved for backward besides the parameters and the input, and the bytes of
  copies of expert weights (tensors shaped like a weight that are not the parameter itself).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import statistics
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.9.1"
NPU_PATCH = "verl/models/transformers/npu_patch.py"


def verl_npu_patch() -> types.ModuleType:
    """verl 0.9.1's ``verl.models.transformers.npu_patch``, imported for real (torch_npu stubbed first)."""
    sys.path.append(str(ROOT / "scripts"))  # the compatibility tool's package, compat_matrix
    from compat_matrix.fetch import Artifact, extract

    root = extract(Artifact("verl", VERSION, f"verl-{VERSION}-py3-none-any.whl"), (NPU_PATCH,)) / "verl"
    for name, sub in (("verl", ""), ("verl.models", "models"), ("verl.models.transformers", "models/transformers")):
        package = types.ModuleType(name)
        package.__path__ = [str(root / sub)]
        sys.modules[name] = package
    return importlib.import_module("verl.models.transformers.npu_patch")


def integer_histc() -> None:
    """The NPU's ``torch.histc`` counts integer tensors in their own dtype; CPU torch does not (the
    tests' stand-in, for this whole process)."""
    sys.path.insert(0, str(ROOT))
    from tests.hf.npu_emulation import integer_histc as stand_in

    stand_in()


# --------------------------------------------------------------------------- per call
def _cases(verl: Any) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """kernel -> (ours, verl's), on tiny bf16 inputs (dispatch dominates)."""
    import torch

    from verl_npu_autopatch.patches.transformers_npu import kernels as k

    dtype = torch.bfloat16
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(torch.ones(64, dtype=dtype))
    norm.variance_epsilon = norm.eps = 1e-6
    norm.activation = "silu"  # transformers 5.x's gated norms name it (4.57's do not)
    x = torch.randn(1, 16, 64, dtype=dtype)
    q = torch.randn(1, 4, 16, 64, dtype=dtype)
    cos, half = torch.randn(1, 16, 64, dtype=dtype), torch.randn(1, 16, 32, dtype=dtype)
    mlp = torch.nn.Module()
    mlp.gate_proj = mlp.up_proj = mlp.down_proj = torch.nn.Identity()
    mlp.act_fn = torch.nn.SiLU()
    experts, tokens, index, weights = _tiny_experts(dtype)

    def unused(*args: Any) -> Any:
        raise AssertionError("the kernel fell back to the upstream forward")

    plain, offset = k.rms_norm(unused, "variance_epsilon", False), k.rms_norm(unused, "eps", True)
    gated, rotary, swiglu = k.rms_norm_gated(unused, "variance_epsilon"), k.rotary(unused, False), k.swiglu_mlp(unused)
    return {
        "rms_norm (plain)": (lambda: plain(norm, x), lambda: verl.rms_norm_forward_npu(norm, x)),
        "rms_norm ((1+w) offset)": (lambda: offset(norm, x), lambda: verl.qwen3_next_rms_norm_forward_npu(norm, x)),
        "rms_norm_gated": (lambda: gated(norm, x, x), lambda: verl.qwen3_next_rms_norm_forward_gated_npu(norm, x, x)),
        "rotary (full)": (lambda: rotary(q, q, cos, cos), lambda: verl.apply_rotary_pos_emb_npu(q, q, cos, cos)),
        "rotary (partial)": (
            lambda: rotary(q, q, half, half),
            lambda: verl.qwen3_next_apply_rotary_pos_emb_npu(q, q, half, half),
        ),
        "SwiGLU MLP": (lambda: swiglu(mlp, x), lambda: verl.silu_forward_npu(mlp, x)),
        "MoE experts forward (5.x fused)": (
            lambda: k.run_fused_experts(experts, False, tokens, index, weights),
            lambda: verl.qwen3_5_moe_experts_forward_npu(experts, tokens, index, weights),
        ),
    }


def _tiny_experts(dtype: Any, experts: int = 8, hidden: int = 64, inter: int = 32, tokens: int = 16) -> tuple:
    """A transformers-5.x-shaped fused experts module (``[E, 2I, H]`` / ``[E, H, I]``) and routed tokens."""
    import torch

    module = torch.nn.Module()
    module.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden, dtype=dtype))
    module.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inter, dtype=dtype))
    module.num_experts, module.act_fn = experts, torch.nn.SiLU()
    x = torch.randn(tokens, hidden, dtype=dtype)
    weights, index = torch.randn(tokens, experts).softmax(-1).topk(2, dim=-1)
    return module, x, index, weights.to(dtype)


def per_call_rows(verl: Any, rounds: int, calls: int) -> list[dict[str, object]]:
    from _bench import per_call

    rows = []
    for name, (ours, theirs) in _cases(verl).items():
        ours_s, verl_s = [], []
        for index in range(rounds):
            pair = [(ours_s, per_call(ours, calls)), (verl_s, per_call(theirs, calls))]
            for samples, run in pair if index % 2 else pair[::-1]:
                samples.append(run())
        rows.append(
            {
                "kernel": name,
                "ours (µs)": round(statistics.median(ours_s) * 1e6, 2),
                "verl 0.9.1 (µs)": round(statistics.median(verl_s) * 1e6, 2),
                "ratio ours/verl (paired median)": round(
                    statistics.median(a / b for a, b in zip(ours_s, verl_s, strict=True)), 3
                ),
            }
        )
    return rows


def add_moe_stubs(ops: types.ModuleType) -> None:
    """Differentiable right-shaped stand-ins for the MoE ops: each allocates what the op outputs."""
    import torch

    def npu_moe_token_permute(tokens: Any, indices: Any, num_out_tokens: Any = None, padded_mode: bool = False) -> Any:
        top_k = indices.shape[1]
        rows = torch.arange(indices.numel(), device=tokens.device) // top_k
        return tokens.index_select(0, rows), indices.reshape(-1).to(torch.int32)

    def npu_moe_token_unpermute(permuted: Any, sorted_indices: Any, probs: Any = None, **kw: Any) -> Any:
        top_k = probs.shape[1]
        return (permuted.view(-1, top_k, permuted.shape[-1]) * probs.unsqueeze(-1)).sum(1)

    def npu_swiglu(x: Any, dim: int = -1) -> Any:
        gate, up = x.chunk(2, dim=dim)
        return gate * up

    ops.npu_moe_token_permute, ops.npu_moe_token_unpermute = npu_moe_token_permute, npu_moe_token_unpermute
    ops.npu_swiglu = npu_swiglu


# --------------------------------------------------------------------------- bytes per MoE layer
#: Qwen3-30B-A3B: hidden 2048, moe_intermediate 768, 128 experts, top-8.
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8


def _block(fused: bool, dtype: Any) -> Any:
    """A sparse-MoE block at Qwen3-30B-A3B's shape: a linear router and either fused experts
    (transformers 5.x, ``[E, 2I, H]`` / ``[E, H, I]``) or a list of per-expert MLPs (4.57)."""
    import torch
    from torch import nn

    block = nn.Module()
    block.gate = nn.Linear(HIDDEN, EXPERTS, bias=False, dtype=dtype)
    block.top_k, block.norm_topk_prob, block.num_experts = TOP_K, True, EXPERTS
    if fused:
        block.experts = nn.Module()
        block.experts.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=dtype) * 0.02)
        block.experts.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER, dtype=dtype) * 0.02)
        block.experts.num_experts, block.experts.act_fn = EXPERTS, nn.SiLU()
        return block
    mlps = []
    for _ in range(EXPERTS):
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(HIDDEN, INTER, bias=False, dtype=dtype)
        mlp.up_proj = nn.Linear(HIDDEN, INTER, bias=False, dtype=dtype)
        mlp.down_proj = nn.Linear(INTER, HIDDEN, bias=False, dtype=dtype)
        mlp.act_fn = nn.SiLU()
        mlps.append(mlp)
    block.experts = nn.ModuleList(mlps)
    return block


def _ours(fused: bool) -> Callable[[Any, Any], Any]:
    from verl_npu_autopatch.patches.transformers_npu import kernels as k

    if not fused:
        legacy = k.legacy_moe_block(lambda *a: None)
        return lambda block, hidden: legacy(block, hidden)[0]

    def forward(block: Any, hidden: Any) -> Any:  # the 5.x block: router, then the experts forward
        tokens = hidden.view(-1, HIDDEN)
        _, weights, index = k._route(block, tokens, None)
        return k.run_fused_experts(block.experts, False, tokens, index, weights)

    return forward


def _first(forward: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``forward``'s hidden states (verl's legacy-API block forwards return ``(hidden, logits)``)."""

    def run(block: Any, hidden: Any) -> Any:
        out = forward(block, hidden)
        return out[0] if isinstance(out, tuple) else out

    return run


def _qwen3_5_experts(verl: Any) -> Callable[[Any, Any], Any]:
    """The router as ours, then verl's ``qwen3_5_moe_experts_forward_npu`` (Qwen3.5-MoE's experts)."""
    from verl_npu_autopatch.patches.transformers_npu import kernels as k

    def forward(block: Any, hidden: Any) -> Any:
        tokens = hidden.view(-1, HIDDEN)
        _, weights, index = k._route(block, tokens, None)
        return verl.qwen3_5_moe_experts_forward_npu(block.experts, tokens, index, weights)

    return forward


def measure(forward: Callable[[Any, Any], Any], block: Any, hidden: Any) -> dict[str, int]:
    """Fresh bytes in forward and in backward, ops, and bytes held for backward besides the
    parameters and the input."""
    import torch

    sys.path.insert(0, str(ROOT))
    from tests.hf.meter import Meter

    own = {p.untyped_storage().data_ptr() for p in block.parameters()} | {hidden.untyped_storage().data_ptr()}
    held: dict[int, int] = {}

    def pack(tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            held[storage.data_ptr()] = storage.nbytes()
        return tensor

    block.zero_grad(set_to_none=True)
    with Meter() as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(block, hidden)
    grad = torch.ones_like(out)
    with Meter() as bwd:
        out.backward(grad)
    del out
    return {"fwd": fwd.bytes, "bwd": bwd.bytes, "waits_for_activation": sum(held.values()), "ops": fwd.ops + bwd.ops}


def bytes_rows(verl: Any, tokens: int) -> list[dict[str, object]]:
    import torch

    mib = 1 << 20
    hidden = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16)
    rows = []
    layouts = {
        "transformers 5.x fused experts (Qwen3-MoE)": (True, verl.qwen3_moe_sparse_moe_block_forward_npu),
        "transformers 4.57 per-expert MLPs (Qwen3-MoE)": (False, verl.qwen3_moe_sparse_moe_block_forward_npu),
    }
    layouts["transformers 5.x fused experts (Qwen3.5-MoE experts forward)"] = (True, _qwen3_5_experts(verl))
    for name, (fused, theirs) in layouts.items():
        block = _block(fused, torch.bfloat16)
        for side, forward in (("ours", _ours(fused)), ("verl 0.9.1", _first(theirs))):
            got = measure(forward, block, hidden)
            rows.append(
                {
                    "MoE layer": name,
                    "side": side,
                    "MiB allocated, forward": round(got["fwd"] / mib, 1),
                    "MiB allocated, backward": round(got["bwd"] / mib, 1),
                    "MiB held for backward (besides params, input)": round(got["waits_for_activation"] / mib, 1),
                    "host ops (fwd + bwd)": got["ops"],
                }
            )
        del block
    return rows
