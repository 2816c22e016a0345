"""Per-import cost of the start-up hook for unrelated imports.

Run it with the python of a venv where verl-npu-autopatch is installed (its ``.pth`` line puts the
placeholder on ``sys.meta_path`` at start-up; the observer takes its place at the first watched
import):

    .envs/base-3.11-*/bin/python bench/finder.py [--modules 2000] [--rounds 60]

1. Paired: import N fresh tiny modules (byte-compiled, in a temporary directory on ``sys.path``)
   with the placeholders (a venv's two: ``site`` reads the ``.pth`` twice), one placeholder, or the
   observer at the front of ``sys.meta_path`` vs with nothing there, in interleaved rounds; the
   per-import difference is (median A - median B) / N.
   A fourth variant puts a do-nothing finder there instead: what any extra meta-path entry costs
   (the import system takes its lock around each finder look-up).
2. Direct: the placeholder's and the observer's ``find_spec`` miss (an unrelated name), timed in a
   tight loop, next to a no-op method with the same signature (the loop and call overhead), so
   the net cost is the difference. Each call looks ``find_spec`` up on the finder first, as the
   import system does (for an object, that makes a bound method).

Both also time the layout not taken: a module on ``sys.meta_path`` whose ``find_spec`` is the
observer's bound method, as the start-up module was the observer before the ``Observer`` object.

``--compare PYTHON`` (a venv with another build, e.g. the main branch's) adds, in interleaved
rounds of fresh processes, the installed observer's miss in each venv, whatever the layout
(the finder marked ``verl_npu_autopatch_observer`` once the first watched name was looked up).
"""

from __future__ import annotations

import argparse
import compileall
import importlib
import shutil
import sys
import tempfile
import time
import timeit
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench import clean_env, interleave, median, report, run, summary

#: A child's installed-observer miss (s per call, the look-up included), whatever the layout.
OBSERVER_MISS = """
import importlib.util, sys, timeit
importlib.util.find_spec("vllm")  # the first watched name: the observer takes the placeholder's place
f = next(f for f in sys.meta_path if getattr(f, "verl_npu_autopatch_observer", False))
print(timeit.timeit("f.find_spec('vna_unrelated_name')", globals={"f": f}, number=1_000_000) / 1_000_000)
"""


def hooks() -> tuple[list[object], object]:
    """The placeholders the ``.pth`` line put on ``sys.meta_path``, taken off, and the observer
    (the start-up module's, loaded here, not installed)."""
    found = [f for f in sys.meta_path if getattr(f, "verl_npu_autopatch_placeholder", False)]
    if not found:
        raise SystemExit("no placeholder on sys.meta_path: run this with the python of a venv that has the package")
    sys.meta_path[:] = [f for f in sys.meta_path if f not in found]
    from verl_npu_autopatch.bootstrap.startup import OBSERVER

    return found, OBSERVER


def as_module(observer: object) -> types.ModuleType:
    """The layout not taken: a module on ``sys.meta_path`` holding the observer's bound ``find_spec``."""
    module = types.ModuleType("vna_bench_observer_module")
    module.__dict__["find_spec"] = observer.find_spec
    return module


class NoOp:
    """Same call shape as the observer's ``find_spec``; does nothing."""

    def find_spec(self, fullname, path=None, target=None):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--compare", help="another venv's python: its installed observer's miss, paired")
    args = parser.parse_args(argv)
    placeholders, observer = hooks()
    placeholder = placeholders[0]
    where = Path(tempfile.mkdtemp(prefix="vna-bench-finder-"))
    names = [f"vna_bench_mod_{i:05d}" for i in range(args.modules)]
    try:
        for name in names:
            (where / f"{name}.py").write_text("VALUE = 1\n")
        compileall.compile_dir(str(where), quiet=1)
        sys.path.insert(0, str(where))
        importlib.invalidate_caches()

        noop = NoOp()
        module = as_module(observer)
        loops = 1_000_000

        def miss(finder: object) -> float:
            """One ``find_spec`` miss, the look-up included, per call (s)."""
            return timeit.timeit("f.find_spec('vna_unrelated_name')", globals={"f": finder}, number=loops) / loops

        def import_all(*front: object) -> float:
            for name in names:
                sys.modules.pop(name, None)
            sys.meta_path[:0] = front
            start = time.perf_counter()
            for name in names:
                __import__(name)
            elapsed = time.perf_counter() - start
            del sys.meta_path[: len(front)]
            return elapsed / len(names)

        import_all(placeholder)  # warm: directory listing cached, pyc files in the page cache
        samples = interleave(
            {
                f"{len(placeholders)} placeholder(s) installed (this venv)": lambda: import_all(*placeholders),
                "one placeholder installed": lambda: import_all(placeholder),
                "observer installed": lambda: import_all(observer),
                "observer's find_spec in a module installed": lambda: import_all(module),
                "no-op finder installed": lambda: import_all(noop),
                "nothing installed": lambda: import_all(),
            },
            args.rounds,
        )

        direct = interleave(
            {
                "placeholder find_spec miss": lambda: miss(placeholder),
                "observer find_spec miss": lambda: miss(observer),
                "observer's find_spec in a module, miss": lambda: miss(module),
                "no-op find_spec (loop + call)": lambda: miss(noop),
            },
            max(5, args.rounds // 6),
        )
        tables = {"find_spec miss, per call (µs)": summary(direct, "no-op find_spec (loop + call)", "us", 1e6)}
        if args.compare:
            env = clean_env()
            pythons = {"this venv's observer, miss": sys.executable, "compare venv's observer, miss": args.compare}
            tables["installed observer's miss in a fresh process, per call (µs)"] = summary(
                interleave(
                    {
                        name: lambda python=python: float(run([python, "-c", OBSERVER_MISS], env=env))
                        for name, python in pythons.items()
                    },
                    max(5, args.rounds // 3),
                ),
                "compare venv's observer, miss",
                "us",
                1e6,
            )
        net = median(direct["placeholder find_spec miss"]) - median(direct["no-op find_spec (loop + call)"])
        per_import = median(samples["one placeholder installed"]) - median(samples["nothing installed"])
        report(
            "Start-up hook cost per unrelated import",
            {
                f"importing {args.modules} fresh tiny modules, per import (µs)": summary(
                    samples, "nothing installed", "us", 1e6
                ),
                **tables,
            },
            {
                "python": sys.version.split()[0],
                "per_import_overhead_us": round(per_import * 1e6, 4),
                "find_spec_miss_net_us": round(net * 1e6, 4),
                "modules": args.modules,
                "rounds": args.rounds,
            },
            args.json,
        )
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
