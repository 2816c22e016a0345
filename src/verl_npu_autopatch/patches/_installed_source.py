"""A module's source, or a function's code, as its installed file defines it, read without
importing the module: for a rule that, at its hook, reads a module not imported yet or only part-way
executed (``vllm_ascend.worker.worker`` imports the attention modules before it defines
``NPUWorker``; ``vllm_ascend.ops`` imports most of vllm-ascend). The same ``ModuleSource`` reads a
release's files for the decision table, so the live check and the table run one rule on one text.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from verl_npu_autopatch.authoring import Code, ModuleSource

__all__ = ["installed_code", "installed_file", "installed_source"]


def installed_file(module: str) -> Path | None:
    """The file ``module`` runs (or would run) from: the imported module's ``__file__``, else the
    file under its top-level package's path (the imported package's ``__path__``, else where the
    import system would find it); ``None`` when there is none."""
    loaded = getattr(sys.modules.get(module), "__file__", None)
    if loaded:
        return Path(loaded)
    top, _, rest = module.partition(".")
    locations = getattr(sys.modules.get(top), "__path__", None)
    if locations is None:
        try:
            spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
        except (ImportError, ValueError):  # a broken or stand-in package: no file to read
            return None
        locations = (spec.submodule_search_locations or ()) if spec is not None else ()
    relative = rest.replace(".", "/")
    for location in locations:
        for candidate in (Path(location) / f"{relative}.py", Path(location) / relative / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def installed_source(module: str) -> ModuleSource | None:
    """The parsed source of ``module``'s installed file, or ``None`` (no file, or unreadable)."""
    path = installed_file(module)
    try:
        return ModuleSource(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, SyntaxError, UnicodeDecodeError):  # gone, in an archive, or not Python we parse: none
        return None


def installed_code(module: str, qualname: str) -> Code | None:
    """``Code`` of ``module:qualname`` in the installed file, or ``None`` (no file, or not there)."""
    source = installed_source(module)
    return None if source is None else source.code(qualname)
