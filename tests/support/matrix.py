"""The compatibility tool (``scripts/compat_matrix``, the package ``scripts/compat-matrix`` runs) as a
module, and live sites built the way the engine resolves them, so every suite can compare the
decision table with the live check on the installed upstream."""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def matrix_script() -> types.ModuleType:
    """The package ``compat_matrix`` (``scripts/`` joins the end of ``sys.path``, shadowing nothing)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))
    return importlib.import_module("compat_matrix")


def live_sites(patch: Any) -> list[Any]:
    """A :class:`~verl_npu_autopatch.authoring.spec.Site` per variant of ``patch`` present in the installed
    packages (modules imported), in variant order, as ``decision.resolve`` builds them."""
    from verl_npu_autopatch.authoring.spec import Site

    sites = []
    for target in patch.hooks:
        try:
            module = importlib.import_module(target.module)
        except ImportError:
            continue
        owner: Any = module
        *path, attribute = target.qualname.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        value = inspect.getattr_static(owner, attribute, None) if owner is not None else None
        if value is not None:
            sites.append(Site(patch, target, module, owner, attribute, value))
    return sites
