"""The fleet report's two costs.

1. ``verl-npu-autopatch fleet DIR`` over N process files (default 10,000): one real report file
   is written by a child interpreter (the fixture packages, ``VERL_NPU_AUTOPATCH_DEVICE=npu``), then
   copied N times as a job's processes on 64 other hosts would write it: Ray workers, vLLM
   EngineCores and workers and a driver, 1 % with a failed patch and 5 % with a patch decided
   otherwise. Timed as users run it, a fresh ``python -m verl_npu_autopatch fleet`` process each
   time: the first screen, ``--all`` and ``--json`` (output to a pipe, read whole).
2. Activation with ``VERL_NPU_AUTOPATCH_REPORT_DIR`` set against unset, paired in fresh processes:
   in-process time of ``activate()`` + ``import vllm.model`` + ``import autopatch_target`` (the
   fixture packages: activation, the catalog, and two more decisions, each a rewrite), and one
   rewrite alone (median of 200 in one process).

    python3 bench/fleet.py --python .envs/base-3.11-*/bin/python [--processes 10000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench import FIXTURE_SITE, clean_env, interleave, report, spawn_timed, summary

ACTIVATE = """
import json, os, sys, time
writer = [0.0, 0.0, 0]  # importing the writer (s), inside its refreshes (s), refreshes
if os.environ.get("VERL_NPU_AUTOPATCH_REPORT_DIR"):
    t = time.perf_counter()
    from verl_npu_autopatch.engine import report_file  # what activation imports first (json with it)
    writer[0] = time.perf_counter() - t
    changed = report_file.ReportFile.changed
    def timed(self):
        t = time.perf_counter()
        changed(self)
        writer[1] += time.perf_counter() - t
        writer[2] += 1
    report_file.ReportFile.changed = timed
t = time.perf_counter()
import verl_npu_autopatch
verl_npu_autopatch.activate()
import vllm.model, autopatch_target
dt = time.perf_counter() - t + writer[0]  # the writer's import, taken out of the window above, put back
loaded = "verl_npu_autopatch.engine.report_file" in sys.modules
print(json.dumps([dt, verl_npu_autopatch.report().status, loaded, "json" in sys.modules, *writer]))
"""

REWRITE = """
import json, os, statistics, time, verl_npu_autopatch
from verl_npu_autopatch.engine import lifecycle as engine
from verl_npu_autopatch.engine.report_file import ReportFile
verl_npu_autopatch.activate()
import vllm.model
writer = ReportFile(engine.engine(), os.environ["BENCH_DIR"])
times = []
for _ in range(200):
    writer._written = (0, None)  # as if a decision changed (nothing written yet)
    t = time.perf_counter()
    writer.changed()
    times.append(time.perf_counter() - t)
