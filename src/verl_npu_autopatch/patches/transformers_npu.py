"""torch_npu fused kernels for the transformers Qwen families (verl's ``npu_patch``, made lazy).

One patch per (family, kernel) — ``transformers.qwen3.rms_norm``, ``transformers.qwen3.mlp``,
``transformers.qwen3.rotary``, ``transformers.qwen3_moe.experts`` … — generated from the table
``MODELS`` (family -> kinds and their targets) and the one kernel table ``KERNELS`` (kind ->
summary, probe, builder, Liger switch). Per-kernel names keep the report readable, let
``VERL_NPU_AUTOPATCH_DISABLE`` turn off one kernel, and let the Liger-Kernel arbitration
(``patches/liger.py``) hand over exactly the targets Liger takes (Liger has no gated RMSNorm, so
ours stays). Each family is also a group (``transformers.qwen3``).

Each patch applies when its modeling module is imported; a family that is never imported costs
nothing beyond its hook. Nothing is guessed from versions: every check probes the live code
(signature, source fingerprint, attribute names, weight layout) and records ``unsupported``
with what it expected and found. Kernels live in ``_npu_kernels`` (imported at fix time only).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from verl_npu_autopatch.patches._verl import from_verl
from verl_npu_autopatch.patching import (
    describe,
    marked_by,
    normalized_source,
    parameter_names,
    set_marked,
    signature_text,
)
from verl_npu_autopatch.spec import APPLY, Patch, Site, Target, Undo, Verdict, unsupported

#: Position of this family in the catalogue (``catalog.builtin``): families are applied in this order.
ORDER = 30

REFERENCE = "https://github.com/verl-project/verl/blob/main/verl/models/transformers/npu_patch.py"
GROUP = "transformers"

#: family -> ((kind, qualname variants), ...). Kinds are the keys of :data:`KERNELS`: ``rms_norm``
#: (plain or ``(1+w)``, probed), ``rms_norm_gated``, ``mlp``/``vision_mlp`` (SwiGLU), ``rotary``
#: (full or partial, probed), ``experts`` (fused experts; else, as the second variant, the
#: sparse-MoE block: a legacy per-expert ``ModuleList`` block, or the 4.57 Qwen3-VL-MoE block
#: around fused experts that take dense routing weights — the engine tries the block when the
#: experts variant is unsupported).
MODELS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "qwen2": (
        ("rms_norm", ("Qwen2RMSNorm.forward",)),
        ("mlp", ("Qwen2MLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
    ),
    "qwen2_5_vl": (
        ("rms_norm", ("Qwen2_5_VLRMSNorm.forward", "Qwen2RMSNorm.forward")),
        ("mlp", ("Qwen2MLP.forward",)),
        ("vision_mlp", ("Qwen2_5_VLMLP.forward",)),
    ),
    "qwen3": (
        ("rms_norm", ("Qwen3RMSNorm.forward",)),
        ("mlp", ("Qwen3MLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
    ),
    "qwen3_moe": (
        ("rms_norm", ("Qwen3MoeRMSNorm.forward",)),
        ("mlp", ("Qwen3MoeMLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
        ("experts", ("Qwen3MoeExperts.forward", "Qwen3MoeSparseMoeBlock.forward")),
    ),
    "qwen3_vl": (
        ("rms_norm", ("Qwen3VLTextRMSNorm.forward",)),
        ("mlp", ("Qwen3VLTextMLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
    ),
    "qwen3_vl_moe": (
        ("rms_norm", ("Qwen3VLMoeTextRMSNorm.forward",)),
        ("mlp", ("Qwen3VLMoeTextMLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
        ("experts", ("Qwen3VLMoeTextExperts.forward", "Qwen3VLMoeTextSparseMoeBlock.forward")),
    ),
    "qwen3_next": (
        ("rms_norm", ("Qwen3NextRMSNorm.forward",)),
        ("rms_norm_gated", ("Qwen3NextRMSNormGated.forward",)),
        ("mlp", ("Qwen3NextMLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
        ("experts", ("Qwen3NextExperts.forward", "Qwen3NextSparseMoeBlock.forward")),
    ),
    "qwen3_5": (
        ("rms_norm", ("Qwen3_5RMSNorm.forward",)),
        ("rms_norm_gated", ("Qwen3_5RMSNormGated.forward",)),
        ("mlp", ("Qwen3_5MLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
    ),
    "qwen3_5_moe": (
        ("rms_norm", ("Qwen3_5MoeRMSNorm.forward",)),
        ("rms_norm_gated", ("Qwen3_5MoeRMSNormGated.forward",)),
        ("mlp", ("Qwen3_5MoeMLP.forward",)),
        ("rotary", ("apply_rotary_pos_emb",)),
        ("experts", ("Qwen3_5MoeExperts.forward",)),
    ),
}


def module_name(family: str) -> str:
    """The modeling module of ``family`` (``transformers.models.qwen3.modeling_qwen3``)."""
    return f"transformers.models.{family}.modeling_{family}"


def patch_name(family: str, kind: str) -> str:
    return f"{GROUP}.{family}.{kind}"


# --------------------------------------------------------------------------- other owners: Liger, verl
def _module_of(obj: Any) -> str:
    return getattr(getattr(obj, "__func__", obj), "__module__", None) or ""


def _value_and_holder(value: Any, holder: Any) -> list[Any]:
    """The live value and, when it is a class, what holds it (another owner may rebind either)."""
    return [value, *([holder] if isinstance(holder, type) else [])]


def from_package(package: str, value: Any, holder: Any) -> bool:
    """Whether ``value``, or the class ``holder`` holding it (rebound by another owner), comes from
    top-level package ``package``."""
    return any(_module_of(obj).split(".")[0] == package for obj in _value_and_holder(value, holder))


def _package_owner(site: Site, package: str, label: str) -> str | None:
    """``"<label> (<function>)"`` when the live value, or the class holding it, comes from
    top-level package ``package``, else ``None``."""
    return f"{label} ({describe(site.value)})" if from_package(package, site.value, site.owner) else None


def liger_owner(site: Site) -> str | None:
    """Liger-Kernel replaced the target (or rebound the class holding it)."""
    return _package_owner(site, "liger_kernel", "liger-kernel")


def verl_owner(site: Site) -> str | None:
    """verl's in-tree ``npu_patch`` replaced the target (or rebound the class holding it, as for
    Qwen3-VL-MoE's block): the same torch_npu kernels, so either may run; the record names who does."""
    owned = any(from_verl(obj) for obj in _value_and_holder(site.value, site.owner))
    return f"verl ({describe(site.value)})" if owned else None


