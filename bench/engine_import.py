"""The engine's import path: ``import verl_npu_autopatch.engine.lifecycle`` in a fresh ``python -S``
process (what ``activate()`` and the first watched import on an NPU host load before wrapt and
the catalog), for two source trees, paired in interleaved rounds.

    python3 bench/engine_import.py --python .envs/runner-3.11-*/bin/python \\
        --tree before=/path/to/old/src --tree after=src [--rounds 200]

The first tree is the baseline. Each tree's ``.pyc`` files are written by warm-up runs first.
``--catalog`` times loading the built-in catalog instead (``catalog.builtin()``: every family
module, what activation loads after the engine), to see what new families cost.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench import clean_env, interleave, report, run, summary

TIMED = (
    "import time; t = time.perf_counter(); import verl_npu_autopatch.engine.lifecycle; print(time.perf_counter() - t)"
)
CATALOG_CODE = (
    "import time; import verl_npu_autopatch.engine.lifecycle; from verl_npu_autopatch.engine import catalog; "
    "t = time.perf_counter(); catalog.builtin(); print(time.perf_counter() - t)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True)
    parser.add_argument("--tree", action="append", required=True, help="NAME=SRC_DIR (the first is the baseline)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--catalog", action="store_true", help="time catalog.builtin() instead")
    args = parser.parse_args()
    code = CATALOG_CODE if args.catalog else TIMED
    trees = dict(item.split("=", 1) for item in args.tree)

    def timed(src: str):
        env = clean_env(PYTHONPATH=os.path.abspath(src))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        return lambda: float(run([args.python, "-S", "-c", code], env=env))

    variants = {name: timed(src) for name, src in trees.items()}
    for measure in variants.values():  # write the .pyc files
        measure(), measure()
    samples = interleave(variants, args.rounds)
    table = summary(samples, next(iter(trees)), "ms", 1e3)
    title = "catalog.builtin()" if args.catalog else "import verl_npu_autopatch.engine.lifecycle"
    report(f"{title} (python -S)", {"import": table}, {"rounds": args.rounds}, args.json)


if __name__ == "__main__":
    main()
