"""Generated docs are current in the fast tier: docs/patches.md is what ``list --markdown`` prints
for the built-in catalog (the engine tier checks the same through the installed command)."""

from __future__ import annotations

import re
from pathlib import Path

from verl_npu_autopatch.cli import main as cli

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_docs_patches_md_is_current() -> None:
    built_in = [e for e in cli.catalog_data() if e["defined_at"].startswith("verl_npu_autopatch/")]
    assert (DOCS / "patches.md").read_text(encoding="utf-8") == cli.catalog_markdown(built_in), (
        "docs/patches.md is stale: run `verl-npu-autopatch list --markdown > docs/patches.md`"
    )


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor GitHub makes of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        if fenced or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_every_relative_link_resolves() -> None:
    pages = [DOCS.parent / "README.md", DOCS.parent / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_index_lists_every_page_once_users_first() -> None:
    text = (DOCS / "index.md").read_text(encoding="utf-8")
    users = text.split("## For users", 1)[1].split("\n## ", 1)[0]
    maintainers = text.split("## For maintainers", 1)[1]
    listed = [m for part in (users, maintainers) for m in re.findall(r"^\| \[([\w.-]+\.md)\]", part, re.M)]
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    assert sorted(listed) == pages  # each page once, none missing
    assert text.index("## Quick start") < text.index("## For users") < text.index("## For maintainers")
    for page in ("compatibility.md", "performance.md", "internals.md", "testing.md", "writing-a-patch.md"):
        assert f"| [{page}]" in maintainers
