"""The transformers NPU kernels' own Python cost, and the bytes the MoE backward allocates.

Run it with a python that has torch and the package (the hf test venv):

    .envs/hf-3.11-*/bin/python bench/kernels.py [--rounds 30] [--calls 2000] [--json]
    .envs/hf-3.11-*/bin/python bench/kernels.py --against verl [--tokens 4096] [--rounds 30] [--calls 1000]

``--against verl``: per kernel ours vs verl 0.9.1's ``npu_patch`` (µs and ratio), and the bytes one
MoE layer allocates and holds at Qwen3-30B-A3B's shape (``bench/_verl_kernels.py``).

No NPU here, so every torch_npu op is replaced by a no-op stub that returns an output of the right
shape without computing it (a view of an input, or ``torch.empty``): what is timed is the
wrapper's own work (attribute reads, dtype casts, ``cat``/slicing around the op, Python calls).

* **Per call** (tiny bf16 inputs, so dispatch dominates): each replacement forward from
  ``verl_npu_autopatch.patches.transformers_npu.kernels`` against calling the stubbed op directly; the
  paired difference is the wrapper's own overhead per call.
* **MoE backward bytes**: ``GroupedMatmul`` forward + backward of one expert layer shaped like
  Qwen3-30B-A3B's gate/up projection (E=128, H=2048, 2I=1536, 8192 routed rows, bf16), CPU
  allocations counted by ``torch.profiler`` (``profile_memory``). *before*: the calls as they were
  until this release (``dx`` with a contiguous copy of every expert's transposed weight, ``dW``
  with a contiguous copy of ``x^T``); *after*: the transposed views verl passes. The stubs
  allocate the same outputs in both, so the difference is the copies.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _bench import interleave, per_call, report, summary


def stub_torch_npu() -> types.ModuleType:
    """``torch_npu`` whose ops return right-shaped outputs without computing them."""
    ops = types.ModuleType("torch_npu")
    ops.npu_rms_norm = lambda x, gamma, epsilon=1e-6: (x, x)
    ops.npu_swiglu = lambda x, dim=-1: x.narrow(dim, 0, x.shape[dim] // 2)
    ops.npu_rotary_mul = lambda x, r1, r2, rotary_mode="half": x

    def npu_grouped_matmul(x: list, weight: list, **kw: Any) -> list:
        (a,), (b,) = x, weight
        if kw.get("group_type") == 2:
            return [a.new_empty(kw["group_list"].shape[0], a.shape[0], b.shape[1])]
        return [a.new_empty(a.shape[0], b.shape[-1])]

    ops.npu_grouped_matmul = npu_grouped_matmul
    return ops


class Norm:
    """Shaped like a transformers RMSNorm (``weight``, ``variance_epsilon``)."""

    def __init__(self, hidden: int, dtype: Any) -> None:
        import torch

        self.weight = torch.ones(hidden, dtype=dtype)
        self.variance_epsilon = 1e-6
        self.activation = "silu"


def mlp() -> Any:
    """A SwiGLU MLP module (as transformers builds it) whose projections cost nothing (identities)."""
    import torch

    module = torch.nn.Module()
    module.gate_proj = module.up_proj = module.down_proj = torch.nn.Identity()
    module.act_fn = torch.nn.SiLU()
    return module


def per_call_rows(rounds: int, calls: int) -> list[dict[str, object]]:
    import torch

    from verl_npu_autopatch.patches.transformers_npu import kernels as k

    dtype = torch.bfloat16
    norm = Norm(64, dtype)
    x = torch.randn(1, 16, 64, dtype=dtype)
    q = torch.randn(1, 4, 16, 64, dtype=dtype)
    cos = torch.randn(1, 16, 64, dtype=dtype)
    ops = k.npu()

    def unused(*args: Any) -> Any:
        raise AssertionError("the kernel fell back to the upstream forward")

    plain, offset = k.rms_norm(unused, "variance_epsilon", False), k.rms_norm(unused, "variance_epsilon", True)
    gated = k.rms_norm_gated(unused, "variance_epsilon")
    rotary = k.rotary(unused, legacy_position_ids=False)
    swiglu, module = k.swiglu_mlp(unused), mlp()  # one module, built once (as a model's)
    cases = {
        "npu_rms_norm alone (stub)": lambda: ops.npu_rms_norm(x, norm.weight, epsilon=1e-6)[0],
        "rms_norm (plain)": lambda: plain(norm, x),
        "rms_norm (1+w offset)": lambda: offset(norm, x),
        "rms_norm_gated": lambda: gated(norm, x, x),
        "rotary (q and k)": lambda: rotary(q, q, cos, cos),
        "SwiGLU MLP (identity projections)": lambda: swiglu(module, x),
    }

    samples = interleave({name: per_call(case, calls) for name, case in cases.items()}, rounds)
    return summary(samples, "npu_rms_norm alone (stub)", "us", 1e6)


class CopyingGroupedMatmul:
    """The MoE backward's calls before this release, for the *before* row only."""

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, Any, None]:
        from verl_npu_autopatch.patches.transformers_npu.kernels import npu

        x, weight, counts = ctx.saved_tensors
        grad = grad.contiguous()
        kw = {"group_list": counts, "group_list_type": 1}
        dx = npu().npu_grouped_matmul([grad], [weight.transpose(1, 2).contiguous()], split_item=2, group_type=0, **kw)
        dw = npu().npu_grouped_matmul([x.t().contiguous()], [grad], split_item=3, group_type=2, **kw)
        return dx[0], dw[0], None


