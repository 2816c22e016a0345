"""The release and drift workflows run the checks the release depends on, and the release publishes
what the build job built, from a tag only."""

from __future__ import annotations

import re

from tests.support.children import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"


def _jobs(text: str) -> dict[str, str]:
    """Each job of the workflow's ``jobs:`` mapping, by name, as its text (no YAML parser: the fast
    tier needs none); a job is the lines from its two-space-indented key to the next one."""
    body = text.split("\njobs:\n", 1)[1]
    found: dict[str, str] = {}
    name = ""
    for line in body.splitlines():
        key = re.fullmatch(r"  ([\w-]+):\s*", line)
        if key:
            name = key.group(1)
            found[name] = ""
        elif name and (line.startswith("    ") or not line.strip()):
            found[name] += line + "\n"
        elif line.strip() and not line.startswith("  #"):
            break  # a top-level key after jobs
    return found


def _steps_using(job: str, action: str) -> list[str]:
    """The text of each step of ``job`` that ``uses: <action>@...``."""
    steps = re.split(r"\n(?=      - )", job)
    return [step for step in steps if re.search(rf"uses: {re.escape(action)}@", step)]


def test_release_workflow_runs_the_checks() -> None:
    workflow = WORKFLOW.read_text(encoding="utf-8")
    build = _jobs(workflow)["build"]
    for step in ("twine check", "scripts/check-wheel dist/*.whl", "verl-npu-autopatch doctor"):
        assert step in build
    drift = (ROOT / ".github" / "workflows" / "drift.yml").read_text(encoding="utf-8")
    assert "schedule:" in drift and "scripts/compat-matrix --latest" in drift


def test_publish_job_uploads_the_built_dist_from_a_tag_only() -> None:
    workflow = WORKFLOW.read_text(encoding="utf-8")
    jobs = _jobs(workflow)
    assert set(jobs) == {"build", "publish"}
    assert 'tags: ["v*"]' in workflow  # the trigger the publish condition narrows to
    (upload,) = _steps_using(jobs["build"], "actions/upload-artifact")
    assert "name: dist" in upload and "path: dist/" in upload  # sdist and wheel: `python -m build --sdist --wheel`
    assert "--sdist --wheel --outdir dist" in jobs["build"]

    publish = jobs["publish"]
    assert re.search(r"^    needs: build$", publish, re.M)  # nothing unchecked is published
    (condition,) = re.findall(r"^    if: (.+)$", publish, re.M)
    assert condition == "github.event_name == 'push' && startsWith(github.ref, 'refs/tags/v')"
    assert re.search(r"^    environment:\n      name: pypi$", publish, re.M)
    assert re.search(r"^    permissions:\n      id-token: write$", publish, re.M)  # trusted publishing, no token
    assert "password:" not in publish and "secrets." not in publish
    (download,) = _steps_using(publish, "actions/download-artifact")
    assert "name: dist" in download and "path: dist/" in download
    (pypi,) = _steps_using(publish, "pypa/gh-action-pypi-publish")
    assert "packages-dir: dist/" in pypi
    assert publish.index("actions/download-artifact") < publish.index("pypa/gh-action-pypi-publish")
