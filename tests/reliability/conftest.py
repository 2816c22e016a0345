"""The reliability suite reuses the engine suite's session fixtures (wheel, child venvs)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.conftest import PYTHONS, any_python, base_python, wheel  # noqa: F401
