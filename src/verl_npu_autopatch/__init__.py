"""verl-npu-autopatch: Ascend-NPU runtime fixes for verl, applied in every Python process.

The public face, and nothing else: the names below resolve lazily, so importing the package
imports no other module. The start-up hook is the top-level module ``_verl_npu_autopatch_startup``
(see docs/internals.md, "How it works"); ``verl_npu_autopatch.patching`` holds the helpers patch
authors use.
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
    from verl_npu_autopatch import patching
    from verl_npu_autopatch._version import __version__ as __version__
    from verl_npu_autopatch.engine import PatchError, activate, report, revert
    from verl_npu_autopatch.spec import APPLY, Patch, Site, Target, Undo, Verdict, fixed_upstream, unsupported

_LAZY = {
    "__version__": "verl_npu_autopatch._version",
    "activate": "verl_npu_autopatch.engine",
    "report": "verl_npu_autopatch.engine",
    "revert": "verl_npu_autopatch.engine",
    "PatchError": "verl_npu_autopatch.engine",
    "APPLY": "verl_npu_autopatch.spec",
    "Patch": "verl_npu_autopatch.spec",
    "Site": "verl_npu_autopatch.spec",
    "Target": "verl_npu_autopatch.spec",
    "Undo": "verl_npu_autopatch.spec",
    "Verdict": "verl_npu_autopatch.spec",
    "fixed_upstream": "verl_npu_autopatch.spec",
    "unsupported": "verl_npu_autopatch.spec",
}


def __getattr__(name: str) -> object:
    module = "verl_npu_autopatch.patching" if name == "patching" else _LAZY.get(name)
    if module is None:  # also every submodule not imported yet: the import system asks first
        raise AttributeError(f"module 'verl_npu_autopatch' has no attribute {name!r}")
    from importlib import import_module

    found = import_module(module)
    return found if name == "patching" else getattr(found, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
