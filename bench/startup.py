"""Idle start-up: ``python -c pass`` in a venv with vs without verl-npu-autopatch, and, in the
same run, the kvcached pattern (a ``.pth`` line ``import wrapt``) and autowrapt 2.0 (the smallest
``.pth`` start-up hook we know: one small module, no classes, no module-level imports).

Four venvs are made from the same base interpreter with ``--without-pip`` (identical but for
what is installed): *plain*; *package* (the wheel and its dependencies, installed by pip, which
byte-compiles them as any install does); *wrapt-pth* (wrapt plus a ``.pth`` holding ``import
wrapt``); *autowrapt* (``autowrapt==2.0.0`` from PyPI and its dependency wrapt, installed the
same way). Measured in interleaved rounds: the wall time and child CPU time of ``python -c pass``,
and, in-process, how long ``site.main()`` (the ``.pth`` processing) takes.

    python3 bench/startup.py --python .envs/runner-3.11-*/bin/python [--wheel dist/x.whl] [--rounds 300]
        [--compare other.whl]

``--compare`` adds a fifth venv, *compare*, with another build of the package (e.g. the main
branch's), measured in the same interleaved rounds: the paired difference *package - compare*
is what a change costs at start-up.

``--floors`` adds three venvs installed like *package* whose ``verl_npu_autopatch.pth`` holds
instead: a comment only (what ``site`` reading the file costs), ``import os`` (the cheapest line
that runs anything), and a line that puts a do-nothing lambda finder on ``sys.meta_path`` (the
least any ``.pth`` start-up hook can cost): the floors under the package's own figure, measured
in the same interleaved rounds.

``--python`` must have pip >= 22.3 (``pip --python``); the venvs use its base interpreter.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _bench import ROOT, clean_env, interleave, purelib, report, run, spawn_timed, summary

#: The autowrapt release the *autowrapt* venv installs.
AUTOWRAPT = "autowrapt==2.0.0"
SITE_MAIN = "import time; t = time.perf_counter(); import site; site.main(); print(time.perf_counter() - t)"
#: ``--floors``: ``.pth`` contents under the package's line, each in a venv of its own.
FLOORS = {
    "floor: comment-only .pth": "# site reads this file and runs nothing\n",
    "floor: import os": "import os\n",
    "floor: do-nothing finder": (
        "import sys; sys.meta_path.insert(0, type(sys.implementation)(find_spec=lambda *a: None))\n"
    ),
}


def make_venvs(
    python: str, wheel: Path, where: Path, compare: Path | None = None, floors: bool = False
) -> dict[str, Path]:
    """The four venvs (five with ``compare``, three more with ``floors``); returns ``{variant: its python}``."""
    base = run([python, "-c", "import sys; print(sys._base_executable)"]).strip()
    found = {}
    extra = (("compare",) if compare else ()) + (tuple(FLOORS) if floors else ())
    for number, name in enumerate(("plain", "package", "wrapt-pth", "autowrapt", *extra)):
        run([base, "-m", "venv", "--without-pip", where / str(number)])
        found[name] = where / str(number) / "bin" / "python"
    pip = [python, "-m", "pip", "--python"]
    for name in ("package", *(FLOORS if floors else ())):
        run([*pip, found[name], "install", "-q", "--disable-pip-version-check", wheel])
    if compare:
        run([*pip, found["compare"], "install", "-q", "--disable-pip-version-check", compare])
    run([*pip, found["wrapt-pth"], "install", "-q", "--disable-pip-version-check", "wrapt"])
    run([*pip, found["autowrapt"], "install", "-q", "--disable-pip-version-check", AUTOWRAPT])
    (purelib(found["wrapt-pth"]) / "kvcached_like.pth").write_text("import wrapt\n")
    for name, content in FLOORS.items() if floors else ():
        (purelib(found[name]) / "verl_npu_autopatch.pth").write_text(content)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="interpreter with pip (its base makes the venvs)")
    parser.add_argument("--wheel", type=Path, help="the wheel (default: the newest in dist/)")
    parser.add_argument("--compare", type=Path, help="another wheel of the package, measured alongside")
    parser.add_argument("--floors", action="store_true", help="also measure the floors under the .pth line")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    wheel = args.wheel or max((ROOT / "dist").rglob("verl_npu_autopatch-*.whl"), key=lambda p: p.stat().st_mtime)
    where = Path(tempfile.mkdtemp(prefix="vna-bench-startup-"))
    try:
        pythons = make_venvs(args.python, wheel, where, args.compare, args.floors)
        env = clean_env()

        def wall(python: Path, *flags: str) -> tuple[float, float]:
            seconds, cpu, _ = spawn_timed([str(python), *flags, "-c", "pass"], env)
            return seconds, cpu

        def site_main(python: Path) -> float:
            return float(spawn_timed([str(python), "-S", "-c", SITE_MAIN], env)[2])

        cpu: dict[str, list[float]] = {name: [] for name in pythons}

        def timed(name: str) -> float:
            seconds, used = wall(pythons[name])
            cpu[name].append(used)
            return seconds

        for name in pythons:  # warm the page cache
            wall(pythons[name])
            site_main(pythons[name])
        walls = interleave({name: functools.partial(timed, name) for name in pythons}, args.rounds)
        sites = interleave({name: functools.partial(site_main, p) for name, p in pythons.items()}, args.rounds)
        tables = {
            "process wall time of `python -c pass` (ms)": summary(walls, "plain", "ms", 1e3),
            "child CPU time (user+sys) of `python -c pass` (ms)": summary(cpu, "plain", "ms", 1e3),
            "in-process `site.main()` (.pth processing) (ms)": summary(sites, "plain", "ms", 1e3),
        }
        pair = ("autowrapt", "package")
        tables["package vs autowrapt: `site.main()` (ms)"] = summary(
            {k: sites[k] for k in pair}, "autowrapt", "ms", 1e3
        )
        if args.compare:
            pair = ("compare", "package")
            tables["package vs compare: wall (ms)"] = summary({k: walls[k] for k in pair}, "compare", "ms", 1e3)
            tables["package vs compare: child CPU (ms)"] = summary({k: cpu[k] for k in pair}, "compare", "ms", 1e3)
            tables["package vs compare: `site.main()` (ms)"] = summary(
                {k: sites[k] for k in pair}, "compare", "ms", 1e3
            )
        report(
            "Idle start-up: python -c pass",
            tables,
            {
                "python": run([pythons["plain"], "-c", "import sys; print(sys.version.split()[0])"]).strip(),
                "wheel": wheel.name,
                "compare": args.compare.name if args.compare else "-",
                "rounds": args.rounds,
            },
            args.json,
        )
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
