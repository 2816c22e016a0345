"""docs/reliability.md names every case of the adversarial rounds' test files (fast tier: the
files are read, not run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The round-5 test files whose every case docs/reliability.md names (``test_`` left off).
ROUND_5 = ("tests/reliability/test_report_dir.py", "tests/reliability/test_round5_errors.py")
ROUND_5 += ("tests/engine/test_fleet_hostile.py",)


@pytest.mark.parametrize("path", ROUND_5)
def test_reliability_md_names_every_round_5_case(path: str) -> None:
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    cases = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    assert cases, path
    assert [name for name in cases if f"`{name.removeprefix('test_')}`" not in text] == []
