"""Fixtures shared by the in-process tests."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_counter = itertools.count()


@pytest.fixture
def module_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh importable module ``unit_target_N`` with ``class Box: def value(self): return 1``."""
    name = f"unit_target_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text("class Box:\n    def value(self):\n        return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
