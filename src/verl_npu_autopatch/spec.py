"""Moved: ``verl_npu_autopatch.authoring.spec`` (or ``verl_npu_autopatch.authoring``, the whole kit).

This path keeps working, with a ``DeprecationWarning``, for the 0.2 releases; it goes in 0.3.
"""

import warnings

from verl_npu_autopatch.authoring import spec as _moved
from verl_npu_autopatch.authoring.spec import *  # noqa: F403

__all__ = list(_moved.__all__)
warnings.warn(
    "verl_npu_autopatch.spec moved to verl_npu_autopatch.authoring.spec"
    " (or import its names from verl_npu_autopatch.authoring)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
