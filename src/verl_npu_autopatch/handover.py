"""Moved to ``verl_npu_autopatch.authoring.handover``: this path warns and hands that module back until 0.3."""

from verl_npu_autopatch.authoring import _moved

_moved("handover")
