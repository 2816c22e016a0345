"""``verl.defer_duplicates``: verl's own vLLM patch module defers to ours where ours is strictly
better: its ``patch_vllm013_rotary_emb`` becomes a recorded no-op while ``ApplyRotaryEmb.__init__``
is ours (or vLLM's own, already fixed), and targets verl <= 0.8 overwrites at import go back to ours.

verl 0.9 (``verl/utils/vllm/npu_vllm_patch.py``) calls ``patch_vllm013_rotary_emb()`` from
``apply_npu_vllm_patches()`` at ``import verl.utils.vllm``. It assigns verl's ``__init__``
unconditionally (no marker to honour) and that ``__init__`` calls the base initialiser without
``enforce_enable``, the very bug ``vllm.rotary_flash_attn_guard`` exists to avoid. Every other
verl duplicate honours its own marker, which our fixes set; this one cannot, so its module global
is replaced by a guard (``apply_npu_vllm_patches`` looks it up at call time). The guard first
imports the rotary module (what verl's function does first, so our hook on it has acted), then
skips verl's function when the live ``__init__`` is ours, or is vLLM's own one that our check found
fixed; otherwise (our rotary patch disabled, unsupported, failed) verl's function runs as before.
The record notes the first skipped call. Opt out with ``VERL_NPU_AUTOPATCH_DISABLE=verl.defer_duplicates``.

verl 0.8.0 and older patch while the module itself is being imported (no functions called later,
no markers), after our hooks put our fixes in place. So when this patch is installed (right after
that import) it also hands the two targets where ours is strictly better (rotary ``__init__``,
MoE ``weight_loader``) back to our patches if verl's code now holds them: ``Engine.reapply``
decides them afresh over verl's callables, exactly as when our engine activates after verl.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    HandOver,
    Patch,
    Site,
    Target,
    Undo,
    Verdict,
    marked_by,
    replace_method,
    signature_text,
    unsupported,
)
from verl_npu_autopatch.engine import log
from verl_npu_autopatch.patches._verl import PATCH_MODULE, verl_owned

NAME = "verl.defer_duplicates"
ROTARY_PATCH = "vllm.rotary_flash_attn_guard"
ROTARY_MODULE = "vllm.model_executor.layers.rotary_embedding.common"
#: Our strictly better patches that verl <= 0.8 overwrites while its module is imported.
RECLAIMED = (ROTARY_PATCH, "vllm.moe_weight_loader")


def keeper(engine: HandOver | None) -> str | None:
    """Who keeps ``ApplyRotaryEmb.__init__`` so verl's replacement must not run, or ``None``."""
    cls = getattr(sys.modules.get(ROTARY_MODULE), "ApplyRotaryEmb", None)
    live = getattr(cls, "__dict__", {}).get("__init__")
    if live is None:
        return None
    if marked_by(live) == ROTARY_PATCH:
        return ROTARY_PATCH
    record = None if engine is None else engine.record(ROTARY_PATCH)
    if record is not None and record.state == "fixed-upstream" and verl_owned(live) is None:
        return "vLLM's own ApplyRotaryEmb.__init__ (fixed upstream)"
    return None


def rotary_patcher_rule(code: Code, by_verl: bool) -> Verdict:
    """Decide on verl's ``patch_vllm013_rotary_emb`` (``by_verl``: its code is verl's)."""
    if not by_verl or code.params != ():
        return unsupported(f"verl's {PATCH_MODULE}.patch_vllm013_rotary_emb()", f"{signature_text(code.params)}")
    if not code.has("ApplyRotaryEmb.__init__="):
        return unsupported("a function assigning ApplyRotaryEmb.__init__", "a different body")
    return APPLY


def _check(site: Site) -> Verdict:
    return rotary_patcher_rule(Code.live(site.value), verl_owned(site.value) is not None)


def _fix(site: Site) -> Undo:
    engine, name = site.handover, site.patch.name

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def patch_vllm013_rotary_emb(*args: Any, **kwargs: Any) -> Any:
            importlib.import_module(ROTARY_MODULE)  # as verl's function does; our hook acts first
            kept_by = keeper(engine)
            if kept_by is None:
                return original(*args, **kwargs)
            text = f"verl's patch_vllm013_rotary_emb skipped: ApplyRotaryEmb.__init__ stays with {kept_by}"
            log.logger().info("%s: %s", name, text)
            if engine is not None:
                engine.note(name, text)
            return None

        return patch_vllm013_rotary_emb

    undo = replace_method(site.owner, site.attribute, make, name)
    for reclaimed in RECLAIMED:  # verl <= 0.8 patched while this module was being imported
        if engine is not None:
            engine.reapply(reclaimed, lambda live: verl_owned(live) is not None)
    return undo


PATCHES = [
    Patch(
        name=NAME,
        summary=(
            "verl's patch_vllm013_rotary_emb (drops enforce_enable) is skipped while ApplyRotaryEmb.__init__ "
            "is ours or vLLM's own fixed one; rotary and MoE weight-loader targets that verl <= 0.8 overwrites "
            "while its module is imported go back to ours."
        ),
        reference="https://github.com/verl-project/verl/pull/5756",
        groups=("verl", "vllm"),
        targets=(Target.parse(f"{PATCH_MODULE}:patch_vllm013_rotary_emb"),),
        device="npu-stack",
        default=True,
        check=_check,
        fix=_fix,
    ),
]
