"""The tiers: plain ``pytest`` collects the fast tier (``testpaths``); a run that reaches a slow
suite whose environment is missing stops before collecting anything, naming each such suite's
environment and how to get it (``tests/support/tiers.py``, docs/testing.md)."""

from __future__ import annotations

import pytest

from tests.support import tiers


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    problems = tiers.unmet_in_scope(session.config.args)
    if problems:
        tiers.stop(problems)
