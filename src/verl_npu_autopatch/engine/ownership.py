"""Ownership: where each applied patch installed what, re-checked against the live attribute.

An ``applied`` record is a claim about the live attribute. :func:`recheck` re-checks it whenever a
record is read: if our value is no longer what the target (or an enclosing callable it is only
reached through, ``Reach.via``, or a further declared site) holds, the record becomes ``yielded``
when one of the patch's ``yields_to`` detectors recognises the new owner, else ``superseded``
naming it, or ``superseded: module reloaded``. :class:`Reexecutions` answers re-executions of a
patched module (wrapt's hooks fire once per name), so the engine applies the fix again.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Literal

from verl_npu_autopatch.authoring.patching import ABSENT, marked_by, origin
from verl_npu_autopatch.authoring.spec import Patch, Site, Target
from verl_npu_autopatch.engine import copies

TYPE_CHECKING = False
if TYPE_CHECKING:
    from verl_npu_autopatch.authoring.handover import HandOver
    from verl_npu_autopatch.engine.records import RecordState

__all__ = [
    "THROUGH_TARGET",
    "Checks",
    "Footprint",
    "Reexecutions",
    "declared_values",
    "detect",
    "enclosing_owner",
    "installation",
    "is_ours",
    "lookup",
    "missing",
    "reached_through_target",
    "recheck",
    "site_value",
    "yielded_reason",
]

#: Attribute on an undo whose fix installed elsewhere but runs only while the target holds the
#: value the fix left there (an experts implementation the target's dispatcher looks up).
THROUGH_TARGET = "verl_npu_autopatch_through_target"

#: What :func:`recheck` expects of a :class:`Footprint`'s target: ``ours``, the fix replaced it and
#: any other value displaces us; ``through``, the fix installed elsewhere and runs only through
#: upstream's value left there, which any value but one of ours displaces; ``reload``, the fix
#: installed elsewhere and is checked for reloads only.
Checks = Literal["ours", "through", "reload"]


class Footprint:
    """What an applied patch left where: ``owner.attribute`` holding ``value`` on ``module`` (executed
    under ``spec``), the raw value of each enclosing callable it is reached through (``via``), and
    the value it left at each further declared site it changed (``also``, keyed ``module:path``)."""

    def __init__(
        self,
        target: Target,
        module: ModuleType,
        spec: Any,
        owner: Any,
        attribute: str,
        value: Any,
        reason: str,
        via: dict[Target, Any],
        checks: Checks,
        also: dict[str, Any],
    ) -> None:
        self.target, self.module, self.spec, self.owner, self.attribute = target, module, spec, owner, attribute
        self.value, self.reason, self.via, self.checks, self.also = value, reason, via, checks, also


def lookup(module: ModuleType, qualname: str) -> tuple[Any, Any] | None:
    """``(holder, raw attribute)`` of ``qualname`` in ``module``, or ``None`` when it is missing."""
    found = _walk(module, qualname)
    return found if isinstance(found, tuple) else None


def missing(module: ModuleType, qualname: str) -> str:
    """Why :func:`lookup` finds no ``qualname`` in ``module``: the first part that is not there."""
    found = _walk(module, qualname)
    return found if isinstance(found, str) else "attribute is present"


def _walk(module: ModuleType, qualname: str) -> tuple[Any, Any] | str:
    """``(holder, raw attribute)``, or why the walk stopped. The last part is read with
    ``getattr_static`` (a ``staticmethod`` stays one); a part that is ``None`` counts as missing."""
    holder: Any = module
    parts = qualname.split(".")
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        value = inspect.getattr_static(holder, part, None) if last else getattr(holder, part, None)
        if value is not None:
            if last:
                return holder, value
            holder = value
            continue
        if not hasattr(holder, part):
            where = ".".join(parts[:depth]) or module.__name__
            return f"{where} ({type(holder).__name__}) has no attribute {part!r}"
        if not last and not hasattr(None, parts[depth + 1]):
            return f"{'.'.join(parts[: depth + 1])} (NoneType) has no attribute {parts[depth + 1]!r}"
        return "attribute is None"
    raise AssertionError("unreachable: a qualname has at least one part")


def site_value(module: ModuleType, path: str) -> Any:
    """The raw live value at ``path`` in ``module``: a dotted attribute path, or ``NAME[key]`` for
    an entry of the dict at the dotted path ``NAME``; :data:`ABSENT` when there is none."""
    name, bracket, key = path.partition("[")
    if bracket:
        table = (lookup(module, name) or (None, None))[1]  # a module's dict, or a class's (``Cls.NAME``)
        return table.get(key[:-1], ABSENT) if isinstance(table, dict) else ABSENT
    found = lookup(module, path)
    return ABSENT if found is None else found[1]


def declared_values(patch: Patch) -> dict[str, Any]:
    """Each further site ``patch`` declares (``secondary``, the targets of a patch hooked on its
    ``triggers`` unless it declares ``stale``, ``computed`` and ``copies`` found live) -> its raw
    live value, keyed ``module:path``; a site whose module is not imported is left out."""
    values = {}
    reach = patch.reach
    for target in (*reach.secondary, *(patch.targets if reach.triggers and reach.stale_values is None else ())):
        module = sys.modules.get(target.module)
        if module is not None:
            values[str(target)] = site_value(module, target.qualname)
    for family in reach.computed:
        live = sys.modules.get(family.module)
        if live is not None:
            values.update({f"{family.module}:{path}": site_value(live, path) for path in family.find(live)})
    return {**values, **copies.sites(patch)}


def _lookup_in(target: Target, module: ModuleType) -> tuple[Any, Any] | None:
    """:func:`lookup` of ``target`` in ``module`` when that is its module, else in its imported module."""
    live = module if target.module == module.__name__ else sys.modules.get(target.module)
    return None if live is None else lookup(live, target.qualname)


def _via_targets(patch: Patch, target: Target) -> tuple[Target, ...]:
    """The enclosing callables of ``patch`` for the chosen variant ``target`` (not itself)."""
    return tuple(v for v in patch.reach.via if (v.module, v.qualname) != (target.module, target.qualname))


def detect(patch: Patch, site: Site) -> str | None:
    """The first other owner a ``yields_to`` detector recognises at ``site``, or ``None``."""
    for detector in patch.yields_to:
        owner = detector(site)
        if owner:
            return owner
    return None


def _owner(
    patch: Patch,
    target: Target,
    module: ModuleType,
    found: tuple[Any, Any],
    versions: Mapping[str, str | None],
    engine: Any,
) -> str | None:
    """:func:`detect` at ``target`` in ``module``, where ``found`` is ``(holder, live value)``."""
    attribute = target.qualname.rpartition(".")[2]
    return detect(patch, Site(patch, target, module, found[0], attribute, found[1], dict(versions), engine))


def reached_through_target(undo: Any) -> Any:
    """Mark the undo of a fix that left its target untouched but runs only through it, so another
    owner replacing the target displaces the fix (see :func:`installation`)."""
    setattr(undo, THROUGH_TARGET, True)
    return undo


def installation(site: Site, reason: str, undo: Any = None) -> Footprint:
    """What the fix left at ``site`` (read back live), the enclosing callables' values now, and the
    ``applied`` reason (restored if our value comes back). A fix that left the target untouched is
    checked for reloads only, unless its undo says it is reached only through the target
    (:func:`reached_through_target`): then another owner replacing that value displaces it."""
    found = lookup(site.module, site.target.qualname)
    owner, value = found if found is not None else (site.owner, site.value)
    checks: Checks = "ours"
    if value is site.value and marked_by(value) != site.patch.name:  # the target holds upstream's value
        checks = "through" if getattr(undo, THROUGH_TARGET, False) else "reload"
    via = {}
    for target in _via_targets(site.patch, site.target):
        enclosing = _lookup_in(target, site.module)
        if enclosing is not None:
            via[target] = enclosing[1]
    spec = getattr(site.module, "__spec__", None)
    copy_sites = copies.sites(site.patch)  # a copy holds its source's live value: ours, or another owner's (stale)
    also = {w: v for w, v in declared_values(site.patch).items() if marked_by(v) == site.patch.name or w in copy_sites}
    return Footprint(site.target, site.module, spec, owner, site.attribute, value, reason, via, checks, also)


def recheck(patch: Patch, versions: dict, installed: Footprint, engine: HandOver | None) -> tuple[RecordState, str]:
    """``(state, reason)`` of an applied patch against the live modules: ``applied`` while our value is
    still what runs, else ``yielded`` / ``superseded`` naming the live owner."""
    name = installed.target.module
    live = sys.modules.get(name)
    if live is None:
        return "superseded", f"module {name} was removed from sys.modules"
    if live is not installed.module or getattr(live, "__spec__", None) is not installed.spec:
        return "superseded", "module reloaded"
    found = lookup(live, installed.target.qualname)
    if found is None:
        return "superseded", f"{installed.target} no longer exists"
    replaced = installed.checks != "reload" and found[1] is not installed.value
    if replaced and not (installed.checks == "through" and is_ours(found[1])):
        other = _owner(patch, installed.target, live, found, versions, engine)
        return ("yielded", f"target owned by {other}") if other else ("superseded", f"replaced by {origin(found[1])}")
    for where, before in installed.also.items():  # a further declared site the fix changed
        module_name, _, path = where.partition(":")
        module = sys.modules.get(module_name)
        value = ABSENT if module is None else site_value(module, path)
        if value is before or is_ours(value):
            continue
        if module is None or value is ABSENT:
            return "superseded", f"also changes {where}, which no longer exists"
        at = lookup(module, path) if "[" not in path else None
        other = None if at is None else _owner(patch, Target(module_name, path), module, at, versions, engine)
        if other:
            return "yielded", f"target owned by {other} (also changes {where})"
        return "superseded", f"also changes {where}, now {origin(value)}"
    for target, before in installed.via.items():
        enclosing = _lookup_in(target, live)
        if enclosing is None:
            return "superseded", f"enclosing {target.qualname} no longer exists"
        if enclosing[1] is before or is_ours(enclosing[1]):
            continue
        other = _owner(patch, target, sys.modules.get(target.module, live), enclosing, versions, engine)
        if other:
            return "yielded", f"target owned by {other} (only reached through {target.qualname})"
        return "superseded", f"only reached through {target.qualname}, now {origin(enclosing[1])}"
    return "applied", installed.reason


def fixed_through_trigger(patch: Patch) -> bool:
    """A patch hooked on a trigger whose every target already holds its fix (decided again after
    the trigger module was executed anew): the fix is in place."""
    if not patch.reach.triggers:
        return False
    targets = {str(t) for t in patch.targets}
    values = [v for where, v in declared_values(patch).items() if where in targets]
    return len(values) == len(targets) and all(marked_by(v) == patch.name for v in values)


def enclosing_owner(patch: Patch, site: Site) -> str | None:
    """The other owner a detector recognises on an enclosing callable, as a ``yielded`` reason."""
    for target in _via_targets(patch, site.target):
        enclosing = _lookup_in(target, site.module)
        module = sys.modules.get(target.module, site.module)
        other = None if enclosing is None else _owner(patch, target, module, enclosing, site.versions, site.engine)
        if other:
            return f"target owned by {other} (only reached through {target.qualname})"
    return None


def yielded_reason(patch: Patch, target: Target, versions: dict, engine: HandOver | None) -> str | None:
    """The ``yielded`` reason of a patch that left ``target`` to another owner at apply time, as
    the detectors see the live target now, or ``None`` when none recognises its owner."""
    module = sys.modules.get(target.module)
    found = None if module is None else lookup(module, target.qualname)
    if module is None or found is None:
        return None
    site = Site(patch, target, module, found[0], target.qualname.rpartition(".")[2], found[1], dict(versions), engine)
    other = detect(patch, site)
    return f"target owned by {other}" if other else enclosing_owner(patch, site)


def is_ours(value: Any) -> bool:
    """Whether ``value`` was installed by one of our patches."""
    return marked_by(value) is not None


class _ReexecLoader:
    """Wraps a module's loader for one re-execution: runs it, restores the module's own loader,
    then calls back with what ``sys.modules`` holds now (so the engine can apply the fix again)."""

    def __init__(self, loader: Any, spec: Any, callback: Callable[[ModuleType, str], None], how: str) -> None:
        self._loader, self._spec, self._callback, self._how = loader, spec, callback, how

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            self._spec.loader = self._loader
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
        try:
            live = sys.modules.get(module.__name__)  # another object when the module replaced itself there
            self._callback(module if live is None else live, self._how)
        except Exception:  # never break the user's import; recheck() then says "module reloaded"
            pass


class Reexecutions:
    """What answers a re-execution of a module a fix went in on: ``importlib.reload`` (``find_spec``
    with a ``target``) or a fresh import of its name after it left ``sys.modules`` (test-isolation
    fixtures, hot-reload tools). The start-up observer, the one finder of ours, hands it the names
    in :attr:`names`; it wraps the loader the finders after the observer find, so the engine
    applies the fix again (wrapt's post-import hooks fire once per name)."""

    def __init__(self, wanted: Callable[[str], bool], callback: Callable[[ModuleType, str], None]) -> None:
        self._wanted, self._callback = wanted, callback
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self.names: set[str] = set()  # the modules a fix went in on (a superset of those watched now)

    def spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        """The spec of ``name`` with a loader that calls back once it executed, or ``None``."""
        if name not in self.names or name in self._busy:
            return None
        try:
            if not self._wanted(name):
                return None
            with self._lock:
                self._busy.add(name)
            try:
                from verl_npu_autopatch.bootstrap.startup import real_spec

                spec = real_spec(name, path, target)
            finally:
                with self._lock:
                    self._busy.discard(name)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return None
            how = "a fresh import (it had left sys.modules)" if target is None else "importlib.reload"
            spec.loader = _ReexecLoader(spec.loader, spec, self._callback, how)
            return spec
        except Exception:  # never break the user's import
            return None

    def watch(self, name: str) -> None:
        """Answer re-executions of module ``name`` from now on, through the start-up observer."""
        from verl_npu_autopatch.bootstrap.startup import OBSERVER

        self.names.add(name)
        OBSERVER.watch(self, name)
