"""Copies of a patched module-level name that other modules took with ``from ... import``.

A module that ran ``from pkg.mod import name`` before a fix replaced ``pkg.mod.name`` keeps the
upstream object under its own global; one imported later reads the patched attribute and needs
nothing (until revert). For a patch that declares ``Patch.copies`` (packages), the engine
rebinds, in every imported module of those packages, each global holding the value the fix
replaced to the value it left (:func:`rebind`, run by the pipeline right after the fix; its undo
puts the original back in every copy, those taken since included), and the declared sites are
every such copy (:func:`sites`: globals there holding the target's live value), so
re-check and the contract check them.
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

    from verl_npu_autopatch.spec import Patch, Site, Undo

__all__ = ["holders", "rebind", "sites", "within"]


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


def sites(patch: Patch) -> dict[str, Any]:
    """The copies of each imported module-level target of ``patch``: ``module:name`` -> value, for
    every global in the imported modules of ``patch.copies`` holding the target's live value."""
    found: dict[str, Any] = {}
    for target in patch.targets if patch.copies else ():
        module = sys.modules.get(target.module)
        value = None if module is None or "." in target.qualname else vars(module).get(target.qualname)
        if value is not None:
            found.update((f"{m.__name__}:{n}", value) for m, n in _globals_holding(patch.copies, value, str(target)))
    return found


def rebind(site: Site, undo: Undo) -> Undo:
    """After the fix at ``site`` (a module-level name) replaced ``site.value``: rebind every copy of
    ``site.value`` in the imported modules of ``site.patch.copies`` to the value the fix left. The
    undo returned puts ``site.value`` back in every global there holding the fix's value then (the
    copies rebound here and those taken from the fixed module since), then runs ``undo``."""
    if not site.patch.copies or site.owner is not site.module:
        return undo
    original, fixed = site.value, vars(site.module).get(site.attribute)
    if fixed is None or fixed is original:
        return undo
    packages, skip = site.patch.copies, f"{site.module.__name__}:{site.attribute}"
    for module, name in list(_globals_holding(packages, original, skip)):
        setattr(module, name, fixed)

    def restore() -> None:
        for module, name in list(_globals_holding(packages, fixed, skip)):
            setattr(module, name, original)
        undo()

    return restore
