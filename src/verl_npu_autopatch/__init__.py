"""verl-npu-autopatch: Ascend-NPU runtime fixes for verl, applied in every Python process.

The public face: the names below resolve lazily, so importing the package imports nothing else
(docs/internals.md, "How it works"); ``verl_npu_autopatch.authoring`` is the patch authors' kit.
"""

# No ``from __future__ import annotations``: the first watched import loads this module, and
# importing ``__future__`` would cost more than the rest of it.

__all__ = [
    "APPLY",
    "Patch",
    "PatchError",
    "Site",
    "Target",
    "Undo",
    "Verdict",
    "activate",
    "fixed_upstream",
    "patching",
    "report",
    "revert",
    "unsupported",
]

TYPE_CHECKING = False
if TYPE_CHECKING:  # what a type checker sees; at run time the names resolve lazily (``__getattr__``)
    from verl_npu_autopatch._version import __version__ as __version__
    from verl_npu_autopatch.authoring import patching
    from verl_npu_autopatch.authoring.spec import APPLY, Patch, Site, Target, Undo, Verdict, fixed_upstream, unsupported
    from verl_npu_autopatch.engine.lifecycle import PatchError, activate, report, revert

_SPEC = ("APPLY", "Patch", "Site", "Target", "Undo", "Verdict", "fixed_upstream", "unsupported")
_LAZY = {
    "__version__": "verl_npu_autopatch._version",
    **dict.fromkeys(("activate", "report", "revert", "PatchError"), "verl_npu_autopatch.engine.lifecycle"),
    **dict.fromkeys(_SPEC, "verl_npu_autopatch.authoring.spec"),
}


def __getattr__(name: str) -> object:
    module = "verl_npu_autopatch.authoring.patching" if name == "patching" else _LAZY.get(name)
    if module is None:  # also every submodule not imported yet: the import system asks first
        raise AttributeError(f"module 'verl_npu_autopatch' has no attribute {name!r}")
    from importlib import import_module

    found = import_module(module)
    return found if name == "patching" else getattr(found, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
