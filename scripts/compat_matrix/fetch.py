"""Release files from PyPI's simple index: downloaded once (never installed), sha256-checked
against the index, cached under ``.cache/upstream/`` (``VERL_NPU_AUTOPATCH_UPSTREAM_CACHE``), and
the few source files the patches read extracted into a cached tree; the index's newer releases.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("VERL_NPU_AUTOPATCH_UPSTREAM_CACHE", ROOT / ".cache" / "upstream"))
INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class Artifact:
    """One file on PyPI: a wheel or an sdist of ``project`` ``version``."""

    project: str
    version: str
    filename: str

    @property
    def sdist(self) -> bool:
        return self.filename.endswith(".tar.gz")


def index_json(project: str) -> dict[str, Any]:
    """The PyPI simple-index page of ``project`` (PEP 691 JSON: ``files``, ``versions``)."""
    request = urllib.request.Request(f"{INDEX}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def _index_sha256(artifact: Artifact) -> tuple[str, str]:
    """``(url, sha256)`` of ``artifact`` from the PyPI simple index (PEP 691 JSON)."""
    for entry in index_json(artifact.project)["files"]:
        if entry["filename"] == artifact.filename:
            return entry["url"], entry["hashes"]["sha256"]
    raise LookupError(f"{artifact.filename} is not in the PyPI index of {artifact.project}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(artifact: Artifact, cache: Path = CACHE) -> Path:
    """The verified local copy of ``artifact``: downloaded once, sha256-checked against the index.

    The index's sha256 is kept next to the file; a cached file is re-hashed against it on reuse.
    """
    target = cache / "files" / artifact.filename
    sidecar = target.with_name(target.name + ".sha256")
    if target.exists() and sidecar.exists() and _sha256(target) == sidecar.read_text().strip():
        return target
    url, expected = _index_sha256(artifact)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    with urllib.request.urlopen(url, timeout=600) as response, partial.open("wb") as out:
        while block := response.read(1 << 20):
            out.write(block)
    found = _sha256(partial)
    if found != expected:
        partial.unlink()
        raise ValueError(f"{artifact.filename}: sha256 {found} does not match the index's {expected}")
    partial.replace(target)
    sidecar.write_text(expected + "\n")
    return target


def extract(artifact: Artifact, wanted: tuple[str, ...], cache: Path = CACHE) -> Path:
    """Extract ``wanted`` (package-relative paths) from the artifact into a cached source tree.

    Files the release does not have are simply absent from the tree. Returns the tree's root. The
    tree keeps what earlier calls extracted (verl's runtime rules read a few files of the tree the
    verl watch extracts whole), so ``.extracted`` lists the union.
    """
    root = cache / "src" / f"{artifact.project}-{artifact.version}"
    done = root / ".extracted"
    extracted = set(done.read_text().split()) if done.exists() else set()
    if set(wanted) <= extracted:
        return root
    archive = download(artifact, cache)
    prefix = "" if not artifact.sdist else f"{artifact.filename[: -len('.tar.gz')]}/"
    members: dict[str, bytes] = {}
    if artifact.sdist:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                name = member.name.removeprefix(prefix)
                if member.isfile() and name in wanted:
                    members[name] = tar.extractfile(member).read()  # type: ignore[union-attr]
    else:
        with zipfile.ZipFile(archive) as wheel:
            for name in wheel.namelist():
                if name in wanted:
                    members[name] = wheel.read(name)
    for name, data in members.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".part")
        partial.write_bytes(data)
        os.replace(partial, path)  # a new file: a hard-linked copy of the cache keeps its own
    done.parent.mkdir(parents=True, exist_ok=True)
    listed = done.with_name(".extracted.part")
    listed.write_text("\n".join(sorted(extracted | set(wanted))) + "\n")
    os.replace(listed, done)  # a new file too: a hard-linked copy of the cache never lists files it lacks
    return root


def newer_versions(project: str, than: str) -> list[str]:
    """Every release of ``project`` on the index newer than ``than``, oldest first (pre-releases
    included: vllm-ascend ships mostly release candidates; development builds left out)."""
    from packaging.version import InvalidVersion, Version

    found = []
    for text in index_json(project).get("versions") or []:
        try:
            version = Version(text)
        except InvalidVersion:  # a legacy version string on the index: no release to compare
            continue
        if version > Version(than) and not version.is_devrelease:
            found.append(version)
    return [str(v) for v in sorted(found)]


def index_artifact(project: str, version: str, prefer: tuple[str, ...]) -> Artifact:
    """The file of ``project`` ``version`` to read: the first filename ending in ``prefer``
    (e.g. a pure-Python or cp311 x86_64 wheel), else the sdist."""
    files = [f["filename"] for f in index_json(project)["files"]]
    stem = f"{project.replace('-', '_')}-{version}"
    mine = [f for f in files if f.startswith((stem + "-", stem + ".tar.gz"))]
    for suffix in (*prefer, ".tar.gz"):
        for name in mine:
            if name.endswith(suffix):
                return Artifact(project, version, name)
    raise LookupError(f"no readable file of {project} {version} on the index")
