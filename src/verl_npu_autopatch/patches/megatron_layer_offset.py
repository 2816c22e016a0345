"""``megatron.layer_offset``: with MindSpeed-LLM's uneven pipeline stages (``num_layer_list``),
megatron-core's ``get_transformer_layer_offset`` answers the stage's first layer as the prefix
sum of the list, in every module that took the function by name.

MindSpeed-LLM's ``--num-layer-list`` (e.g. ``3,2,2``: layers per pipeline stage) lands on the
``TransformerConfig`` as ``num_layer_list`` (a comma string or a list). Its feature patches
``TransformerLayer._get_layer_offset`` and the number of layers each stage builds, but not
``get_transformer_layer_offset`` itself, which Megatron computes from an even split (or its own
first/last-stage options). ``TransformerBlock`` (global layer numbers, sharded state dicts), the
layer specs and the MTP block call that function, most of them through a copy taken with
``from megatron.core.transformer.transformer_layer import get_transformer_layer_offset``: stage 1
of ``3,2,2`` then numbers its layers from 2, not 3, and two stages hold layer 3 (duplicate layer
ids, checkpoints overwriting each other's layers; the recipe's
``mindspeed-llm-fix-get-transformer-layer-offset.patch`` and ``A5/mindspeed-llm_A5.patch``).

The fix wraps the function: when the config carries an uneven ``num_layer_list`` that fits the
run (one entry per pipeline stage, summing to ``num_layers``) and no virtual pipeline stage is
asked for, it returns the sum of the entries before the stage (``pp_rank`` when given, else
Megatron's ``parallel_state`` rank); any other call gets Megatron's own result. The engine
rebinds the copies (``Reach.copies_in``) in ``megatron`` and where two other projects copy the
function at top level (:data:`OUTSIDE_COPIERS`): MindSpeed-LLM's DeepSeek-V4 attention (the whole
``mindspeed_llm`` package is swept) and verl's router replay (``verl.utils.megatron``). MindSpeed
itself holds no copy (its patch manager's own sweep rebinds by identity in every module). A
release whose function reads ``num_layer_list`` itself is ``fixed-upstream``; every release read
(core 0.12.1 to 0.19.2) lacks it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    RECIPE,
    Code,
    Reach,
    Site,
    UpstreamTree,
    Verdict,
    copied_into,
    decides,
    fixed_upstream,
    signature_text,
    unsupported,
    wrapping_patch,
)

MODULE = "megatron.core.transformer.transformer_layer"
FUNCTION = "get_transformer_layer_offset"
#: MindSpeed-LLM's per-stage layer counts on the config.
FIELD = "num_layer_list"
#: The releases' parameters: ``config`` (0.12.1), then ``vp_stage`` (0.13.1), then ``pp_rank`` (0.15.3).
PARAMS = ("config", "vp_stage", "pp_rank")
#: Where the releases take the stage from (whitespace-free).
RANK = "parallel_state.get_pipeline_model_parallel_rank()"
#: megatron-core's modules that copy the function at top level, in the releases read.
COPIERS = (
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
    "megatron.core.post_training.modelopt.gpt.model_specs",
)
#: Modules of other projects that copy the function at top level (read: MindSpeed-LLM 26.1.0 and
#: master; verl 0.8.0, 0.9.0 and 0.9.1). MindSpeed (``mindspeed``) copies it nowhere.
OUTSIDE_COPIERS = (
    "mindspeed_llm.tasks.models.transformer.deepseek4.csa",
    "verl.utils.megatron.router_replay_utils",
)
#: The packages whose imported modules the engine sweeps for copies: verl only where its copier
#: lives (a verl worker imports hundreds of modules; the scan runs at every re-check).
COPYING_PACKAGES = ("megatron", "mindspeed_llm", "verl.utils.megatron")


@decides(f"{MODULE}:{FUNCTION}")
def offset_rule(code: Code) -> Verdict:
    params = code.params or ()
    if params != PARAMS[: len(params)] or not params:
        return unsupported(f"{FUNCTION}(config[, vp_stage[, pp_rank]])", f"{FUNCTION}{signature_text(params)}")
    if code.has(FIELD):
        return fixed_upstream(f"{FUNCTION} reads {FIELD} itself")
    if code.has(RANK):
        return APPLY
    return unsupported(f"{FUNCTION} taking the stage from {RANK}", "another source")


def stage_sizes(raw: Any) -> tuple[int, ...] | None:
    """The layers per stage ``num_layer_list`` says (``"3,2,2"``, ``"'3;2;2'"`` or ``[3, 2, 2]``),
    or ``None`` when it is unset or not a list of whole numbers."""
    if not raw:
        return None
    items = raw.strip("'\"").replace(";", ",").split(",") if isinstance(raw, str) else raw
    try:
        sizes = tuple(int(str(item).strip()) for item in items if str(item).strip())
    except (TypeError, ValueError):  # not a list of counts: leave the offset to Megatron
        return None
    return sizes or None


def uneven_offset(config: Any, rank: int) -> int | None:
    """Stage ``rank``'s first layer by the config's ``num_layer_list``, or ``None`` (Megatron's
    answer stands) when the list is unset, even, or does not fit the run, or a virtual pipeline is on."""
    sizes = stage_sizes(getattr(config, FIELD, None))
    if sizes is None or len(set(sizes)) < 2 or (getattr(config, "virtual_pipeline_model_parallel_size", None) or 1) > 1:
        return None
    if len(sizes) != getattr(config, "pipeline_model_parallel_size", None) or sum(sizes) != config.num_layers:
        return None
    return sum(sizes[:rank]) if 0 <= rank < len(sizes) else None


def _wrap(site: Site, original: Callable[..., Any]) -> Callable[..., Any]:
    state = site.module.parallel_state

    @functools.wraps(original)
    def get_transformer_layer_offset(config: Any, *args: Any, **kwargs: Any) -> Any:
        # the rule admits only PARAMS' prefixes: args are (vp_stage, pp_rank) in that order
        vp_stage = kwargs.get("vp_stage", args[0] if args else None)
        if getattr(config, FIELD, None) and vp_stage is None:
            rank = kwargs.get("pp_rank", args[1] if len(args) > 1 else None)
            offset = uneven_offset(config, state.get_pipeline_model_parallel_rank() if rank is None else rank)
            if offset is not None:
                return offset
        return original(config, *args, **kwargs)

    return get_transformer_layer_offset


def _note(tree: UpstreamTree) -> str | None:
    """How many of :data:`COPIERS` copy the function in a release (the copies the engine rebinds)."""
    found = copied_into(tree, COPIERS, offset_rule.target)
    return f"copied by `from ... import` into {len(found)} modules" if found else None


PATCHES = [
    wrapping_patch(
        "megatron.layer_offset",
        "get_transformer_layer_offset follows MindSpeed-LLM's uneven num_layer_list (a prefix sum), copies included.",
        rule=offset_rule,
        needs="parallel_state",
        wrap=_wrap,
        reach=Reach(copies_in=COPYING_PACKAGES),
        copying_modules=COPIERS,
        note=_note,
        reference=RECIPE,
    ),
]
