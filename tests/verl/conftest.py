"""Fixtures for the tensordict / torch_npu / megatron-core patch tests (env ``verl``: CPU torch
2.13 and the real tensordict 0.9.1; other releases' files come from ``scripts/compat-matrix``'s
sha256-checked download cache)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import tiers

tiers.require(__file__)  # before importing what this environment may lack

import tensordict  # noqa: E402,F401  (the process-wide engine decides "inactive" now: no torch_npu here)

from verl_npu_autopatch.engine import lifecycle as process_engine  # noqa: E402
from verl_npu_autopatch.engine.lifecycle import Engine  # noqa: E402

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
