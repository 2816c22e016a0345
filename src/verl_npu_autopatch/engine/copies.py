"""Copies of a patched module-level name that other modules took with ``from ... import``.

A module that ran ``from pkg.mod import name`` before a fix replaced ``pkg.mod.name`` keeps the
upstream object under its own global; one imported later reads the patched attribute and needs
nothing (until revert). For a patch that declares ``Reach.copies_in`` (packages), the engine
rebinds, in every imported module of those packages, each global holding the value the fix
replaced to the value it left (:func:`rebind`, run by the pipeline right after the fix; its undo
puts the original back in every copy, those taken since included), and the declared sites are
every such copy (:func:`sites`: globals there holding the target's live value), so
re-check and the contract check them.

A patch whose targets another owner replaced (vllm-ascend rebinding vLLM's ``FusedMoE`` in the
package but not in the model modules that copied it earlier) declares ``Reach.stale_values``: the earlier
value of each such target. The same rebinding then moves the copies still holding an earlier value
to the target's live value (another owner's, so unmarked), and its undo puts the earlier value
back in exactly the copies it rebound.
"""

from __future__ import annotations

import sys
from itertools import repeat
from operator import is_

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType
    from typing import Any

    from verl_npu_autopatch.authoring.spec import Patch, Site, Target, Undo

__all__ = ["holders", "in_place", "left_behind", "rebind", "replaced", "sites", "within"]


def within(name: str, packages: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``packages`` or inside one."""
    return name in packages or name.startswith(tuple(f"{p}." for p in packages))


def holders(packages: tuple[str, ...]) -> list[ModuleType]:
    """The imported modules of ``packages`` (a snapshot of ``sys.modules``)."""
    inside = tuple(f"{p}." for p in packages)
    return [m for n, m in list(sys.modules.items()) if (n in packages or n.startswith(inside)) and m is not None]


def _globals_holding(packages: tuple[str, ...], value: Any, skip: str) -> Iterator[tuple[ModuleType, str]]:
    """``(module, global name)`` of every global in the imported modules of ``packages`` that is
    ``value`` itself, except ``skip`` (``module:name``, the target)."""
    for module in holders(packages):
        namespace = getattr(module, "__dict__", {})
        if not any(map(is_, list(namespace.values()), repeat(value))):  # at C speed: most modules hold none
            continue
        for name, held in list(namespace.items()):
            if held is value and f"{module.__name__}:{name}" != skip:
                yield module, name


def _live(target: Target) -> Any:
    """The value module-level ``target`` holds now (``None`` when its module is not imported)."""
    module = sys.modules.get(target.module)
    return None if module is None or "." in target.qualname else vars(module).get(target.qualname)


def replaced(patch: Patch) -> list[tuple[Target, Any, Any]]:
    """``(target, earlier value, live value)`` of each target of ``patch`` another owner replaced,
    as ``patch.reach.stale_values`` names them (none when it declares no ``stale``)."""
    earlier = patch.reach.stale_values() if patch.reach.stale_values is not None else {}
    found = []
    for target, before in earlier.items():
        live = _live(target)
        if before is not None and live is not None and live is not before:
            found.append((target, before, live))
    return found


def sites(patch: Patch) -> dict[str, Any]:
    """The copies of each imported module-level target of ``patch`` (of each target another owner
    replaced, for a patch declaring ``stale``): ``module:name`` -> value, for every global in the
    imported modules of ``patch.reach.copies_in`` holding the target's live value."""
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
    """``module:name`` of every copy still holding the earlier value of a target another owner
    replaced (``patch.reach.stale_values``)."""
    return [
        f"{m.__name__}:{n}"
        for target, before, _ in replaced(patch)
        for m, n in _globals_holding(patch.reach.copies_in, before, str(target))
    ]


def in_place(patch: Patch) -> bool:
    """Whether a patch declaring ``stale`` has nothing left to do: a target was replaced by
    another owner and no copy holds an earlier value."""
    return patch.reach.stale_values is not None and bool(replaced(patch)) and not left_behind(patch)


def _pairs(site: Site) -> list[tuple[Target, Any, Any]]:
    """``(target, earlier, live)`` whose copies the fix at ``site`` leaves to rebind: the targets
    another owner replaced (``stale``), else the module-level target the fix replaced itself."""
    patch = site.patch
    if patch.reach.stale_values is not None:
        return replaced(patch)
    if site.owner is not site.module or site.target not in patch.targets:
        return []
    fixed = vars(site.module).get(site.attribute)
    return [] if fixed is None or fixed is site.value else [(site.target, site.value, fixed)]


def rebind(site: Site, undo: Undo) -> Undo:
    """After the fix at ``site``: rebind every copy of an earlier value in the imported modules of
    ``site.patch.reach.copies_in`` to its target's live value (the fix's own value, or another owner's for
    a patch declaring ``stale``). The undo returned puts the earlier value back in every copy
    rebound here that still holds the live value, and, when that value is the fix's own (it
    leaves with the undo), in every copy taken from the fixed module since; then runs ``undo``."""
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
