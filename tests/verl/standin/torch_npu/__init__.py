"""Test double (NOT the real torch_npu): just enough of torch_npu's import-time behaviour for the
nested-tensor intercept patch. Like torch_npu up to 2.6 it wraps ``torch.nested.nested_tensor``
and ``as_nested_tensor`` on import, unless ``STANDIN_TORCH_NPU_INTERCEPT=0`` (like 2.7.1 on)."""

import os

import torch  # noqa: F401  (torch_npu binds torch: the patch reaches torch.nested through it)

from torch_npu.utils.npu_intercept import _add_intercept_methods

if os.environ.get("STANDIN_TORCH_NPU_INTERCEPT", "1") == "1":
    _add_intercept_methods()


def _autoload():
    """torch's device-backend autoload entry point (``torch.backends``: ``torch_npu:_autoload``);
    importing the package was the work, as for the real one (``bench/torch_autoload.py``)."""
