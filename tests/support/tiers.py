"""Which environment each slow suite needs, and one clear message when it runs elsewhere.

The fast tier (``tests/unit``, plain ``pytest``) needs only the package, wrapt, packaging and
pytest. ``tests/engine`` and ``tests/reliability`` run anywhere (they build their own child
venvs). The suites below import heavy upstream packages; run in an environment without them,
they stop the run naming the environment of ``tests/support/venvs.py`` that has them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

#: suite directory under tests/ -> (environment in ``venvs.SPECS``, top-level modules it provides)
SUITES: dict[str, tuple[str, tuple[str, ...]]] = {
    "ray": ("runner", ("ray",)),
    "hf": ("hf", ("torch", "transformers", "liger_kernel")),
    "vllm": ("vllm", ("torch", "vllm")),
    "ascend": ("vllm", ("torch", "vllm")),
    "verl": ("verl", ("torch", "tensordict")),
}


def unmet(suite: str) -> str | None:
    """Why ``tests/<suite>`` cannot run in this interpreter and how to run it, or ``None``."""
    env, modules = SUITES[suite]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (
        f"tests/{suite} runs in the {env!r} environment ({', '.join(missing)} not installed here): "
        f"PY=$(python3 tests/support/venvs.py ensure {env}) && $PY -m pytest -p no:cacheprovider tests/{suite}"
    )


def stop(messages: list[str]) -> None:
    """Stop the run with ``messages`` and the two commands that need no choice of environment."""
    hint = "(`bash scripts/test` runs every suite in its environment; plain `pytest` runs the fast tier)"
    raise pytest.UsageError("\n".join([*messages, hint]))


def require(conftest: str) -> None:
    """Stop the run, before the suite of ``conftest`` imports what this environment lacks."""
    message = unmet(Path(conftest).resolve().parent.name)
    if message is not None:
        stop([message])


def unmet_in_scope(args: list[str]) -> list[str]:
    """The message of every suite that the paths ``args`` collect and this interpreter cannot run."""
    paths = [Path(arg.partition("::")[0]).resolve() for arg in args]
    found = []
    for suite in SUITES:
        folder = TESTS / suite
        if any(path.is_relative_to(folder) or folder.is_relative_to(path) for path in paths):
            message = unmet(suite)
            if message is not None:
                found.append(message)
    return found