def enclosing(family: str, kind: str) -> tuple[str, ...]:
    """Qualnames our ``kind`` target is only reached through: a fused experts module runs only
    while its MoE block's ``forward`` calls ``self.experts`` (verl's block forwards do not)."""
    if kind != "experts":
        return ()
    experts = dict(MODELS[family])[kind][0]
    return (experts.replace("Experts.forward", "SparseMoeBlock.forward"),)


def shared_owner(site: Site) -> str | None:
    """The name of another of our patches already installed on the live target, or ``None``.
    Some releases share one class between families (transformers 4.57 ``modeling_qwen2_5_vl``
    imports ``Qwen2RMSNorm``): the family that patched it first owns it, and the undo order stays
    right."""
    owner = marked_by(site.value)
    if owner and owner != site.patch.name and owner.startswith(f"{GROUP}."):
        cls = site.owner if isinstance(site.owner, type) else None
        where = f" (shared class {cls.__module__}.{cls.__qualname__})" if cls else ""
        return f"{owner}{where}"
    return None


# --------------------------------------------------------------------------- probes
_EPS = re.compile(r"rsqrt\(.*?\+self\.(\w+)\)")
_OFFSET = re.compile(r"\(1(?:\.0)?\+self\.weight")
_GATED = re.compile(r"\*(?:ACT2FN\[self\.activation\]|F\.silu|nn\.functional\.silu|self\.act_fn)\(gate")
_SWIGLU = re.compile(r"self\.act_fn\(gate\)\*up|up\*self\.act_fn\(gate\)")
_FUSED_EXPERTS = re.compile(r"self\.experts=(\w+)\(config\)")
_GATE_UP = re.compile(r"self\.gate_up_proj=nn\.Parameter\(torch\.\w+\(([^,]+),([^,]+),([^,)]+)\)")


class Unfit(Exception):
    """The live target does not have the expected shape; ``args`` = (expected, found)."""


def _source(obj: Any, what: str) -> str:
    text = normalized_source(obj)
    if text is None:
        raise Unfit(f"inspectable source of {what}", "no source")
    return text


