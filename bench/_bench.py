"""Shared helpers of the benchmarks (standard library only).

Every benchmark is paired: the variants run in interleaved rounds (A, B, C, A, B, C, ...; the
order rotates each round), so machine load drifts hit all of them alike; results are medians.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_SITE = ROOT / "tests" / "fixtures" / "site"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the project's variables and PYTHONPATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_NPU_AUTOPATCH") and k != "PYTHONPATH"}
    env.update(extra)
    return env


def spawn_timed(argv: Sequence[str], env: dict[str, str], quiet: bool = False) -> tuple[float, float, bytes]:
    """Run ``argv`` to completion: ``(wall seconds, child CPU seconds, stdout)``; ``quiet``
    sends the child's stderr to ``/dev/null``."""
    read, write = os.pipe()
    actions = [(os.POSIX_SPAWN_DUP2, write, 1), (os.POSIX_SPAWN_CLOSE, read)]
    if quiet:
        actions.append((os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0))
    start = time.perf_counter()
    pid = os.posix_spawn(argv[0], list(argv), env, file_actions=actions)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    os.close(read)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv} exited {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_utime + usage.ru_stime, b"".join(chunks)


def interleave(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Call every variant once per round, rotating the order; collect what each returns."""
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(variants[name]())
    return samples


def per_call(case: Callable[[], object], calls: int) -> Callable[[], float]:
    """A sample function: the mean seconds per call of ``calls`` calls of ``case``."""

    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            case()
        return (time.perf_counter() - start) / calls

    return run


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def summary(samples: dict[str, list[float]], baseline: str, unit: str, scale: float) -> list[dict[str, object]]:
    """Median, IQR, difference from ``baseline`` and ratio for each variant, in ``unit``
    (``scale`` converts seconds to it). The paired difference is the median over rounds of
    (this variant - baseline) within the same round, which cancels slow drifts in machine load."""
    base = median(samples[baseline])
    rows = []
    for name, values in samples.items():
        med = median(values)
        q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (med, med, med)
        paired = median([a - b for a, b in zip(values, samples[baseline], strict=True)])
        rows.append(
            {
                "variant": name,
                "n": len(values),
                f"median ({unit})": round(med * scale, 4),
                f"IQR ({unit})": round((q3 - q1) * scale, 4),
                f"difference of medians ({unit})": round((med - base) * scale, 4),
                f"median paired difference ({unit})": round(paired * scale, 4),
                "ratio of medians": round(med / base, 4) if base else None,
            }
        )
    return rows


def markdown(rows: list[dict[str, object]]) -> str:
    """A Markdown table of ``rows`` (dicts with the same keys)."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row[k]) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict[str, object]:
    """Notes on where the figures come from."""
    model = ""
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "kernel": platform.release(),
        "driver_python": sys.version.split()[0],
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE", ""),
    }


def report(title: str, tables: dict[str, list[dict[str, object]]], extra: dict[str, object], as_json: bool) -> None:
    """Print the results: Markdown tables (default) or one JSON document."""
    if as_json:
        print(json.dumps({"title": title, "machine": machine(), **extra, "tables": tables}, indent=2))
        return
    print(f"## {title}\n")
    for key, value in {**machine(), **extra}.items():
        print(f"- {key}: {value}")
    for name, rows in tables.items():
        print(f"\n### {name}\n\n{markdown(rows)}")


def run(argv: Sequence[str], **kwargs: object) -> str:
    """Run a setup command, return its stdout."""
    return subprocess.run([str(a) for a in argv], check=True, capture_output=True, text=True, **kwargs).stdout


def purelib(python: str | Path) -> Path:
    """The site-packages directory of ``python``'s venv."""
    return Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
