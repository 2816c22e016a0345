"""Per-call overhead of the ``vllm.moe_weight_loader`` wrapper.

Run it with a python that has torch and the package (the vLLM test venv):

    .envs/vllm-3.11-*/bin/python bench/weight_loader.py [--rounds 30] [--calls 20000]

The wrapper from ``verl_npu_autopatch.patches.vllm_moe.make_weight_loader`` (the real fix) wraps
a loader that does nothing, so only the wrapper's own work is timed: the upstream loader copies an
expert's weights, which costs far more. Parameters are real ``torch.nn.Parameter`` objects shaped
like vLLM's fused expert weights (E=8, hidden 256, intermediate 96: not square, so the layout is
unambiguous). Interleaved rounds:

* bare loader vs wrapped loader, checkpoint layout (``w1``: ``[E, 2I, H]``): the common case,
  nothing to fix, the wrapper only reads the shape;
* wrapped, runtime layout (``w1``: ``[E, H, 2I]``): the wrapper re-points ``param.data`` to its
  transposed view (and the bare loader is timed on a parameter it leaves alone for comparison).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench import interleave, report, summary

E, H, I = 8, 256, 96  # noqa: E741 (the usual names: experts, hidden, intermediate)


class Layer:
    """Shaped like vLLM's ``RoutedExperts``: a ``hidden_size`` attribute and the loader."""

    hidden_size = H

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    import torch

    from verl_npu_autopatch.patches.vllm_moe import make_weight_loader

    layer = Layer()
    bare = Layer.weight_loader
    wrapped = make_weight_loader(Layer.weight_loader)
    checkpoint = torch.nn.Parameter(torch.zeros(E, 2 * I, H), requires_grad=False)
    runtime = torch.nn.Parameter(torch.zeros(E, H, 2 * I), requires_grad=False)
    loaded = torch.zeros(I, H)
    calls = args.calls

    def per_call(loader, param) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            loader(layer, param, loaded, "experts.0.w1", "w1", 0)
        return (time.perf_counter() - start) / calls

    def runtime_layout() -> float:
        runtime.data = torch.zeros(E, H, 2 * I)  # each call flips it back to checkpoint layout
        total = 0.0
        for _ in range(calls // 10):
            runtime.data = runtime.data.transpose(1, 2) if runtime.shape[1] != H else runtime.data
            start = time.perf_counter()
            wrapped(layer, runtime, loaded, "experts.0.w1", "w1", 0)
            total += time.perf_counter() - start
        return total / (calls // 10)

    samples = interleave(
        {
            "bare loader": lambda: per_call(bare, checkpoint),
            "wrapped, checkpoint layout": lambda: per_call(wrapped, checkpoint),
            "wrapped, runtime layout (transposes)": runtime_layout,
        },
        args.rounds,
    )
    report(
        "vllm.moe_weight_loader wrapper, per call",
        {"per call (µs)": summary(samples, "bare loader", "us", 1e6)},
        {"python": sys.version.split()[0], "torch": torch.__version__, "rounds": args.rounds, "calls": calls},
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
