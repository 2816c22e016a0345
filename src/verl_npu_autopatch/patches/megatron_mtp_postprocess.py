"""``megatron.mtp_postprocess``: ``GPTModel._postprocess`` skips Multi-Token Prediction when
``mtp_num_layers`` is ``0``.

megatron-core 0.16 enters the MTP branch of ``_postprocess`` on ``mtp_num_layers is not None`` and
starts it with ``labels.clone()``. verl builds its configs with ``mtp_num_layers = 0`` for models
without MTP layers and computes log-probs without labels, so the call crashes on
``None.clone()`` (verl PR #6374). The fix hides a falsy, non-``None`` ``mtp_num_layers`` as
``None`` for the duration of the call and restores it afterwards, also when the call raises.
From 0.17.0 (first: 0.17.0rc0) megatron-core tests ``mtp_num_layers`` for truth
(``fixed-upstream``, decided from the live source). megatron-core 0.15 and older guard the
branch with ``self.mtp_process`` instead (``unsupported``: the fix was not written for them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Verdict,
    around,
    decides,
    fixed_upstream,
    unsupported,
    wrapping_patch,
)
from verl_npu_autopatch.patches._verl import yield_to_verl

GPT = "megatron.core.models.gpt.gpt_model"
TRUTHY = "ifself.config.mtp_num_layers:"
NOT_NONE = "ifself.config.mtp_num_layersisnotNone:"
CLONE = "labels.clone()"


@decides(f"{GPT}:GPTModel._postprocess")
def postprocess_rule(postprocess: Code) -> Verdict:
    source = postprocess.source or ""
    if TRUTHY in source:
        return fixed_upstream("_postprocess tests mtp_num_layers for truth: 0 skips the MTP branch")
    if NOT_NONE in source and CLONE in source[source.index(NOT_NONE) :]:
        return APPLY
    found = "no source" if not source else "another MTP guard"
    if "ifself.mtp_process:" in source:
        found = "the MTP branch guarded by self.mtp_process (megatron-core 0.15 and older)"
    return unsupported("_postprocess entering MTP on `mtp_num_layers is not None`, then labels.clone()", found)


def postprocess(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """The release's ``_postprocess``, ``mtp_num_layers == 0`` hidden as ``None`` for the call."""
    config = self.config
    layers = config.mtp_num_layers
    if layers is None or layers:
        return original(self, *args, **kwargs)
    config.mtp_num_layers = None  # 0 means "no MTP": take the branch-free path
    try:
        return original(self, *args, **kwargs)
    finally:
        config.mtp_num_layers = layers


PATCHES = [
    wrapping_patch(
        "megatron.mtp_postprocess",
        "GPTModel._postprocess treats mtp_num_layers == 0 as no MTP (no labels.clone() on None labels).",
        rule=postprocess_rule,
        wrap=around(postprocess),
        reference="https://github.com/verl-project/verl/pull/6374",
        yields_to=(yield_to_verl(),),  # verl's own copy (equivalent) replaces or wraps ours
    ),
]
