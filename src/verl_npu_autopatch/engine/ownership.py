"""Ownership: an ``applied`` record is a claim about the live attribute, re-checked whenever it is
read (:func:`recheck`): if our value no longer runs at the target (or an enclosing callable,
``Reach.via``, or a further declared site), the record becomes ``yielded`` when a ``yields_to``
detector recognises the new owner, else ``superseded`` naming it.

Copies: a module that ran ``from pkg.mod import name`` before a fix keeps the upstream object; for
a patch declaring ``Reach.copies_in``, :func:`rebind` moves each copy in those packages to the fix's
value (and back on undo), and each copy is a declared site (:func:`sites`). With ``Reach.stale_values``
(another owner replaced the target, e.g. vllm-ascend's ``FusedMoE``, after modules copied it) the
copies of the earlier value move to the target's live value instead.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from itertools import repeat
from operator import is_
from types import ModuleType
from typing import Any, Literal

from verl_npu_autopatch.authoring.patching import ABSENT, marked_by, origin
from verl_npu_autopatch.authoring.spec import Patch, Site, Target
from verl_npu_autopatch.engine.text import safe_str

TYPE_CHECKING = False
if TYPE_CHECKING:
    from verl_npu_autopatch.authoring.handover import HandOver
    from verl_npu_autopatch.authoring.spec import Undo
    from verl_npu_autopatch.engine.records import RecordState

#: Attribute on an undo whose fix installed elsewhere but runs only while the target holds the
#: value the fix left there (an experts implementation the target's dispatcher looks up).
THROUGH_TARGET = "verl_npu_autopatch_through_target"

#: What :func:`recheck` expects at a :class:`Footprint`'s target: ``ours`` (the fix replaced it),
#: ``through`` (the fix runs only through upstream's value left there: any value but ours displaces
#: it) or ``reload`` (the fix installed elsewhere: checked for reloads only).
Checks = Literal["ours", "through", "reload"]


class Footprint:
    """What an applied patch left: ``target`` holding ``value`` on ``module`` (executed under ``spec``),
    each enclosing callable's value (``via``), each further declared site's (``also``)."""

    def __init__(
        self,
        target: Target,
        module: ModuleType,
        spec: Any,
        value: Any,
        reason: str,
        via: dict,
        checks: Checks,
        also: dict,
    ) -> None:
        self.target, self.module, self.spec, self.value = target, module, spec, value
        self.reason, self.via, self.checks, self.also = reason, via, checks, also


def lookup(module: ModuleType, qualname: str) -> tuple[Any, Any] | None:
    """``(holder, raw attribute)`` of ``qualname`` in ``module``, or ``None`` when it is missing."""
    found = walk(module, qualname)
    return found if isinstance(found, tuple) else None


def walk(module: ModuleType, qualname: str) -> tuple[Any, Any] | str:
    """``(holder, raw attribute)`` or why not; the last part read statically (a ``staticmethod`` stays one)."""
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
    """``module:path`` -> raw live value of each further site ``patch`` declares whose module is
    imported: ``secondary``, a trigger-hooked patch's targets (unless ``stale``), ``computed``, copies."""
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
    return {**values, **sites(patch)}


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


def _recognised(patch: Patch, site: Site) -> str | None:
    """:func:`detect` for a re-check, as text: a detector that raises leaves the owner unrecognised
    (named by :func:`origin`), never the record ``applied`` over another owner's value."""
    try:
        other = detect(patch, site)
        return safe_str(other) if other else None
    except Exception:  # a detector's bug: the live value is still not ours, so the record moves on
        return None


def _site(
    patch: Patch,
    target: Target,
    module: ModuleType,
    found: tuple[Any, Any],
    versions: Mapping[str, str | None],
    engine: Any,
) -> Site:
    """The site a detector sees at ``target`` in ``module``, where ``found`` is ``(holder, live value)``."""
    attribute = target.qualname.rpartition(".")[2]
    return Site(patch, target, module, found[0], attribute, found[1], dict(versions), engine)


def reached_through_target(undo: Any) -> Any:
    """Mark the undo of a fix that left its target untouched but runs only through it, so another
    owner replacing the target displaces the fix (see :func:`installation`)."""
    setattr(undo, THROUGH_TARGET, True)
    return undo


