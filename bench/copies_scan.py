"""What ``Reach.copies_in`` costs: the scan of a package's imported modules for the copies of a
module-level name (``ownership.sites``, run at the fix and at every re-check: ``report()``,
``status``, ``revert()``), in one child process of the given python, after importing the package.

    python3 bench/copies_scan.py --python .envs/vllm-3.11-*/bin/python [--rounds 30]

The stand-in is ``vllm.logger:init_logger`` with ``copies=("vllm",)``: nearly every vLLM module
takes it with ``from vllm.logger import init_logger``, so the scan finds hundreds of copies in the
largest package this house patches. Paired in interleaved rounds with ``declared_values`` of the
same patch without ``copies`` (what every other patch pays, unchanged), and, for ``Reach.stale_values``
(another owner's earlier value, held by no copy), ``sites`` and ``in_place`` (the pipeline's
"already in place" test: a scan for the earlier value). Medians per call.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench import clean_env

CHILD = """
import json, sys, time
sys.path.insert(0, {bench!r})
import vllm.logger, vllm.engine.arg_utils, vllm.model_executor.models.registry
from _bench import interleave, median, per_call
from verl_npu_autopatch.engine import ownership
from verl_npu_autopatch.authoring.spec import Patch, Reach, Target

target = (Target("vllm.logger", "init_logger"),)
with_copies = Patch("bench.copies", "scan", target, lambda site: None, reach=Reach(copies_in=("vllm",)), device="any")
without = Patch("bench.plain", "no scan", target, lambda site: None, device="any")
earlier = {{target[0]: object()}}  # another owner's earlier value: no copy holds it (nothing left behind)
stale_reach = Reach(copies_in=("vllm",), stale_values=lambda: earlier)
stale = Patch("bench.stale", "scan", target, lambda site: None, reach=stale_reach, device="any")
samples = interleave(
    {{
        "sites (copies=vllm)": per_call(lambda: ownership.sites(with_copies), 20),
        "declared_values without copies": per_call(lambda: ownership.declared_values(without), 20),
        "sites (stale, copies=vllm)": per_call(lambda: ownership.sites(stale), 20),
        "in_place (stale, copies=vllm)": per_call(lambda: ownership.in_place(stale), 20),
        "in_place without stale": per_call(lambda: ownership.in_place(without), 20),
    }},
    {rounds},
)
print(json.dumps({{
    "modules": len(ownership.holders(("vllm",))),
    "copies": len(ownership.sites(with_copies)),
    "median_ms": {{name: median(values) * 1e3 for name, values in samples.items()}},
}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    code = CHILD.format(bench=str(Path(__file__).parent), rounds=args.rounds)
    out = subprocess.run([args.python, "-c", code], env=clean_env(), capture_output=True, text=True, check=True)
    print(json.dumps(json.loads(out.stdout.strip().splitlines()[-1]), indent=2))


if __name__ == "__main__":
    main()
