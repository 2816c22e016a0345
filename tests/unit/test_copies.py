"""``Patch.copies``: the engine rebinds the copies of a patched module-level name that other
modules took with ``from ... import`` (real files, real import statements), declares them as
sites, re-checks them and restores each on revert."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import contract
from verl_npu_autopatch import cli, ownership
from verl_npu_autopatch._config import Config
from verl_npu_autopatch.engine import Engine
from verl_npu_autopatch.patching import marked_by, set_marked
from verl_npu_autopatch.spec import Patch, Site, Target, Undo

SOURCE = "autopatch_copies_src"
PACKAGE = "autopatch_copies_pkg"
OUTSIDE = "autopatch_copies_outside"
FILES = {
    f"{SOURCE}.py": "def greet():\n    return 'upstream'\n",
    f"{PACKAGE}/__init__.py": f"from {SOURCE} import greet\n",
    f"{PACKAGE}/early.py": f"from {SOURCE} import greet as hello\n\ndef run():\n    return hello()\n",
    f"{PACKAGE}/late.py": f"from {SOURCE} import greet\n",
    f"{OUTSIDE}.py": f"from {SOURCE} import greet\n",
}


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, ModuleType]]:
    """The source module and the copying modules imported before any fix (``late`` is not)."""
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = (SOURCE, PACKAGE, f"{PACKAGE}.early", OUTSIDE)
    yield {name: importlib.import_module(name) for name in names}
    for name in (*names, f"{PACKAGE}.late"):
        sys.modules.pop(name, None)


def _fix(site: Site) -> Undo:
    def greet() -> str:
        return "fixed"

    return set_marked(site.owner, site.attribute, greet, site.patch.name)


PATCH = Patch(
    "test.copies",
    "Replaces greet, and its copies in the package.",
    targets=(Target(SOURCE, "greet"),),
    fix=_fix,
    copies=(PACKAGE,),
    device="any",
)


def _engine() -> Engine:
    engine = Engine([PATCH], Config(device="npu"))
    engine.activate("test")
    return engine


def test_copies_taken_before_the_fix_are_rebound_and_declared(modules: dict[str, ModuleType]) -> None:
    upstream = modules[SOURCE].greet
    engine = _engine()
    assert engine.report().records[0].state == "applied"
    fixed = modules[SOURCE].greet
    assert marked_by(fixed) == PATCH.name
    assert modules[PACKAGE].greet is fixed and modules[f"{PACKAGE}.early"].hello is fixed
    assert modules[f"{PACKAGE}.early"].run() == "fixed"  # the copy is what the module's code calls
    assert modules[OUTSIDE].greet is upstream  # outside the declared packages: left alone
    assert set(ownership.declared_values(PATCH)) == {f"{PACKAGE}:greet", f"{PACKAGE}.early:hello"}
    assert engine.revert() == [PATCH.name]
    assert (modules[SOURCE].greet, modules[PACKAGE].greet, modules[f"{PACKAGE}.early"].hello) == (upstream,) * 3


def test_a_module_imported_after_the_fix_reads_the_fix_and_revert_restores_it(
    modules: dict[str, ModuleType],
) -> None:
    upstream = modules[SOURCE].greet
    engine = _engine()
    late = importlib.import_module(f"{PACKAGE}.late")
    assert late.greet is modules[SOURCE].greet and marked_by(late.greet) == PATCH.name
    assert f"{PACKAGE}.late:greet" in ownership.declared_values(PATCH)
    assert engine.revert() == [PATCH.name]
    assert late.greet is upstream


def test_a_displaced_copy_supersedes_the_record_and_is_never_clobbered(modules: dict[str, ModuleType]) -> None:
    engine = _engine()
    early = modules[f"{PACKAGE}.early"]

    def others() -> str:
        return "another owner's"

    fixed, early.hello = early.hello, others
    (record,) = engine.report().records
    assert (record.state, record.reason.split(", now")[0]) == ("superseded", f"also changes {PACKAGE}.early:hello")
    assert engine.revert() == [] and early.hello is others
    early.hello = fixed  # ours again: the record is applied, and revert() takes it all back
    assert engine.revert() == [PATCH.name] and early.hello is not fixed


def test_the_contract_checks_the_copies(modules: dict[str, ModuleType]) -> None:
    finding = contract.check_contract(PATCH)
    assert finding.changed == {f"{SOURCE}:greet", f"{PACKAGE}:greet", f"{PACKAGE}.early:hello"}


def test_the_contract_fails_a_fix_that_leaves_a_copy_behind(
    modules: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the engine's rebinding the copies keep upstream's function: the contract says where."""
    monkeypatch.setattr("verl_npu_autopatch._copies.rebind", lambda site, undo: undo)
    with pytest.raises(AssertionError, match=f"copies of the replaced value left at .*{PACKAGE}:greet"):
        contract.check_contract(PATCH)


def test_copies_are_shown_and_only_module_level_targets_may_declare_them() -> None:
    assert cli.touches(PATCH)[-1] == f"also changes {PACKAGE}.*:<copies of the target> (found in the live modules)"
    assert cli._markdown_site(cli.touches(PATCH)[-1]).startswith(f"also changes `{PACKAGE}.*:<copies of the target>` (")
    with pytest.raises(ValueError, match="module-level targets only"):
        Patch("test.bad", "A method has no copies.", (Target(SOURCE, "Cls.meth"),), _fix, copies=(PACKAGE,))
