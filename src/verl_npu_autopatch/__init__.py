"""verl-npu-autopatch: Ascend-NPU runtime fixes for verl, applied in every Python process.

The public face, and nothing else: the names below resolve lazily, so importing the package
imports no other module. The start-up hook is the top-level module ``_verl_npu_autopatch_startup``
(see docs/internals.md, "How it works"); ``verl_npu_autopatch.authoring.patching`` holds the helpers patch
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
    from verl_npu_autopatch._version import __version__ as __version__
    from verl_npu_autopatch.authoring import patching
    from verl_npu_autopatch.authoring.spec import APPLY, Patch, Site, Target, Undo, Verdict, fixed_upstream, unsupported
    from verl_npu_autopatch.engine.lifecycle import PatchError, activate, report, revert

_LAZY = {
    "__version__": "verl_npu_autopatch._version",
    "activate": "verl_npu_autopatch.engine.lifecycle",
    "report": "verl_npu_autopatch.engine.lifecycle",
    "revert": "verl_npu_autopatch.engine.lifecycle",
    "PatchError": "verl_npu_autopatch.engine.lifecycle",
    "APPLY": "verl_npu_autopatch.authoring.spec",
    "Patch": "verl_npu_autopatch.authoring.spec",
    "Site": "verl_npu_autopatch.authoring.spec",
    "Target": "verl_npu_autopatch.authoring.spec",
    "Undo": "verl_npu_autopatch.authoring.spec",
    "Verdict": "verl_npu_autopatch.authoring.spec",
    "fixed_upstream": "verl_npu_autopatch.authoring.spec",
    "unsupported": "verl_npu_autopatch.authoring.spec",
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