print(json.dumps([statistics.median(times), len(engine.engine().records)]))
"""

TITLES = ["ray::WorkerDict.actor_rollout_generate_sequences"] * 6 + ["VLLM::EngineCore"] + ["VLLM::Worker_TP0"] * 4


def fleet_dir(python: str, count: int, directory: Path) -> dict[str, object]:
    """``count`` report files in ``directory``, copies of one real file with varied identities."""
    real = directory / "real"
    env = clean_env(
        PYTHONPATH=str(FIXTURE_SITE), VERL_NPU_AUTOPATCH_DEVICE="npu", VERL_NPU_AUTOPATCH_REPORT_DIR=str(real)
    )
    subprocess.run([python, "-c", "import vllm.model, autopatch_target"], env=env, check=True)
    [path] = real.glob("*.json")
    template = json.loads(path.read_text())
    files = directory / "fleet"
    files.mkdir()
    rng = random.Random(32)
    now = time.time()
    for index in range(count):
        data = json.loads(json.dumps(template))
        title = "python3 -m verl.trainer.main_ppo" if index == 0 else TITLES[index % len(TITLES)]
        data.update(host=f"node-{index % 64:03d}", pid=10_000 + index, start=index, written=now, title=title)
        roll = rng.random()
        if roll < 0.01:
            data["records"][-1].update(state="failed", reason="fix raised KeyError: 'w13'")
        elif roll < 0.06:  # a gated patch turned off in these
            data["records"][2].update(state="disabled", reason="turned off by VERL_NPU_AUTOPATCH_DISABLE")
        name = f"{data['host']}-{data['pid']}-{data['start']}.json"
        (files / name).write_text(json.dumps(data, separators=(",", ":")))
    return {"files": count, "bytes per file": path.stat().st_size, "records per file": len(template["records"])}


def timed_fleet(python: str, directory: Path, *args: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run([python, "-m", "verl_npu_autopatch", "fleet", str(directory), *args], capture_output=True)
    if proc.returncode not in (0, 1):
        raise RuntimeError(proc.stderr.decode())
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="python of a venv with the package")
    parser.add_argument("--processes", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5, help="fleet runs per variant")
    parser.add_argument("--activation-rounds", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--activation-only", action="store_true", help="skip the fleet runs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as temp:
        made = fleet_dir(args.python, 0 if args.activation_only else args.processes, Path(temp))
        files = Path(temp) / "fleet"
        reading = (
            {}
            if args.activation_only
            else interleave(
                {
                    "fleet DIR": functools.partial(timed_fleet, args.python, files),
                    "fleet DIR --all": functools.partial(timed_fleet, args.python, files, "--all"),
                    "fleet DIR --json": functools.partial(timed_fleet, args.python, files, "--json"),
                    "python -c pass": lambda: timed_fleet_pass(args.python),
                },
                args.rounds,
            )
        )
        seen: set[str] = set()
        inside: dict[str, list[float]] = {"writer, all": [], "importing it (json with it)": [], "its refreshes": []}

        def child(report_dir: str | None) -> float:
            extra = {"VERL_NPU_AUTOPATCH_REPORT_DIR": report_dir} if report_dir else {}
            env = clean_env(PYTHONPATH=str(FIXTURE_SITE), VERL_NPU_AUTOPATCH_DEVICE="npu", **extra)
            out = spawn_timed([args.python, "-c", ACTIVATE], env, quiet=True)[2]
            elapsed, status, loaded, json_loaded, importing, writing, writes = json.loads(out)
            seen.add(
                f"REPORT_DIR {'set' if report_dir else 'unset'}: engine {status}, writer loaded: {loaded}, "
                f"json loaded after activation: {json_loaded}"
            )
            if report_dir:
                seen.add(f"refreshes (the first at activation) per process: {writes}")
                for name, value in zip(inside, (importing + writing, importing, writing), strict=True):
                    inside[name].append(value)
            return elapsed

        writes = Path(temp) / "writes"
        activation = interleave(
            {
                "REPORT_DIR unset": functools.partial(child, None),
                "REPORT_DIR set": functools.partial(child, str(writes)),
            },
            args.activation_rounds,
        )
        env = clean_env(PYTHONPATH=str(FIXTURE_SITE), VERL_NPU_AUTOPATCH_DEVICE="npu", BENCH_DIR=str(writes))
        rewrite, records = json.loads(spawn_timed([args.python, "-c", REWRITE], env, quiet=True)[2])
    report(
        "The fleet report: reading N process files, and the writer's cost at activation",
        {
            **(
                {}
                if args.activation_only
                else {
                    f"fleet over {args.processes:,} process files, fresh processes (s)": summary(
                        reading, "python -c pass", "s", 1
                    )
                }
            ),
            "activate() + import vllm.model + autopatch_target, fresh processes (ms)": summary(
                activation, "REPORT_DIR unset", "ms", 1e3
            ),
            "of which in the writer, REPORT_DIR set (ms)": summary(inside, "writer, all", "ms", 1e3),
        },
        {
            "python": args.python,
            "made": made,
            "rounds": args.rounds,
            "activation rounds": args.activation_rounds,
            "one rewrite, median of 200 (ms)": round(rewrite * 1e3, 4),
            "records in the rewritten file": records,
            "children saw": sorted(seen),
            "temporary directory (the files)": tempfile.gettempdir(),
        },
        args.json,
    )
    return 0


def timed_fleet_pass(python: str) -> float:
    start = time.perf_counter()
    subprocess.run([python, "-c", "pass"], check=True)
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
