"""A module dropped into ``patches/`` joins the catalog (last, and a test fails until ``catalog.FAMILIES`` lists
it); a ``_private`` one does not."""

from __future__ import annotations

import pkgutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from verl_npu_autopatch import patches
from verl_npu_autopatch.engine import catalog

FAMILY = """
from verl_npu_autopatch.authoring.spec import Patch, Target

PATCHES = [
    Patch(
        name="dropped.example",
        summary="A family nobody listed anywhere.",
        targets=(Target.parse("vllm.dropped_example:Layer.forward"),),
        fix=lambda site: (lambda: None),
    )
]
"""
HELPER = "PATCHES = 'a helper module is not a family'\n"


@pytest.fixture
def dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``patches/`` with two more files on its search path: ``zz_dropped.py`` and ``_zz_helper.py``."""
    (tmp_path / "zz_dropped.py").write_text(FAMILY)
    (tmp_path / "_zz_helper.py").write_text(HELPER)
    monkeypatch.setattr(patches, "__path__", [*patches.__path__, str(tmp_path)])
    yield tmp_path
    for name in ("zz_dropped", "_zz_helper"):
        sys.modules.pop(f"{catalog.PACKAGE}.{name}", None)


def test_a_new_public_module_is_in_the_catalog(dropped: Path) -> None:
    found = [m.__name__ for m in catalog.families()]
    assert found == [f"{catalog.PACKAGE}.{name}" for name in (*catalog.FAMILIES, "zz_dropped")]  # not in FAMILIES: last
    assert f"{catalog.PACKAGE}._zz_helper" not in sys.modules  # helpers are not even imported
    assert [p.name for p in catalog.builtin()][-1] == "dropped.example"
    assert "dropped.example" in {p.name for p in catalog.load().patches}


def test_without_it_the_catalog_order_is_the_families_order() -> None:
    names = [m.__name__.rpartition(".")[2] for m in catalog.families()]
    assert names == list(catalog.FAMILIES)  # the order docs/patches.md lists them in


def test_every_family_module_is_in_the_one_ordered_list() -> None:
    on_disk = {m.name for m in pkgutil.iter_modules(patches.__path__) if not m.name.startswith("_")}
    assert on_disk - set(catalog.FAMILIES) == set(), "a family module missing from catalog.FAMILIES"
    assert set(catalog.FAMILIES) - on_disk == set(), "catalog.FAMILIES names a module patches/ does not have"
    assert len(set(catalog.FAMILIES)) == len(catalog.FAMILIES)
    assert [m for m in catalog.families() if hasattr(m, "ORDER")] == []  # one list, no order per module
