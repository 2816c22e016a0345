"""The patch contract: one procedure every built-in patch must pass wherever its target imports.

Each suite's ``test_*_contract.py`` runs :func:`check_contract` for every patch of the catalog
whose target modules import in that suite's environment (:func:`live_patches`), and, in
``tests/verl``, on each release a registered loader loads (``release_loaders.py``). The procedure,
on the real upstream modules, through the engine's own pipeline (``decision.run``):

1. decide: the check's verdict; anything but ``applied`` must leave every declared module as it was;
2. fix: the attributes the fix changed (the declared modules and their classes and dict entries,
   and every imported module of the packages ``copies`` names, compared by identity before and
   after) are exactly the declared sites: the variant applied, the ``secondary`` targets, the
   ``computed`` sites found in the live module and the ``copies`` of the target; no module of
   those packages still holds the value the fix replaced;
3. marker: every value the fix left at a changed site is marked with the patch's name, except at a
   copy site (a global of a ``copies`` package taken with ``from ... import``): a copy is correct
   when it holds exactly the live value of its source attribute (for our own fix that value is
   the marked one; for a patch declaring ``stale``, the value another owner put there);
4. already in place: deciding again changes nothing and installs no second undo;
5. undo restores exactly: every declared module is again as it was before the fix, value for value;
6. apply again: the same sites change again, and the second undo restores them again.

dd-trace-py's ``PatchTestCase`` runs one base over many import/patch orders per integration; this
is the same idea for the spec this package has (the decision, the declared sites, the undo).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from verl_npu_autopatch.authoring.patching import marked_by
from verl_npu_autopatch.authoring.spec import Patch, Target
from verl_npu_autopatch.engine import catalog, decision, ownership
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.ownership import THROUGH_TARGET, declared_values
from verl_npu_autopatch.engine.records import Record


class QuietHandOver:
    """The engine as a fix that arbitrates sees it, with no other patch in this process."""

    def record(self, name: str) -> Record | None:
        return None

    def note(self, name: str, text: str) -> None:
        pass

    def yield_to(self, name: str, owner: str) -> bool:
        return False

    def reapply(self, name: str, when: Any) -> bool:
        return False


def config_for(patch: Patch) -> Config:
    """A configuration under which ``patch`` is decided as on an NPU host, opt-in ones included."""
    return Config(device="npu", enable=frozenset({patch.name}))


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # not installed here, or broken without its device: not this suite's patch
        return False
    return True


def live_patches(patches: Iterable[Patch] | None = None) -> list[Patch]:
    """The patches (default: the built-in catalog) whose gates pass here and one of whose
    variants imports, with every further declared module."""
    found = []
    for patch in catalog.builtin() if patches is None else patches:
        plan = decision.plan(patch, config_for(patch))
        if plan.state != "pending":
            continue
        extra = {t.module for t in (*patch.reach.secondary, *patch.targets)}  # a computed family may be absent here
        variant = next((t for t in plan.variants if _imports(t.module)), None)
        if variant is not None and all(_imports(m) for m in extra - {t.module for t in patch.targets}):
            found.append(patch)
    return found


def _declared_modules(patch: Patch) -> list[ModuleType]:
    names = [t.module for t in (*patch.hooks, *patch.targets, *patch.reach.secondary)] + [
        c.module for c in patch.reach.computed
    ]
    names += [m.__name__ for m in ownership.holders(patch.reach.copies_in)]
    return [importlib.import_module(n) for n in dict.fromkeys(names) if _imports(n)]


def _holders(module: ModuleType, patch: Patch) -> dict[str, Any]:
    """The classes of ``module`` whose attributes a site may be: those defined there, and every
    class or module on the path of a declared target in it (``torch_npu:torch.nested.x``)."""
    holders: dict[str, Any] = {
        n: v for n, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__
    }
    for target in (*patch.targets, *patch.reach.secondary):
        if target.module != module.__name__:
            continue
        holder: Any = module
        parts = target.qualname.split(".")
        for depth, part in enumerate(parts[:-1]):
            holder = getattr(holder, part, None)
            if isinstance(holder, (type, ModuleType)):
                holders[".".join(parts[: depth + 1])] = holder
    return holders


def snapshot(patch: Patch) -> dict[str, Any]:
    """``module:path`` -> raw value, for every attribute of the declared modules, of their classes
    (``Cls.attr``) and every string-keyed entry of their dicts (``NAME[key]``). Submodules bound
    by the import system and dunder names are left out: an import, not a fix, sets those. The
    declared further sites are read too, wherever they are (``Cls.NAME[key]``)."""
    values: dict[str, Any] = {}
    for module in _declared_modules(patch):
        prefix = module.__name__
        for name, value in vars(module).items():
            if name.startswith("__") or isinstance(value, ModuleType):
                continue
            values[f"{prefix}:{name}"] = value
            if isinstance(value, dict):
                for key, entry in list(value.items()):
                    if isinstance(key, str):
                        values[f"{prefix}:{name}[{key}]"] = entry
        for path, cls in _holders(module, patch).items():
            for name, value in vars(cls).items():
                if not name.startswith("__") or name == "__init__":
                    values[f"{prefix}:{path}.{name}"] = value
    return {**values, **declared_values(patch)}


def changed(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """The paths whose value is not the same object (or is there on one side only)."""
    return {k for k in before.keys() | after.keys() if before.get(k, before) is not after.get(k, after)}


def declared(patch: Patch, target: Target, undo: Any) -> set[str]:
    """The sites the fix of ``patch`` declares it changes, with ``target`` the variant applied.
    A fix whose undo says it is reached only through the target (``reached_through_target``:
    the transformers experts, registered in transformers' experts interface) leaves the target
    as it is and changes its ``computed`` sites only."""
    through = getattr(undo, THROUGH_TARGET, False)
    hooked = [] if through or target in patch.reach.triggers else [str(target)]  # a trigger is read, not changed
    return {*hooked, *declared_values(patch)}


@dataclass
class Finding:
    """What the contract found for one patch: the first decision and the sites the fix changed."""

    state: str
    reason: str
    changed: set[str] = field(default_factory=set)


def _run(patch: Patch) -> decision.Outcome:
    plan = decision.plan(patch, config_for(patch))
    return decision.run(patch, plan.variants, plan.versions, None, config_for(patch), handover=QuietHandOver())


def check_contract(patch: Patch) -> Finding:
    """Run the contract on ``patch`` here; an ``AssertionError`` names the clause it breaks."""
    before = snapshot(patch)
    first = _run(patch)
    assert first.state != "failed", f"{patch.name}: {first.reason}"
    if first.state != "applied":
        assert changed(before, snapshot(patch)) == set(), f"{patch.name}: {first.state} yet changed its modules"
        return Finding(first.state, first.reason)
    assert first.undo is not None and first.target is not None, f"{patch.name}: applied without a fix"
    try:
        installed = snapshot(patch)
        touched = changed(before, installed)
        assert touched == declared(patch, first.target, first.undo), f"{patch.name}: changed {sorted(touched)}"
        sources = ownership.sites(patch)  # the copy sites: each holds its source attribute's live value
        unmarked = sorted(p for p in touched - sources.keys() if _marked(installed.get(p)) != patch.name)
        assert not unmarked, f"{patch.name}: left unmarked values (nor a copy of a live source) at {unmarked}"
        replaced = before.get(str(first.target))
        copy_paths = [p for p in installed if ownership.within(p.partition(":")[0], patch.reach.copies_in)]
        stale = sorted(p for p in copy_paths if replaced is not None and installed[p] is replaced)
        stale += ownership.left_behind(patch)
        assert not stale, f"{patch.name}: copies of the replaced value left at {stale}"
        again = _run(patch)
        assert (again.state, again.undo) == ("applied", None), f"{patch.name}: decided again: {again.reason}"
        assert again.reason.startswith("already in place"), again.reason
        assert changed(installed, snapshot(patch)) == set(), f"{patch.name}: deciding again changed a site"
    finally:
        first.undo()
    restored = snapshot(patch)
    assert changed(before, restored) == set(), f"{patch.name}: undo left {sorted(changed(before, restored))}"
    second = _run(patch)
    assert second.state == "applied" and second.undo is not None, f"{patch.name}: not applied again: {second.reason}"
    try:
        assert changed(before, snapshot(patch)) == touched, f"{patch.name}: applied again elsewhere"
    finally:
        second.undo()
    assert changed(before, snapshot(patch)) == set(), f"{patch.name}: the second undo did not restore"
    return Finding("applied", first.reason, touched)


def _marked(value: Any) -> str | None:
    """The patch a raw site value is marked by (a ``staticmethod``'s function, a property's getter)."""
    if isinstance(value, property):
        value = value.fget
    return marked_by(value) if value is not None and not inspect.ismodule(value) else None
