"""Run code in real child interpreters and read back what they saw."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_SITE = ROOT / "tests" / "fixtures" / "site"
NPU_STACK = ROOT / "tests" / "fixtures" / "npu_stack"


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without this project's variables or PYTHONPATH, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VERL_NPU_AUTOPATCH", "VERL_VLLM_ASCEND", "AUTOPATCH_FIXTURE")) and k != "PYTHONPATH"
    }
    env.update(extra)
    return env


def run(
    python: Path | str,
    code: str,
    *,
    env: dict[str, str] | None = None,
    fixtures: bool = True,
    args: tuple[str, ...] = (),
    timeout: float = 120,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``python [args] -c code``; the fixture packages are on PYTHONPATH unless disabled."""
    child_env = clean_env(**(env or {}))
    if fixtures:
        paths = [str(FIXTURE_SITE), *filter(None, [child_env.get("PYTHONPATH")])]
        child_env["PYTHONPATH"] = os.pathsep.join(paths)
    proc = subprocess.run(
        [str(python), *args, "-c", code], env=child_env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}")
    return proc


def run_json(python: Path | str, code: str, **kwargs) -> dict:
    """Run code that ends by printing one JSON document on its last line; return it."""
    proc = run(python, code, **kwargs)
    return json.loads(proc.stdout.strip().splitlines()[-1])
