"""verl-npu-autopatch: Ascend-NPU runtime fixes for verl, applied in every Python process.

The start-up hook imports this package in every interpreter, so it stays free of imports
(not even ``typing`` or ``__future__``); public names resolve lazily on first use.
"""

__version__ = "0.1.0"
__all__ = ["Patch", "Target", "activate", "report", "revert"]

_LAZY = {
    "activate": "verl_npu_autopatch.engine",
    "report": "verl_npu_autopatch.engine",
    "revert": "verl_npu_autopatch.engine",
    "Patch": "verl_npu_autopatch.spec",
    "Target": "verl_npu_autopatch.spec",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'verl_npu_autopatch' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
