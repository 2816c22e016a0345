"""Fixtures for the tensordict / torch_npu / megatron-core patch tests (env ``verl``: CPU torch
2.13 and the real tensordict 0.9.1; other releases' files come from ``scripts/compat-matrix``'s
sha256-checked download cache)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ascend"))  # upstream.py (load_subset, matrix_script)

import tensordict  # noqa: F401  (the process-wide engine decides "inactive" now: no torch_npu here)

from verl_npu_autopatch import engine as process_engine
from verl_npu_autopatch.engine import Engine

assert process_engine.report().status == "inactive", process_engine.report().reason


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Private engines made by ``helpers.start``; settled and reverted after the test (their
    import hooks then find nothing pending)."""
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.settle(engine.pending_modules())
        engine.revert()
