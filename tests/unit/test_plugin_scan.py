"""The plugin scan reads ``sys.path`` itself (``catalog._distributions``): it must find what
``importlib.metadata`` finds, in the same order (the first distribution of a name wins), in folders
and in archives on the path."""

from __future__ import annotations

import zipfile
from importlib.metadata import Prepared, distributions, entry_points
from pathlib import Path

import pytest

from verl_npu_autopatch.authoring import Patch
from verl_npu_autopatch.engine import catalog, environment

GROUP = catalog.ENTRY_POINT_GROUP


def _dist_info(root: Path, folder: str, entry_points_text: str | None) -> None:
    info = root / folder
    info.mkdir(parents=True)
    name, _, version = folder.removesuffix(".dist-info").partition("-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points_text is not None:
        (info / "entry_points.txt").write_text(entry_points_text)


def _scanned() -> dict[str, list[str]]:
    found: catalog.Catalog[Patch] = catalog.Catalog([])
    listed = catalog._entry_points(found)
    assert found.errors == []
    return {name: [point.value for point in points] for name, points in listed}


def test_the_scan_names_every_distribution_importlib_names() -> None:
    scanned = [name for name, _ in catalog._distributions()]
    assert set(scanned) == {dist._normalized_name for dist in distributions()}  # type: ignore[attr-defined]


def test_first_of_a_name_on_the_path_wins_as_in_importlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    _dist_info(first, "Demo.Plugin-1.0.dist-info", f"[{GROUP}]\ndemo = demo_first\n")
    _dist_info(second, "demo_plugin-2.0.dist-info", f"[{GROUP}]\ndemo = demo_second\n")
    _dist_info(second, "other_plugin-1.0.dist-info", f"[console_scripts]\nx = y:z\n\n[{GROUP}]\nother = other_mod\n")
    _dist_info(second, "bare-1.0.dist-info", None)
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(first))
    assert _scanned() == {"demo_plugin": ["demo_first"], "other_plugin": ["other_mod"]}
    assert sorted(point.value for point in entry_points(group=GROUP)) == ["demo_first", "other_mod"]


def test_a_plugin_in_an_archive_on_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = tmp_path / "plugins.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("zipped_plugin-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: zipped_plugin\n")
        zipped.writestr("zipped_plugin-1.0.dist-info/entry_points.txt", f"[{GROUP}]\nzipped = zipped_mod\n")
    monkeypatch.syspath_prepend(str(archive))
    assert _scanned() == {"zipped_plugin": ["zipped_mod"]}


def test_malformed_entry_points_of_a_plugin_are_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _dist_info(tmp_path, "broken_plugin-1.0.dist-info", f"[{GROUP}]\nnot an entry point line\n")
    _dist_info(tmp_path, "unrelated-1.0.dist-info", "[console_scripts]\nnot an entry point line\n")  # never parsed
    monkeypatch.syspath_prepend(str(tmp_path))
    found: catalog.Catalog[Patch] = catalog.Catalog([])
    assert catalog._entry_points(found) == []
    assert [label for label, _, _ in found.errors] == ["distribution:broken_plugin"]


def test_versions_read_from_the_same_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_npu_autopatch.engine import environment

    _dist_info(tmp_path / "first", "Scan.Demo-3.1.dist-info", None)
    _dist_info(tmp_path / "second", "scan_demo-9.9.dist-info", None)
    archive = tmp_path / "zipped.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr(
            "zipped_demo-2.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: zipped_demo\nVersion: 2.0\n"
        )
    for entry in ("second", "first"):
        monkeypatch.syspath_prepend(str(tmp_path / entry))
    monkeypatch.setattr(environment, "_versions", {})
    assert environment.distribution_version("scan-demo") == "3.1"  # the first folder's
    assert environment.distribution_version("absent-demo") is None
    monkeypatch.syspath_prepend(str(archive))
    assert environment.distribution_version("zipped_demo") == "2.0"


def test_names_are_normalized_as_importlib_normalizes_them() -> None:
    # the fast path (no separator to fold) and the regular expression give importlib's names
    names = ["vllm", "Vllm_Ascend", "vllm-ascend", "zope.interface", "a__b", "A___B", "x-_.y", "_a_", "a--b", "Ab"]
    assert [environment.normalized_name(n) for n in names] == [Prepared.normalize(n) for n in names]
