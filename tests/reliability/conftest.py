"""The reliability suite reuses the engine suite's session fixtures (wheel, child venvs)."""

from __future__ import annotations

from tests.engine.conftest import PYTHONS, any_python, base_python, wheel  # noqa: F401