def _params(value: Any) -> tuple[str, ...]:
    names = parameter_names(value)
    if names is None:
        raise Unfit("a callable with an inspectable signature", repr(value))
    return names


def _eps_attr(cls_source: str) -> str:
    found = _EPS.search(cls_source)
    if not found:
        raise Unfit("an rsqrt(... + self.<eps>) normalisation", "none in the class source")
    return found.group(1)


def _require_class(site: Site) -> type:
    if not isinstance(site.owner, type):
        raise Unfit("a class holding forward", type(site.owner).__name__)
    return site.owner


def _fused_layout(cls: type, cls_source: str) -> bool:
    """Whether a fused experts class stores ``[E, H, 2I]`` (``True``) or ``[E, 2I, H]`` weights,
    with a ``gate, up = chunk(2)``; ``act_fn(gate) * up`` body."""
    layout = _GATE_UP.search(cls_source)
    if not layout or "self.down_proj=nn.Parameter" not in cls_source:
        raise Unfit("fused 3-D gate_up_proj and down_proj parameters", "no such parameters")
    dims = list(layout.groups())
    if not (dims[1].startswith("2*") or dims[2].startswith("2*")):
        raise Unfit("gate_up_proj of shape [E, 2I, H] or [E, H, 2I]", f"[{', '.join(dims)}]")
    if ".chunk(2,dim=-1)" not in cls_source or not _SWIGLU.search(cls_source):
        raise Unfit("gate, up = gate_up.chunk(2); act_fn(gate) * up", "another expert body")
    return dims[2].startswith("2*")


def dispatcher_interface(forward: Any) -> Any | None:
    """The ``ExpertsInterface`` a ``@use_experts_implementation`` dispatcher ``forward`` reads
    (from its closure), or ``None`` when ``forward`` is not such a dispatcher."""
    forward = getattr(forward, "__func__", forward)
    code = getattr(forward, "__code__", None)
    if code is None or not hasattr(forward, "__wrapped__") or "experts_interface" not in code.co_freevars:
        return None
    interface = forward.__closure__[code.co_freevars.index("experts_interface")].cell_contents
    if not (hasattr(type(interface), "register") and hasattr(interface, "get_interface")):
        return None
    return interface


def default_hook_owner() -> Any | None:
    """The class whose ``get_correct_experts_implementation`` picks the default, or ``None``."""
    module = sys.modules.get("transformers.modeling_utils")
    cls = getattr(module, "PreTrainedModel", None)
    return cls if callable(getattr(cls, "get_correct_experts_implementation", None)) else None


def _dispatched(forward: Any) -> bool:
    """Whether ``forward`` is transformers' ``@use_experts_implementation`` dispatcher (then the
    kernel is registered as an experts implementation instead of replacing it)."""
    if dispatcher_interface(forward) is None:
        return False
    if default_hook_owner() is None:
        raise Unfit(
            "PreTrainedModel.get_correct_experts_implementation beside the experts dispatcher",
            "no such method",
        )
    return True


def _probe_block(site: Site, cls: type, cls_source: str, forward_source: str) -> dict[str, Any]:
    """A sparse-MoE block: legacy (``ModuleList`` of per-expert MLPs, transformers 4.x) or one
    fused experts module called with dense routing weights (4.57 Qwen3-VL-MoE)."""
    if "self.gate=nn.Linear(" not in cls_source or "self.top_k" not in cls_source:
        raise Unfit("a sparse-MoE block with a linear gate and top_k", "another block structure")
    if "nn.ModuleList(" in cls_source and "returnfinal_hidden_states,router_logits" in forward_source:
        return {"block": "legacy"}
    fused = _FUSED_EXPERTS.search(cls_source)
    experts_cls = getattr(site.module, fused.group(1), None) if fused else None
    if (
        not isinstance(experts_cls, type)
        or "self.experts(hidden_states,router_weights,router_indices)" not in forward_source
        or "routing_weights=routing_weights/routing_weights.sum(dim=-1,keepdim=True)" not in forward_source
        or "returnrouted_out,router_logits" not in forward_source
    ):
        raise Unfit(
            "legacy block (ModuleList experts, returns (hidden, router_logits)) or fused block "
            "(experts(hidden, router_weights, router_indices), renormalised top-k, returns (hidden, router_logits))",
            "another block structure",
        )
    experts_source = _source(experts_cls, experts_cls.__qualname__)
    return {"block": "fused", "transposed": _fused_layout(experts_cls, experts_source)}