def installation(site: Site, reason: str, undo: Any = None) -> Footprint:
    """The footprint of the fix at ``site``, read back live, with the ``applied`` reason (restored if
    our value comes back). A fix that left the target untouched is checked for reloads only, unless
    its undo says it runs only through the target (:func:`reached_through_target`)."""
    found = lookup(site.module, site.target.qualname)
    value = site.value if found is None else found[1]
    checks: Checks = "ours"
    if value is site.value and marked_by(value) != site.patch.name:  # the target holds upstream's value
        checks = "through" if getattr(undo, THROUGH_TARGET, False) else "reload"
    via = {}
    for target in _via_targets(site.patch, site.target):
        enclosing = _lookup_in(target, site.module)
        if enclosing is not None:
            via[target] = enclosing[1]
    spec = getattr(site.module, "__spec__", None)
    copy_sites = sites(site.patch)  # a copy holds its source's live value: ours, or another owner's (stale)
    also = {w: v for w, v in declared_values(site.patch).items() if marked_by(v) == site.patch.name or w in copy_sites}
    return Footprint(site.target, site.module, spec, value, reason, via, checks, also)


def recheck(patch: Patch, versions: dict, installed: Footprint, engine: HandOver | None) -> tuple[RecordState, str]:
    """``(state, reason)``: ``applied`` while our value still runs, else ``yielded`` / ``superseded``
    naming the live owner."""
    name = installed.target.module
    live = sys.modules.get(name)
    if live is None:
        return "superseded", f"module {name} was removed from sys.modules"
    if live is not installed.module or getattr(live, "__spec__", None) is not installed.spec:
        return "superseded", "module reloaded"
    found = lookup(live, installed.target.qualname)
    if found is None:
        return "superseded", f"{installed.target} no longer exists"
    moved = installed.checks != "reload" and found[1] is not installed.value
    if moved and not (installed.checks == "through" and is_ours(found[1])):
        other = _recognised(patch, _site(patch, installed.target, live, found, versions, engine))
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
        at_site = None if at is None else _site(patch, Target(module_name, path), module, at, versions, engine)
        other = None if at_site is None else _recognised(patch, at_site)
        if other:
            return "yielded", f"target owned by {other} (also changes {where})"
        return "superseded", f"also changes {where}, now {origin(value)}"
    for target, before in installed.via.items():
        enclosing = _lookup_in(target, live)
        if enclosing is None:
            return "superseded", f"enclosing {target.qualname} no longer exists"
        if enclosing[1] is before or is_ours(enclosing[1]):
            continue
        other = _recognised(
            patch, _site(patch, target, sys.modules.get(target.module, live), enclosing, versions, engine)
        )
        if other:
            return "yielded", f"target owned by {other} (only reached through {target.qualname})"
        return "superseded", f"only reached through {target.qualname}, now {origin(enclosing[1])}"
    return "applied", installed.reason


def fixed_through_trigger(patch: Patch) -> bool:
    """A trigger-hooked patch whose every target holds its fix already (the trigger re-executed)."""
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
        if enclosing is None:
            continue
        other = detect(patch, _site(patch, target, module, enclosing, site.versions, site.handover))
        if other:
            return f"target owned by {other} (only reached through {target.qualname})"
    return None


def yielded_reason(patch: Patch, target: Target, versions: dict, engine: HandOver | None) -> str | None:
    """The ``yielded`` reason for ``target`` as the detectors see it now (``None``: none recognises its owner)."""
    module = sys.modules.get(target.module)
    found = None if module is None else lookup(module, target.qualname)
    if module is None or found is None:
        return None
    site = _site(patch, target, module, found, versions, engine)
    other = detect(patch, site)
    return f"target owned by {other}" if other else enclosing_owner(patch, site)


def is_ours(value: Any) -> bool:
    """Whether ``value`` was installed by one of our patches."""
    return marked_by(value) is not None


