"""``verl.3d_position_ids``: verl's ``maybe_fix_3d_position_ids`` repairs a VLM batch's 3-D position
ids by their layout instead of relabelling them blindly.

VLM position ids (per sample ``[channels, sequence]``, mRoPE) travel as a jagged nested tensor
whose ragged dimension is the sequence (``_ragged_idx == 2``; verl's
``nested_tensor_from_tensor_list``). Two other layouts reach verl's engine workers: a
TensorDict pickle round trip keeps the values and offsets but resets ``_ragged_idx`` to 1
("sequence-packed"), and ``torch.nested.as_nested_tensor`` on equal-length samples (a batch of
one included) makes the channels the ragged dimension ("channel-packed": values
``[batch * channels, sequence]``, offsets in steps of the channel count). verl <= 0.9.1 sets
``_ragged_idx = 2`` on either: right for the first, for the second it leaves offsets that count
channels under a label that says sequence, and the next ``unbind`` or split fails or cuts the
sequences at channel counts (the recipe's ``opd/patch/verl_opd_ascend.patch``; verl PR #7333,
#7767, issue #7899). The fix decides from the live values and offsets: canonical is left alone,
sequence-packed is relabelled, channel-packed is rebuilt with verl's own constructor from its
samples; any other layout goes to verl's function as shipped. A release whose function reads the
layout itself (``offsets()`` / ``values()``) or rebuilds the tensor is ``fixed-upstream``.

verl's engine modules (``verl.workers.engine_workers``, ``verl.workers.engine.base``, ...) take
the function with ``from verl.utils.tensordict_utils import maybe_fix_3d_position_ids``: the
engine rebinds those copies too (``Reach.copies_in``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Reach,
    Site,
    Verdict,
    decides,
    fixed_upstream,
    unsupported,
    wrapping_patch,
)

MODULE = "verl.utils.tensordict_utils"
FUNCTION = "maybe_fix_3d_position_ids"
#: verl's constructor of the canonical layout, which the fix rebuilds with.
BUILDER = "nested_tensor_from_tensor_list"
#: verl <= 0.9.1: the ragged index set to 2 on any 3-D nested position ids (whitespace-free).
BLIND = 'data["position_ids"]._ragged_idx=2'
#: A body that reads the layout or builds a new nested tensor decides by itself.
LAYOUT_AWARE = (".offsets()", ".values()", "nested_tensor_from_")

Layout = Literal["canonical", "sequence-packed", "channel-packed", "unknown"]


@decides(f"{MODULE}:{FUNCTION}", ("data",))
def position_ids_rule(code: Code) -> Verdict:
    if any(code.has(needle) for needle in LAYOUT_AWARE):
        return fixed_upstream(f"{FUNCTION} reads the nested layout (offsets / values) or rebuilds the tensor")
    if code.has(BLIND):
        return APPLY
    return unsupported(f"{FUNCTION} setting position_ids._ragged_idx = 2", "another body")


def layout(values_shape: tuple[int, ...], total: int, ragged_idx: int) -> Layout:
    """Which layout 3-D jagged position ids have, from their values' shape, the last offset
    (``total``) and the ragged index. Offsets that fit both dimensions read as channel-packed:
    sequence-packed would need as many channels as the batch has tokens."""
    if ragged_idx == 2:
        return "canonical"
    if len(values_shape) != 2:
        return "unknown"
    if values_shape[0] == total:
        return "channel-packed"
    return "sequence-packed" if values_shape[1] == total else "unknown"


def _wrap(site: Site, original: Callable[..., Any]) -> Callable[..., Any]:
    torch = site.module.torch  # verl's own torch
    build = getattr(site.module, BUILDER)

    @functools.wraps(original)
    def maybe_fix_3d_position_ids(data: Any) -> None:
        ids = data["position_ids"] if "position_ids" in data.keys() else None  # noqa: SIM118  (TensorDict has no `in`)
        if ids is None or not getattr(ids, "is_nested", False) or ids.dim() != 3 or ids.layout != torch.jagged:
            return original(data)
        ragged = getattr(ids, "_ragged_idx", 1)
        found = "canonical" if ragged == 2 else layout(tuple(ids.values().shape), int(ids.offsets()[-1]), ragged)
        if found == "sequence-packed":
            ids._ragged_idx = 2  # values and offsets already describe the sequences
        elif found == "channel-packed":
            data["position_ids"] = build(list(ids.unbind()), ragged_idx=2)
        elif found == "unknown":
            return original(data)
        return None

    return maybe_fix_3d_position_ids


#: verl's modules that take the function by name (``from ... import``), as the releases read have them.
COPIERS = ("verl.workers.engine_workers", "verl.workers.engine.base", "verl.workers.engine_workers_tinker")


PATCHES = [
    wrapping_patch(
        "verl.3d_position_ids",
        "verl's maybe_fix_3d_position_ids repairs 3-D (mRoPE) position ids by their layout, copies included.",
        rule=position_ids_rule,
        needs=BUILDER,
        wrap=_wrap,
        reach=Reach(copies_in=("verl",)),
        copying_modules=COPIERS,
        reference="https://github.com/verl-project/verl/issues/7899",
    ),
]
