"""verl's own NPU runtime patch sites (``scripts/verl_sites.py``) per release, against the parity
table of ``docs/verl.md``.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import verl_sites

from compat_matrix import fetch
from compat_matrix.fetch import CACHE, ROOT, Artifact, download, extract

VERL_DOC = ROOT / "docs" / "verl.md"
#: The verl releases read (oldest first; the last is the one docs/verl.md's parity table is
#: written for), and the heading of that table.
VERL_VERSIONS = ("0.8.0", "0.9.0", "0.9.1")
PARITY_HEADING = "## Parity with verl 0.9.1"


def verl_root(artifact: Artifact, cache: Path = CACHE) -> Path:
    """Every ``verl/**.py`` of a verl wheel, extracted (downloaded once, sha256-checked)."""
    with zipfile.ZipFile(download(artifact, cache)) as wheel:
        names = tuple(n for n in wheel.namelist() if n.startswith("verl/") and n.endswith(".py"))
    return extract(artifact, names, cache)


def parity_rows(doc: Path = VERL_DOC) -> list[tuple[list[str], str]]:
    """The parity table's rows: ``[(verl files, target cell)]``."""
    return verl_sites.parity_rows(doc.read_text(encoding="utf-8"), PARITY_HEADING)


@dataclass
class VerlWatch:
    """verl's NPU runtime patch sites (``scripts/verl_sites.py``) per release, against the parity
    table of ``docs/verl.md``: a release newer than the last column with a site no row names fails
    the drift watch."""

    title: str = "verl NPU runtime patch sites"
    project: str = "verl"
    columns: tuple[Artifact, ...] = tuple(Artifact("verl", v, f"verl-{v}-py3-none-any.whl") for v in VERL_VERSIONS)

    def artifact(self, version: str) -> Artifact:
        return fetch.index_artifact(self.project, version, ("py3-none-any.whl",))

    def sites(self, artifact: Artifact, cache: Path = CACHE) -> list[Any]:
        return verl_sites.sites(verl_root(artifact, cache))

    def drift(self, version: str, cache: Path = CACHE) -> list[str]:
        """One line per site of release ``version`` that no parity row names."""
        found = verl_sites.unlisted(self.sites(self.artifact(version), cache), parity_rows())
        return [f"verl {version}: a new NPU runtime patch site, not in docs/verl.md's parity table: {s}" for s in found]

    def render(self, cache: Path = CACHE) -> str:
        """The document's section: every site of each column, and the parity row that names it."""
        rows = parity_rows()
        present: dict[tuple[str, str], dict[str, Any]] = {}
        for artifact in self.columns:
            for site in self.sites(artifact, cache):
                present.setdefault((site.file, site.target), {})[artifact.version] = site
        labels = [a.version for a in self.columns]
        lines = [
            "",
            f"## {self.title}",
            "",
            "Every assignment to another package's attribute under an NPU guard in verl's released",
            "source (wheels from PyPI, read with `ast` by `scripts/verl_sites.py`), and the row of",
            "[verl.md](verl.md#parity-with-verl-091)'s parity table that names it. `--latest` fails",
            "when a verl release newer than the last column has a site that no row names.",
            "",
            "| site | " + " | ".join(labels) + " | parity row |",
            "|---|" + "---|" * len(labels) + "---|",
        ]
        for (file, target), by_version in present.items():
            number = verl_sites.row_of(next(iter(by_version.values())), rows)
            row = str(number) if number else "not listed"
            marks = " | ".join("yes" if v in by_version else "–" for v in labels)  # noqa: RUF001  (the document's dash)
            lines.append(f"| `{file}`: `{target}` | {marks} | {row} |")
        return "\n".join(lines) + "\n"


VERL = VerlWatch()
