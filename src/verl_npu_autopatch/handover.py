"""Moved: ``verl_npu_autopatch.authoring.handover`` (or ``verl_npu_autopatch.authoring``, the whole kit).

This path keeps working, with a ``DeprecationWarning``, for the 0.2 releases; it goes in 0.3: the
import hands back the new module itself (``sys.modules``), so both names are one module object.
"""

import sys
import warnings

from verl_npu_autopatch.authoring import handover

warnings.warn(
    "verl_npu_autopatch.handover moved to verl_npu_autopatch.authoring.handover"
    " (or import its names from verl_npu_autopatch.authoring)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = handover
