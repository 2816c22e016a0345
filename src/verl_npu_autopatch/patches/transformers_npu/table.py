"""The kernel table (``KERNELS``: kind -> summary, probe, builder, Liger switch) and the patches it
generates for one family of :data:`~verl_npu_autopatch.patches.transformers_npu.models.MODELS`
(:func:`family_patches`): one patch per (family, kernel), checked by the kind's probe and fixed by
its builder."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from verl_npu_autopatch.authoring import APPLY, Patch, Reach, Site, Target, Undo, Verdict, unsupported
from verl_npu_autopatch.patches.transformers_npu.builders import build_experts, replacing
from verl_npu_autopatch.patches.transformers_npu.models import (
    GROUP,
    MODELS,
    REFERENCE,
    enclosing,
    module_name,
    patch_name,
)
from verl_npu_autopatch.patches.transformers_npu.owners import liger_owner, shared_owner, verl_owner
from verl_npu_autopatch.patches.transformers_npu.probes import (
    Unfit,
    experts_sites,
    parameters,
    probe_experts,
    probe_mlp,
    probe_rms_norm,
    probe_rms_norm_gated,
    probe_rotary,
)


@dataclass(frozen=True)
class Kernel:
    """One kernel kind. ``summary``: what the patch does (after the family name); ``probe(site,
    parameter names)``: what the fix needs to know about the live target, raising :class:`Unfit`
    when it does not look like code the kernel reproduces; ``build(site, found)``: installs the
    kernel from what ``probe`` found and returns the undo; ``mirrors``: the hardware-run caller whose
    torch_npu calls the kernel's equal (trace parity: tests/hf/test_hf_trace_parity.py), or what it
    rests on where none exists; ``liger``: the Liger-Kernel switch of ``apply_liger_kernel_to_<family>``
    that replaces the same target (``None``: Liger has none)."""

    summary: str
    probe: Callable[[Site, tuple[str, ...]], dict[str, Any]]
    build: Callable[[Site, dict[str, Any]], Undo]
    mirrors: str
    liger: str | None = None


_SWIGLU_MLP = replacing(lambda k, original, found: k.swiglu_mlp(original))

KERNELS: dict[str, Kernel] = {
    "rms_norm": Kernel(
        "RMSNorm via torch_npu.npu_rms_norm (plain or (1+w) offset, probed).",
        probe_rms_norm,
        replacing(lambda k, original, found: k.rms_norm(original, found["eps_attr"], found["offset"])),
        "verl's rms_norm_forward_npu / qwen3_next_rms_norm_forward_npu",
        liger="rms_norm",
    ),
    "rms_norm_gated": Kernel(
        "Gated RMSNorm (norm, then silu(gate)) via torch_npu.npu_rms_norm.",
        probe_rms_norm_gated,
        replacing(lambda k, original, found: k.rms_norm_gated(original, found["eps_attr"])),
        "verl's qwen3_next_rms_norm_forward_gated_npu",
    ),
    "mlp": Kernel(
        "SwiGLU MLP via torch_npu.npu_swiglu (only when the activation is SiLU).",
        probe_mlp,
        _SWIGLU_MLP,
        "verl's silu_forward_npu",
        liger="swiglu",
    ),
    "vision_mlp": Kernel(
        "Vision SwiGLU MLP via torch_npu.npu_swiglu (only when the activation is SiLU).",
        probe_mlp,
        _SWIGLU_MLP,
        "verl's silu_forward_npu",
    ),
    "rotary": Kernel(
        "apply_rotary_pos_emb via torch_npu.npu_rotary_mul (full or partial rotary dim).",
        probe_rotary,
        # the plain function (behind a kernels-hub layer on transformers 5.25) is what ours wraps
        replacing(lambda k, original, found: k.rotary(found["function"], found["legacy_position_ids"])),
        "verl's apply_rotary_pos_emb_npu / qwen3_next_apply_rotary_pos_emb_npu",
        liger="rope",
    ),
    "experts": Kernel(
        "MoE experts via npu_moe_token_permute/unpermute + npu_grouped_matmul (custom backward). transformers "
        '5.x: registered as experts_implementation="npu_grouped_mm", the default only when the user chose none '
        "(eager/batched_mm/grouped_mm run upstream); 4.x: the sparse-MoE block forward.",
        probe_experts,
        build_experts,
        "verl's NPUGmmFunction and permute/unpermute (qwen3_5_moe_experts_forward_npu), gate/up fused as verl "
        "fuses them for Qwen3-VL-MoE and Qwen3.5-MoE; an empty expert's zero dW rests on the op definition alone",
        liger="swiglu",
    ),
}


def probe(kind: str, site: Site) -> dict[str, Any]:
    """What the fix needs to know about the live target; raises :class:`Unfit` when it does not
    look like code the kernel reproduces."""
    names = parameters(site.value)
    kernel = KERNELS.get(kind)
    if kernel is None:
        raise Unfit(f"a known kernel kind; got {kind!r}", kind)
    return kernel.probe(site, names)


def _check(kind: str, site: Site) -> Verdict:
    """Apply when the live target has the probed shape, else ``unsupported`` (expected vs found)."""
    try:
        probe(kind, site)
    except Unfit as unfit:  # the probe's (expected, found) becomes the verdict
        expected, found = unfit.args
        return unsupported(f"{site.target}: {expected}", found)
    return APPLY


def _fix(kind: str, site: Site) -> Undo:
    """Install the kernel chosen by :func:`probe` on the live target."""
    return KERNELS[kind].build(site, probe(kind, site))


def _experts_in_place(site: Site) -> bool:
    """Whether our kernel is already registered for the experts class at ``site`` (transformers
    5.x; the registry is imported with torch, at the first fix)."""
    registry = sys.modules.get("verl_npu_autopatch.patches.transformers_npu.experts_interface")
    return registry is not None and isinstance(site.owner, type) and registry.installed(site.owner)


def family_patches(family: str, module: str | None = None) -> list[Patch]:
    """The patches of one family, targeting ``module`` (default: its transformers modeling module)."""
    module = module or module_name(family)
    return [
        Patch(
            name=patch_name(family, kind),
            summary=f"{family}: {KERNELS[kind].summary} torch_npu calls as {KERNELS[kind].mirrors}.",
            reference=REFERENCE,
            groups=(GROUP, f"{GROUP}.{family}"),
            targets=tuple(Target(module, qualname) for qualname in variants),
            requires=("transformers",),
            device="npu-device",
            default=True,
            check=partial(_check, kind),
            fix=partial(_fix, kind),
            yields_to=(liger_owner, verl_owner, shared_owner),
            reach=Reach(
                via=tuple(Target(module, qualname) for qualname in enclosing(family, kind)),
                computed=experts_sites(module, variants[0].partition(".")[0]) if kind == "experts" else (),
                in_place=_experts_in_place if kind == "experts" else None,
            ),
        )
        for kind, variants in MODELS[family]
    ]
