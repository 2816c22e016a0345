"""``import torch`` on an NPU host, where torch's device-backend autoload imports torch_npu: the
start-up observer wakes there (``torch_npu`` is watched), so activation happens inside
``import torch``.

Run it with the python of a venv with torch and the package (the ``verl`` test env):

    python3 bench/torch_autoload.py --python .envs/verl-3.11-*/bin/python [--rounds 20]

A temporary directory on ``PYTHONPATH`` holds the torch_npu test double of ``tests/verl/standin``
(NOT the real torch_npu: it wraps ``torch.nested.nested_tensor`` / ``as_nested_tensor`` like
torch_npu <= 2.6 and does nothing else) and a ``torch_npu`` dist-info whose entry point
``torch.backends: torch_npu = torch_npu:_autoload`` is the one the real wheels declare. Fresh
processes, interleaved rounds; each child times ``import torch`` in-process:

- *no backend*: the double is not on the path (for scale);
- *off*: the double is autoloaded, ``VERL_NPU_AUTOPATCH=0`` (the baseline);
- *inactive*: autoloaded, ``VERL_NPU_AUTOPATCH_DEVICE=none`` (the observer wakes and steps aside);
- *active*: autoloaded, device ``auto`` (torch_npu found: the engine activates inside
  ``import torch``, loads the catalog, imports wrapt and applies the nested-tensor patch).

A multi-second ``import torch`` on a loaded 2-core VM hides millisecond effects, so it also times
the activation directly (``DIRECT`` below: wall and CPU time, next to ``import torch`` in the same
process, and their ratio), as ``bench/import_vllm.py`` does for vLLM.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _bench import ROOT, clean_env, interleave, median, report, spawn_timed, summary

STANDIN = ROOT / "tests" / "verl" / "standin" / "torch_npu"

CHILD = """
import sys, time, json
t = time.perf_counter()
import torch
dt = time.perf_counter() - t
state = "-"
if "verl_npu_autopatch.engine.lifecycle" in sys.modules:
    report = sys.modules["verl_npu_autopatch.engine.lifecycle"].report()
    state = report.status + ", " + ", ".join(
        f"{r.name}: {r.state}" for r in report.records if r.name == "torch_npu.nested_tensor_intercept"
    )
print(json.dumps([dt, "torch_npu" in sys.modules, state, "wrapt" in sys.modules]))
"""

#: The activation alone, in one process: torch (and with it the torch_npu double) imported with
#: the package off, then switched on and activated; catalog, gates, wrapt, hooks and the
#: nested-tensor patch on the already imported torch_npu, i.e. what the active path adds inside
#: ``import torch``.
DIRECT = """
import os, sys, time, json
t = time.perf_counter(); cpu = time.process_time()
import torch, verl_npu_autopatch
torch_wall, torch_cpu = time.perf_counter() - t, time.process_time() - cpu
del os.environ["VERL_NPU_AUTOPATCH"]
t = time.perf_counter(); cpu = time.process_time()
verl_npu_autopatch.activate()
wall, used = time.perf_counter() - t, time.process_time() - cpu
report = verl_npu_autopatch.report()
state = report.status + ", " + ", ".join(
    f"{r.name}: {r.state}" for r in report.records if r.name == "torch_npu.nested_tensor_intercept"
)
print(json.dumps([[wall, used, torch_wall, torch_cpu], "torch_npu" in sys.modules, state, "wrapt" in sys.modules]))
"""


def backend_dir(where: Path) -> Path:
    """The torch_npu double plus a dist-info declaring torch's autoload entry point."""
    shutil.copytree(STANDIN, where / "torch_npu", ignore=shutil.ignore_patterns("__pycache__"))
    info = where / "torch_npu-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return where


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="python of a venv with torch and the package")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    where = Path(tempfile.mkdtemp(prefix="vna-bench-autoload-"))
    seen: dict[str, set[str]] = {}
    try:
        path = str(backend_dir(where))

        def child(name: str, code: str = CHILD, **env: str) -> Any:
            elapsed, npu, state, wrapt = json.loads(spawn_timed([args.python, "-c", code], clean_env(**env))[2])
            seen.setdefault(name, set()).add(f"torch_npu imported: {npu}; engine: {state}; wrapt imported: {wrapt}")
            return elapsed

        variants = {
            "no backend": {},
            "off": {"PYTHONPATH": path, "VERL_NPU_AUTOPATCH": "0"},
            "inactive": {"PYTHONPATH": path, "VERL_NPU_AUTOPATCH_DEVICE": "none"},
            "active": {"PYTHONPATH": path},
        }
        for env in variants.values():  # warm the page cache
            child("warm", **env)
        seen.clear()
        samples = interleave(
            {name: functools.partial(child, name, **env) for name, env in variants.items()}, args.rounds
        )
        times = [child("direct", DIRECT, PYTHONPATH=path, VERL_NPU_AUTOPATCH="0") for _ in range(args.rounds)]
        names = ("activate(), wall", "activate(), CPU", "import torch, wall", "import torch, CPU")
        direct = {name: [sample[index] for sample in times] for index, name in enumerate(names)}
        share = [a / b for a, _, b, _ in times], [a / b for _, a, _, b in times]
        report(
            "import torch with the torch_npu backend autoloaded",
            {
                "`import torch`, in-process (ms)": summary(samples, "off", "ms", 1e3),
                "activation alone vs import torch, same processes (ms)": summary(direct, names[2], "ms", 1e3),
            },
            {
                "python": args.python,
                "rounds": args.rounds,
                "activate() / import torch (median of per-process ratios), wall": round(median(share[0]), 4),
                "activate() / import torch (median of per-process ratios), CPU": round(median(share[1]), 4),
                "children saw": {k: sorted(v) for k, v in seen.items()},
            },
            args.json,
        )
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
