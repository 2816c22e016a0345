"""The release and drift workflows run the checks the release depends on."""

from __future__ import annotations

from tests.support.children import ROOT


def test_release_workflow_runs_the_checks() -> None:
    workflow = (ROOT / ".github" / "workflows" / "release.yml").read_text(encoding="utf-8")
    for step in ("twine check", "scripts/check-wheel dist/*.whl", "verl-npu-autopatch doctor"):
        assert step in workflow
    drift = (ROOT / ".github" / "workflows" / "drift.yml").read_text(encoding="utf-8")
    assert "schedule:" in drift and "scripts/compat-matrix --latest" in drift
