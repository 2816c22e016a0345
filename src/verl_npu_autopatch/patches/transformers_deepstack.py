"""``transformers.qwen3_vl.deepstack_clone`` / ``transformers.qwen3_vl_moe.deepstack_clone``: the
Qwen3-VL text models' ``_deepstack_process`` adds the DeepStack visual features into a copy of the
hidden states instead of writing into the tensor it was given.

transformers 4.57 writes ``hidden_states[visual_pos_masks, :] = local_this`` into the incoming
``hidden_states``. When that tensor is a view returned by a custom autograd ``Function`` (a
decoder layer's output on NPU), autograd forbids the in-place write: "Output 0 of … is a view and
is being modified inplace … created inside a custom Function" (verl issue #5498, Qwen3-VL-8B on
NPU). transformers fixed it in 5.0 (huggingface/transformers#41535) by cloning ``hidden_states``
first; that is exactly what the fix does before calling the release's own method, so the result
and its gradients are upstream's. From transformers 5.0 the check reads the clone in the live
source and records ``fixed-upstream``; transformers 4.57.6 (verl's Ascend images) applies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Patch,
    Target,
    Verdict,
    around,
    code_check,
    fixed_upstream,
    takes,
    unsupported,
    wrapping_fix,
)
from verl_npu_autopatch.patches._verl import yield_to_verl

REFERENCE = "https://github.com/verl-project/verl/issues/5498"
PARAMS = ("self", "hidden_states", "visual_pos_masks", "visual_embeds")
CLONED = "hidden_states=hidden_states.clone()"
IN_PLACE = "hidden_states[visual_pos_masks,:]=local_this"
#: family → the text model class holding ``_deepstack_process``.
MODELS = {"qwen3_vl": "Qwen3VLTextModel", "qwen3_vl_moe": "Qwen3VLMoeTextModel"}


@takes("_deepstack_process", PARAMS)
def deepstack_rule(process: Code) -> Verdict:
    """Decide on ``<TextModel>._deepstack_process``."""
    if process.has(CLONED):
        return fixed_upstream("_deepstack_process clones hidden_states before the masked write")
    if not process.has(IN_PLACE):
        return unsupported(
            "_deepstack_process writing local_this into hidden_states[visual_pos_masks, :]", "another body"
        )
    return APPLY


def deepstack_process(
    original: Callable[..., Any], self: Any, hidden_states: Any, visual_pos_masks: Any, visual_embeds: Any
) -> Any:
    """The release's ``_deepstack_process`` writing into a clone of ``hidden_states``."""
    return original(self, hidden_states.clone(), visual_pos_masks, visual_embeds)


def _patch(family: str, cls: str) -> Patch:
    module = f"transformers.models.{family}.modeling_{family}"
    return Patch(
        name=f"transformers.{family}.deepstack_clone",
        summary=f"{family}: {cls}._deepstack_process adds the visual features into a clone of hidden_states "
        "(no in-place write into a custom Function's view).",
        reference=REFERENCE,
        groups=("transformers", f"transformers.{family}"),
        targets=(Target.parse(f"{module}:{cls}._deepstack_process"),),
        check=code_check(deepstack_rule),
        fix=wrapping_fix(around(deepstack_process)),
        yields_to=(yield_to_verl(),),  # verl's own copy (equivalent), should a release carry one
    )


PATCHES = [_patch(family, cls) for family, cls in MODELS.items()]
