"""Target resolution: which of a patch's variants is live, or why none can be."""

from __future__ import annotations

import sys

from verl_npu_autopatch import ownership
from verl_npu_autopatch.spec import Site

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Collection, Mapping
    from types import ModuleType

    from verl_npu_autopatch.handover import HandOver
    from verl_npu_autopatch.spec import Patch, Target

__all__ = ["initializing", "known_absent", "resolve"]


def resolve(
    patch: Patch,
    variants: tuple[Target, ...],
    versions: Mapping[str, str | None],
    module: ModuleType | None,
    rejected: Mapping[Target, str],
    absent: Collection[str] = (),
    engine: HandOver | None = None,
) -> tuple[Site | None, str | None]:
    """The first variant found in the live modules (``module`` standing for its own name) and
    not ``rejected`` by its check; or ``(None, why-unsupported)`` once every variant was imported
    without it (or is ``absent``, or cannot exist) or was rejected; or ``(None, None)`` while some
    are still to come."""
    missing, waiting = [], False
    for target in variants:
        if target in rejected:
            continue
        live = sys.modules.get(target.module)
        if module is not None and target.module == module.__name__:
            live = module
        if live is None:
            if target.module in absent or known_absent(target.module):
                missing.append(f"{target} (module {target.module} does not exist)")
            else:
                waiting = True
            continue
        found = ownership.lookup(live, target.qualname)
        if found is None:
            missing.append(f"{target} ({ownership.missing(live, target.qualname)})")
            continue
        owner, value = found
        attribute = target.qualname.rpartition(".")[2]
        return Site(patch, target, live, owner, attribute, value, dict(versions), engine), None
    if waiting:
        return None, None
    if not missing:  # every variant present was rejected: their checks say why
        return None, " | ".join(rejected.values())
    why = "expected " + " or ".join(str(t) for t in variants) + "; found " + "; ".join(missing)
    return None, " | ".join([*rejected.values(), why])


def initializing(module: ModuleType | None) -> bool:
    """Whether ``module`` is in ``sys.modules`` but still executing."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def known_absent(module: str) -> bool:
    """Whether submodule ``module`` cannot exist: its parent package finished importing and has
    no such submodule (asking the finders executes nothing)."""
    parent = module.rpartition(".")[0]
    package = sys.modules.get(parent) if parent else None
    if package is None or initializing(package):
        return False
    try:
        import importlib.util

        return importlib.util.find_spec(module) is None
    except Exception:  # a finder that raises: the module may exist, so it is not declared absent
        return False