def _probe_rotary(site: Site, names: tuple[str, ...]) -> dict[str, Any]:
    if names[:4] != ("q", "k", "cos", "sin") or names[4:] not in (
        ("unsqueeze_dim",),
        ("position_ids", "unsqueeze_dim"),
    ):
        raise Unfit("(q, k, cos, sin[, position_ids], unsqueeze_dim)", signature_text(parameter_names(site.value)))
    source = _source(site.value, "apply_rotary_pos_emb")
    if "rotate_half(q" not in source or "repeat_interleave" in source:
        raise Unfit("rotate-half (NeoX) rotary", "another rotary formula")
    return {"legacy_position_ids": "position_ids" in names}


def _class_source(site: Site) -> tuple[type, str]:
    """The class holding the target ``forward`` and its whitespace-free source."""
    cls = _require_class(site)
    return cls, _source(cls, cls.__qualname__)


def _probe_rms_norm(site: Site, names: tuple[str, ...]) -> dict[str, Any]:
    _, cls_source = _class_source(site)
    if len(names) != 2:
        raise Unfit("forward(self, hidden_states)", f"forward{signature_text(parameter_names(site.value))}")
    offset = bool(_OFFSET.search(cls_source))
    if not offset and "self.weight*" not in cls_source:
        raise Unfit("an RMSNorm scaling by self.weight or (1 + self.weight)", "neither")
    return {"eps_attr": _eps_attr(cls_source), "offset": offset}


def _probe_rms_norm_gated(site: Site, names: tuple[str, ...]) -> dict[str, Any]:
    _, cls_source = _class_source(site)
    if len(names) != 3 or names[2] != "gate":
        raise Unfit("forward(self, hidden_states, gate)", f"forward{signature_text(parameter_names(site.value))}")
    eps_attr = _eps_attr(cls_source)
    gated = _GATED.search(cls_source)
    if not gated or gated.start() < cls_source.index("rsqrt("):
        raise Unfit("normalise, then multiply by silu(gate)", "a different gating order or activation")
    return {"eps_attr": eps_attr}


def _probe_mlp(site: Site, names: tuple[str, ...]) -> dict[str, Any]:
    _class_source(site)
    if len(names) != 2:
        raise Unfit("forward(self, x)", f"forward{signature_text(parameter_names(site.value))}")
    x = names[1]
    expected = f"self.down_proj(self.act_fn(self.gate_proj({x}))*self.up_proj({x}))"
    if expected not in _source(site.value, "forward"):
        raise Unfit("down_proj(act_fn(gate_proj(x)) * up_proj(x))", "another MLP body")
    return {}


def _probe_experts(site: Site, names: tuple[str, ...]) -> dict[str, Any]:
    cls, cls_source = _class_source(site)
    if names == ("self", "hidden_states", "top_k_index", "top_k_weights"):
        transposed = _fused_layout(cls, cls_source)
        return {"block": None, "transposed": transposed, "dispatched": _dispatched(site.value)}
    if names == ("self", "hidden_states") and cls.__name__.endswith("SparseMoeBlock"):
        return _probe_block(site, cls, cls_source, _source(site.value, "forward"))
    raise Unfit(
        "Experts.forward(self, hidden_states, top_k_index, top_k_weights) or "
        "SparseMoeBlock.forward(self, hidden_states)",
        f"{getattr(cls, '__name__', '?')}.forward{signature_text(parameter_names(site.value))}",
    )


# --------------------------------------------------------------------------- builders
Replacement = Callable[[Any, Any, dict[str, Any]], Any]


def _replacing(make: Replacement) -> Callable[[Site, dict[str, Any]], Undo]:
    """A builder installing ``make(_npu_kernels, original, found)`` on the target; the kernels
    (and torch) are imported then, at fix time."""

    def build(site: Site, found: dict[str, Any]) -> Undo:
        from verl_npu_autopatch.patches import _npu_kernels as kernels

        return set_marked(site.owner, site.attribute, make(kernels, site.value, found), site.patch.name)

    return build


