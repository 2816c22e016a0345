"""The code of a function as the installed file of its module defines it, read without importing
the module: for a rule that, at its hook, reads a module not imported yet or only part-way
executed (``vllm_ascend.worker.worker`` imports the attention modules before it defines
``NPUWorker``; ``vllm_ascend.ops`` imports most of vllm-ascend). The same ``ModuleSource`` reads a
release's files for the decision table, so the live check and the table run one rule on one text.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from verl_npu_autopatch.authoring import Code, ModuleSource

__all__ = ["installed_code", "installed_file"]


def installed_file(module: str) -> Path | None:
    """The file ``module`` runs (or would run) from: the imported module's ``__file__``, else the
    file under its top-level package's search path; ``None`` when there is none."""
    loaded = getattr(sys.modules.get(module), "__file__", None)
    if loaded:
        return Path(loaded)
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
    except (ImportError, ValueError):  # a broken or stand-in package: no file to read
        return None
    relative = rest.replace(".", "/")
    for location in (spec.submodule_search_locations or ()) if spec is not None else ():
        for candidate in (Path(location) / f"{relative}.py", Path(location) / relative / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def installed_code(module: str, qualname: str) -> Code | None:
    """``Code`` of ``module:qualname`` in the installed file, or ``None`` (no file, or not there)."""
    path = installed_file(module)
    try:
        text = path.read_text(encoding="utf-8") if path is not None else None
    except OSError:  # unreadable (gone since import, inside an archive): the rule sees none
        return None
    try:
        return ModuleSource(text).code(qualname) if text is not None else None
    except SyntaxError:  # not Python this interpreter parses: the rule sees none
        return None