def backward_bytes(variant: str) -> int:
    """Bytes allocated on the CPU by one forward + backward of the gate/up grouped matmul."""
    import torch

    from verl_npu_autopatch.patches.transformers_npu import kernels as k

    experts, hidden, gate_up, rows = 128, 2048, 1536, 8192
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(experts, hidden, gate_up, dtype=torch.bfloat16, requires_grad=True)
    counts = torch.full((experts,), rows // experts, dtype=torch.int64)
    function = k.GroupedMatmul
    if variant == "before":
        function = type("Before", (k.GroupedMatmul,), {"backward": staticmethod(CopyingGroupedMatmul.backward)})
    out = function.apply(x, w, counts)
    grad = torch.zeros_like(out)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out.backward(grad)
    return sum(max(event.self_cpu_memory_usage, 0) for event in prof.events())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--against", choices=["verl"], help="ours vs verl 0.9.1's npu_patch, side by side")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per MoE layer (--against verl)")
    args = parser.parse_args(argv)
    import torch

    if args.against:
        import transformers.activations  # noqa: F401  (verl's module imports it; before the stub, which has no spec)
    sys.modules["torch_npu"] = stub_torch_npu()
    if args.against:
        return against_verl(args)
    before, after = backward_bytes("before"), backward_bytes("after")
    mib = 1 << 20
    bytes_rows: list[dict[str, object]] = [
        {"variant": "before (contiguous copies)", "MiB allocated in backward": round(before / mib, 1)},
        {"variant": "after (transposed views)", "MiB allocated in backward": round(after / mib, 1)},
        {"variant": "saved per layer and step", "MiB allocated in backward": round((before - after) / mib, 1)},
    ]
    report(
        "transformers NPU kernels: Python overhead per call, MoE backward allocations",
        {"per call (µs), torch_npu ops stubbed": per_call_rows(args.rounds, args.calls), "MoE backward": bytes_rows},
        {"python": sys.version.split()[0], "torch": torch.__version__, "rounds": args.rounds, "calls": args.calls},
        args.json,
    )
    return 0


def against_verl(args: argparse.Namespace) -> int:
    import _verl_kernels as side
    import torch

    side.add_moe_stubs(sys.modules["torch_npu"])
    side.integer_histc()
    verl = side.verl_npu_patch()
    report(
        "transformers NPU kernels: ours vs verl 0.9.1's npu_patch (torch_npu ops stubbed alike)",
        {
            "per call (µs), tiny bf16 inputs": side.per_call_rows(verl, args.rounds, args.calls),
            f"one MoE layer, Qwen3-30B-A3B shape, {args.tokens} tokens, bf16": side.bytes_rows(verl, args.tokens),
        },
        {"python": sys.version.split()[0], "torch": torch.__version__, "rounds": args.rounds, "calls": args.calls},
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
