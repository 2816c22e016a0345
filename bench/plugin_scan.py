"""The plugin scan at activation: ``catalog._entry_points`` (only a distribution whose
``entry_points.txt`` names ``verl_npu_autopatch.patches`` is parsed) against parsing every
distribution's entry points (``importlib.metadata``'s way, the scan before), in fresh processes
of a venv with the package installed (a vLLM venv has ~200 distributions):

    python3 bench/plugin_scan.py --python .envs/vllm-3.11-*/bin/python [--rounds 15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench import clean_env, interleave, report, spawn_timed, summary

OURS = """
import importlib.metadata, json, time
from verl_npu_autopatch.engine import catalog
t = time.perf_counter(); catalog._entry_points(catalog.Catalog([])); print(json.dumps(time.perf_counter() - t))
"""

EVERY = """
import json, time
from importlib.metadata import distributions
t = time.perf_counter()
seen = set()
for dist in distributions():
    name = getattr(dist, "_normalized_name", None) or dist.metadata["Name"]
    if name not in seen:
        seen.add(name)
        [point for point in dist.entry_points if point.group == "verl_npu_autopatch.patches"]
print(json.dumps(time.perf_counter() - t))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    def child(code: str) -> float:
        return float(spawn_timed([args.python, "-c", code], clean_env())[2])

    variants = {
        "only files naming our group parsed": lambda: child(OURS),
        "every distribution parsed": lambda: child(EVERY),
    }
    samples = interleave(variants, args.rounds)
    table = summary(samples, "every distribution parsed", "ms", 1000)
    report("The plugin scan", {"scan (ms)": table}, {"python": args.python, "rounds": args.rounds}, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
