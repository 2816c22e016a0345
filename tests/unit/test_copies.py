"""``Reach.copies_in``: the engine rebinds the copies of a patched module-level name that other
modules took with ``from ... import`` (real files, real import statements), declares them as
sites, re-checks them and restores each on revert; with ``Reach.stale_values``, the copies another
owner's replacement of the name left behind (rebound to that owner's value, unmarked)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import contract
from verl_npu_autopatch.authoring.family import copies_only
from verl_npu_autopatch.authoring.patching import marked_by, set_marked
from verl_npu_autopatch.authoring.spec import Patch, Reach, Site, Target, Undo
from verl_npu_autopatch.cli import main as cli
from verl_npu_autopatch.engine import ownership
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.lifecycle import Engine

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
    reach=Reach(copies_in=(PACKAGE,)),
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


class _NoNamespace(ModuleType):
    @property
    def __dict__(self) -> dict:  # type: ignore[override]
        raise RuntimeError("a proxy's namespace")


@pytest.mark.parametrize("odd", ["a key that is not a string", "a module whose namespace raises"])
def test_foreign_entries_of_sys_modules_leave_the_copies_rebound(
    modules: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch, odd: str
) -> None:
    # the scan of sys.modules raised after the fix went in: `failed` while the fix ran, no undo kept
    if odd.startswith("a key"):
        monkeypatch.setitem(sys.modules, ("not", "a", "name"), sys)  # type: ignore[arg-type]
    else:
        monkeypatch.setitem(sys.modules, f"{PACKAGE}.proxy", _NoNamespace(f"{PACKAGE}.proxy"))
    engine = _engine()
    assert engine.report().records[0].state == "applied"
    assert modules[f"{PACKAGE}.early"].run() == "fixed"
    assert engine.revert() == [PATCH.name]
    assert modules[SOURCE].greet() == "upstream" and modules[f"{PACKAGE}.early"].run() == "upstream"


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
    monkeypatch.setattr("verl_npu_autopatch.engine.ownership.rebind", lambda site, undo: undo)
    with pytest.raises(AssertionError, match=f"copies of the replaced value left at .*{PACKAGE}:greet"):
        contract.check_contract(PATCH)


def test_copies_are_shown_and_only_module_level_targets_may_declare_them() -> None:
    assert cli.touches(PATCH)[-1] == f"also changes {PACKAGE}.*:<copies of the target> (found in the live modules)"
    assert cli._markdown_site(cli.touches(PATCH)[-1]).startswith(f"also changes `{PACKAGE}.*:<copies of the target>` (")
    with pytest.raises(ValueError, match="module-level targets only"):
        Patch(
            "test.bad",
            "A method has no copies.",
            (Target(SOURCE, "Cls.meth"),),
            _fix,
            reach=Reach(copies_in=(PACKAGE,)),
        )


# ----------------------------------------------------------------------------- another owner's value
OWNER = "autopatch_copies_owner"
OWNER_TEXT = (
    f"import {SOURCE} as _source\n\n_original_greet = _source.greet\n\n"
    "def greet():\n    return 'owner'\n\n_source.greet = greet\n"
)


def _earlier() -> dict[Target, object]:
    owner = sys.modules.get(OWNER)
    return {} if owner is None else {Target(SOURCE, "greet"): owner._original_greet}


STALE = Patch(
    "test.stale_copies",
    "Rebinds the copies another owner's replacement of greet left behind.",
    targets=(Target(SOURCE, "greet"),),
    reach=Reach(triggers=(Target(OWNER, "__file__"),), copies_in=(PACKAGE,), stale_values=_earlier),
    fix=copies_only,
    device="any",
)


@pytest.fixture
def owner(modules: dict[str, ModuleType], tmp_path: Path) -> Iterator[ModuleType]:
    """Another owner's module replacing ``greet`` in the source module, after the copies were taken."""
    (tmp_path / f"{OWNER}.py").write_text(OWNER_TEXT, encoding="utf-8")
    yield importlib.import_module(OWNER)
    sys.modules.pop(OWNER, None)


def _stale_engine() -> Engine:
    engine = Engine([STALE], Config(device="npu"))
    engine.activate("test")
    return engine


def test_copies_another_owner_left_stale_are_rebound_to_its_value(
    modules: dict[str, ModuleType], owner: ModuleType
) -> None:
    upstream, early = owner._original_greet, modules[f"{PACKAGE}.early"]
    assert early.hello is upstream and early.run() == "upstream"  # the stale copy the bug is about
    engine = _stale_engine()
    record = engine.report().records[0]
    assert (record.state, record.reason) == ("applied", "fix installed")
    assert modules[PACKAGE].greet is owner.greet and early.hello is owner.greet and early.run() == "owner"
    assert marked_by(owner.greet) is None  # the copies hold the other owner's value as it is
    assert modules[OUTSIDE].greet is upstream
    assert set(ownership.declared_values(STALE)) == {f"{PACKAGE}:greet", f"{PACKAGE}.early:hello"}
    late = importlib.import_module(f"{PACKAGE}.late")  # taken after the other owner's replacement
    assert engine.revert() == [STALE.name]
    assert (modules[PACKAGE].greet, early.hello, modules[SOURCE].greet) == (upstream, upstream, owner.greet)
    assert late.greet is owner.greet  # not ours to restore


def test_a_copy_displaced_after_the_rebinding_supersedes_the_record(
    modules: dict[str, ModuleType], owner: ModuleType
) -> None:
    engine = _stale_engine()
    early = modules[f"{PACKAGE}.early"]
    rebound, early.hello = early.hello, print
    (record,) = engine.report().records
    assert (record.state, record.reason.split(", now")[0]) == ("superseded", f"also changes {PACKAGE}.early:hello")
    assert engine.revert() == [] and early.hello is print
    early.hello = rebound  # ours again: revert() takes it back (and the engine stops watching)
    assert engine.revert() == [STALE.name] and early.hello is owner._original_greet


def test_no_stale_copy_leaves_nothing_to_rebind(modules: dict[str, ModuleType], owner: ModuleType) -> None:
    for module in (modules[PACKAGE], modules[f"{PACKAGE}.early"]):
        for name, value in list(vars(module).items()):
            if value is owner._original_greet:
                setattr(module, name, owner.greet)
    engine = _stale_engine()
    record = engine.report().records[0]
    expected = f"already in place: no copy in {PACKAGE} holds a replaced value"
    assert (record.state, record.reason) == ("applied", expected)
    engine.revert()  # nothing to undo; the engine stops watching the owner's module


def test_the_contract_takes_another_owners_value_in_a_copy(modules: dict[str, ModuleType], owner: ModuleType) -> None:
    assert contract.check_contract(STALE).changed == {f"{PACKAGE}:greet", f"{PACKAGE}.early:hello"}


def test_the_contract_fails_a_stale_patch_that_leaves_a_copy_behind(
    modules: dict[str, ModuleType], owner: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("verl_npu_autopatch.engine.ownership.rebind", lambda site, undo: undo)
    with pytest.raises(AssertionError, match=f"copies of the replaced value left at .*{PACKAGE}"):
        contract.check_contract(STALE)


def test_stale_values_need_copies() -> None:
    with pytest.raises(ValueError, match="stale_values is declared for copies only"):
        Patch("test.bad", "No copies.", (Target(SOURCE, "greet"),), copies_only, reach=Reach(stale_values=dict))
