"""The committed ``.pth`` line is the one ``pth_line.render()`` makes from ``WATCHED`` (in-process:
no venv). Regenerate it with ``PYTHONPATH=src python3 -m verl_npu_autopatch.bootstrap.pth_line >
verl_npu_autopatch.pth``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from verl_npu_autopatch.bootstrap import pth_line, startup

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_pth_line_is_the_rendered_one() -> None:
    assert (ROOT / "verl_npu_autopatch.pth").read_text(encoding="utf-8") == pth_line.render()


def test_the_rendered_line_is_one_line_whose_placeholder_watches_exactly_watched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    line = pth_line.render()
    assert line.count("\n") == 1 and line.endswith("\n") and line.startswith("import ")  # site runs it as code
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the placeholder goes on a copy
    exec(line, {})
    placeholder: Any = sys.meta_path[0]
    assert getattr(placeholder, startup.PLACEHOLDER) is True
    assert sorted(placeholder.find_spec.__kwdefaults__["w"].split()) == sorted(startup.WATCHED)
    # a miss and a part of a watched name give None without importing anything
    assert placeholder.find_spec("json") is None and placeholder.find_spec("torch") is None
