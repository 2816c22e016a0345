"""The engine: decides each patch, applies it through wrapt's post-import hooks and records why.

Internal. ``lifecycle`` holds the process's engine (``activate``, ``report``, ``revert``); the
other modules are its parts (docs/internals.md, "Where things live"). The names below were
importable from ``verl_npu_autopatch.engine`` when it was one module; they still resolve, lazily.
"""

TYPE_CHECKING = False
if TYPE_CHECKING:
    from verl_npu_autopatch.engine.lifecycle import Engine, PatchError, activate, engine, report, revert

__all__ = ["Engine", "PatchError", "activate", "engine", "report", "revert"]


def __getattr__(name: str) -> object:
    if name not in __all__:  # also every submodule not imported yet: the import system asks first
        raise AttributeError(f"module 'verl_npu_autopatch.engine' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module("verl_npu_autopatch.engine.lifecycle"), name)