def within(name: str, packages: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``packages`` or inside one."""
    return name in packages or name.startswith(tuple(f"{p}." for p in packages))


def holders(packages: tuple[str, ...]) -> list[ModuleType]:
    """The imported modules of ``packages`` (a snapshot of ``sys.modules``, whose keys may be anything)."""
    inside = tuple(f"{p}." for p in packages)
    entries = list(sys.modules.items())
    return [m for n, m in entries if isinstance(n, str) and (n in packages or n.startswith(inside)) and m is not None]


def _globals_holding(packages: tuple[str, ...], value: Any, skip: str) -> Iterator[tuple[ModuleType, str]]:
    """``(module, global name)`` of every global in the imported modules of ``packages`` that is
    ``value``, except ``skip`` (``module:name``, the target)."""
    for module in holders(packages):
        try:
            namespace = getattr(module, "__dict__", {})
            values = list(namespace.values())
        except Exception:  # another's object whose namespace cannot be read (a proxy): no copy seen there
            continue
        if not any(map(is_, values, repeat(value))):  # at C speed: most modules hold none
            continue
        for name, held in list(namespace.items()):
            if held is value and f"{module.__name__}:{name}" != skip:
                yield module, name


def _live(target: Target) -> Any:
    """The value module-level ``target`` holds now (``None`` when its module is not imported)."""
    module = sys.modules.get(target.module)
    return None if module is None or "." in target.qualname else vars(module).get(target.qualname)


def replaced(patch: Patch) -> list[tuple[Target, Any, Any]]:
    """``(target, earlier value, live value)`` of each target of ``patch.reach.stale_values`` another owner replaced."""
    earlier = patch.reach.stale_values() if patch.reach.stale_values is not None else {}
    found = []
    for target, before in earlier.items():
        live = _live(target)
        if before is not None and live is not None and live is not before:
            found.append((target, before, live))
    return found


def sites(patch: Patch) -> dict[str, Any]:
    """``module:name`` -> value of every global in the imported modules of ``patch.reach.copies_in``
    holding the live value of a module-level target (of a replaced one, for a patch declaring ``stale``)."""
    found: dict[str, Any] = {}
    if not patch.reach.copies_in:
        return found
    stale = patch.reach.stale_values is not None
    sources = [(t, live) for t, _, live in replaced(patch)] if stale else [(t, _live(t)) for t in patch.targets]
    for target, value in sources:
        if value is not None:
            found.update(
                (f"{m.__name__}:{n}", value) for m, n in _globals_holding(patch.reach.copies_in, value, str(target))
            )
    return found


def left_behind(patch: Patch) -> list[str]:
    """``module:name`` of every copy still holding the earlier value of a replaced target (``stale``)."""
    return [
        f"{m.__name__}:{n}"
        for target, before, _ in replaced(patch)
        for m, n in _globals_holding(patch.reach.copies_in, before, str(target))
    ]


def in_place(patch: Patch) -> bool:
    """Whether a patch declaring ``stale`` has nothing left to do: a target replaced, no copy of an earlier value."""
    return patch.reach.stale_values is not None and bool(replaced(patch)) and not left_behind(patch)


def _pairs(site: Site) -> list[tuple[Target, Any, Any]]:
    """``(target, earlier, live)`` whose copies the fix at ``site`` rebinds: the replaced targets
    (``stale``), else the module-level target the fix replaced itself."""
    patch = site.patch
    if patch.reach.stale_values is not None:
        return replaced(patch)
    if site.owner is not site.module or site.target not in patch.targets:
        return []
    fixed = vars(site.module).get(site.attribute)
    return [] if fixed is None or fixed is site.value else [(site.target, site.value, fixed)]


def rebind(site: Site, undo: Undo) -> Undo:
    """After the fix at ``site``: rebind every copy of an earlier value to its target's live value. The
    undo returned puts the earlier value back where the live one still is (in copies taken since
    too when that value is the fix's own, which leaves with the undo), then runs ``undo``."""
    pairs = _pairs(site) if site.patch.reach.copies_in else []
    if not pairs:
        return undo
    packages, rebound = site.patch.reach.copies_in, set()
    for target, before, live in pairs:
        for module, name in list(_globals_holding(packages, before, str(target))):
            setattr(module, name, live)
            rebound.add((module, name))
    own = site.patch.reach.stale_values is None

    def restore() -> None:
        for target, before, live in pairs:
            for module, name in list(_globals_holding(packages, live, str(target))):
                if own or (module, name) in rebound:
                    setattr(module, name, before)
        undo()

    return restore


class _ReexecLoader:
    """A module's loader for one re-execution: runs it, puts the module's own back, calls back."""

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
    """Answers a re-execution of a module a fix went in on (``importlib.reload``, or a fresh import
    after it left ``sys.modules``; wrapt's hooks fire once per name): the start-up observer hands it
    the :attr:`names`; it wraps the real loader so the engine applies the fix again."""

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