def _build_experts(site: Site, found: dict[str, Any]) -> Undo:
    """A fused experts forward, a legacy or fused sparse-MoE block forward, or (behind
    transformers' experts dispatcher) the kernel registered as an experts implementation."""
    from verl_npu_autopatch.patches import _npu_kernels as kernels

    original = site.value
    if found["block"] == "legacy":
        replacement = kernels.legacy_moe_block(original)
    elif found["block"] == "fused":
        replacement = kernels.fused_moe_block(original, found["transposed"])
    elif found["dispatched"]:
        from verl_npu_autopatch.patches import _experts_interface

        return _experts_interface.register(site.owner, found["transposed"], site.patch.name)
    else:
        replacement = kernels.fused_experts(original, found["transposed"])
    return set_marked(site.owner, site.attribute, replacement, site.patch.name)


# --------------------------------------------------------------------------- the kernel table
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


_SWIGLU_MLP = _replacing(lambda k, original, found: k.swiglu_mlp(original))

KERNELS: dict[str, Kernel] = {
    "rms_norm": Kernel(
        "RMSNorm via torch_npu.npu_rms_norm (plain or (1+w) offset, probed).",
        _probe_rms_norm,
        _replacing(lambda k, original, found: k.rms_norm(original, found["eps_attr"], found["offset"])),
        "verl's rms_norm_forward_npu / qwen3_next_rms_norm_forward_npu",
        liger="rms_norm",
    ),
    "rms_norm_gated": Kernel(
        "Gated RMSNorm (norm, then silu(gate)) via torch_npu.npu_rms_norm.",
        _probe_rms_norm_gated,
        _replacing(lambda k, original, found: k.rms_norm_gated(original, found["eps_attr"])),
        "verl's qwen3_next_rms_norm_forward_gated_npu",
    ),
    "mlp": Kernel(
        "SwiGLU MLP via torch_npu.npu_swiglu (only when the activation is SiLU).",
        _probe_mlp,
        _SWIGLU_MLP,
        "verl's silu_forward_npu",
        liger="swiglu",
    ),
    "vision_mlp": Kernel(
        "Vision SwiGLU MLP via torch_npu.npu_swiglu (only when the activation is SiLU).",
        _probe_mlp,
        _SWIGLU_MLP,
        "verl's silu_forward_npu",
    ),
    "rotary": Kernel(
        "apply_rotary_pos_emb via torch_npu.npu_rotary_mul (full or partial rotary dim).",
        _probe_rotary,
        _replacing(lambda k, original, found: k.rotary(original, found["legacy_position_ids"])),
        "verl's apply_rotary_pos_emb_npu / qwen3_next_apply_rotary_pos_emb_npu",
        liger="rope",
    ),
    "experts": Kernel(
        "MoE experts via npu_moe_token_permute/unpermute + npu_grouped_matmul (custom backward). transformers "
        '5.x: registered as experts_implementation="npu_grouped_mm", the default only when the user chose none '
        "(eager/batched_mm/grouped_mm run upstream); 4.x: the sparse-MoE block forward.",
        _probe_experts,
        _build_experts,
        "verl's NPUGmmFunction and permute/unpermute (qwen3_5_moe_experts_forward_npu), gate/up fused as verl "
        "fuses them for Qwen3-VL-MoE and Qwen3.5-MoE; an empty expert's zero dW rests on the op definition alone",
        liger="swiglu",
    ),
}


def probe(kind: str, site: Site) -> dict[str, Any]:
    """What the fix needs to know about the live target; raises :class:`Unfit` when it does not
    look like code the kernel reproduces."""
    names = _params(site.value)
    kernel = KERNELS.get(kind)
    if kernel is None:
        raise Unfit(f"a known kernel kind; got {kind!r}", kind)
    return kernel.probe(site, names)


def _check(kind: str, site: Site) -> Verdict:
    """Apply when the live target has the probed shape, else ``unsupported`` (expected vs found)."""
    try:
        probe(kind, site)
    except Unfit as unfit:
        expected, found = unfit.args
        return unsupported(f"{site.target}: {expected}", found)
    return APPLY


def _fix(kind: str, site: Site) -> Undo:
    """Install the kernel chosen by :func:`probe` on the live target."""
    return KERNELS[kind].build(site, probe(kind, site))


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
            via=tuple(Target(module, qualname) for qualname in enclosing(family, kind)),
        )
        for kind, variants in MODELS[family]
    ]


def kinds(family: str) -> tuple[str, ...]:
    return tuple(kind for kind, _ in MODELS[family])


PATCHES: list[Patch] = [patch for family in MODELS for patch in family_patches(family)]
