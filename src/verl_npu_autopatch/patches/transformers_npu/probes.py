"""The structural checks of the transformers kernel patches: each ``probe_<kind>(site, parameter
names)`` reads the live target (signature, source fingerprint, attribute names, weight layout) and
returns what the kernel's builder needs, or raises :class:`Unfit` (expected, found). Nothing is
guessed from versions."""

from __future__ import annotations

import re
import sys
from typing import Any

from verl_npu_autopatch.authoring import (
    ComputedSites,
    Site,
    normalized_source,
    parameter_names,
    signature_text,
    underlying,
)

#: The name our experts kernel is registered under in transformers' ``ExpertsInterface``.
EXPERTS_NAME = "npu_grouped_mm"

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


def parameters(value: Any) -> tuple[str, ...]:
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
    forward = underlying(forward)
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


def experts_sites(module: str, experts: str) -> tuple[ComputedSites, ...]:
    """The sites the experts fix changes behind transformers 5.x's experts dispatcher, found live:
    our name's entry in the ``ExpertsInterface`` mapping the class ``experts`` of ``module``
    dispatches through, and ``PreTrainedModel.get_correct_experts_implementation`` (the default
    choice). None where that class has no dispatcher (transformers 4.x: the fix replaces it)."""

    def interface() -> Any | None:
        cls = getattr(sys.modules.get(module), experts, None)
        return dispatcher_interface(getattr(cls, "forward", None)) if default_hook_owner() is not None else None

    def registration(live: Any) -> tuple[str, ...]:
        found = interface()
        kind = type(found)  # ``register`` is a classmethod: our entry goes in the class's mapping
        mapping = isinstance(getattr(kind, "_global_mapping", None), dict)
        if found is None or not mapping or kind.__module__ != live.__name__:
            return ()
        return (f"{kind.__qualname__}._global_mapping[{EXPERTS_NAME}]",)

    def default(live: Any) -> tuple[str, ...]:
        owner = default_hook_owner()
        if owner is None or interface() is None or owner.__module__ != live.__name__:
            return ()
        return (f"{owner.__qualname__}.get_correct_experts_implementation",)

    return (
        ComputedSites(
            "transformers.integrations.moe", f"ExpertsInterface._global_mapping[{EXPERTS_NAME}]", registration
        ),
        ComputedSites("transformers.modeling_utils", "PreTrainedModel.get_correct_experts_implementation", default),
    )


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


def hub_function(value: Any) -> Any:
    """The plain function behind a ``kernels`` hub function layer, else ``value`` itself.

    transformers 5.25 decorates ``apply_rotary_pos_emb`` with ``@use_kernel_forward_from_hub``:
    the module attribute is then an ``nn.Module`` instance (signature ``(*args, **kwargs)``) whose
    ``forward`` calls the decorated function unless ``kernelize`` activated a hub kernel for it."""
    forward: Any = getattr(type(value), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or "func" not in code.co_freevars or not hasattr(type(value), "kernel_layer_name"):
        return value
    inner = forward.__closure__[code.co_freevars.index("func")].cell_contents
    return inner if callable(inner) else value


def hub_npu_kernel(layer: str) -> str | None:
    """The kernel the ``kernels`` hub maps for ``layer`` on ``npu`` in transformers' own mapping
    (``kernelize`` would run it instead of the function), or ``None``: transformers 5.25 maps
    ``rotary_pos_emb`` for cuda, xpu and rocm only."""
    module = sys.modules.get("transformers.integrations.hub_kernels")
    mapping = getattr(module, "get_kernel_mapping_transformers", None)
    if mapping is None:
        return None
    devices = mapping().get(layer, {})
    found = [repr(kernel) for device, kernel in devices.items() if getattr(device, "type", device) == "npu"]
    return found[0] if found else None


def probe_rotary(site: Site, names: tuple[str, ...]) -> dict[str, Any]:
    function = hub_function(site.value)
    layer = getattr(type(site.value), "kernel_layer_name", None) if function is not site.value else None
    if layer is not None:
        names = parameters(function)
        hub = hub_npu_kernel(layer)
        if hub is not None:
            raise Unfit(f"no NPU kernel of the kernels hub for {layer!r} (ours would bypass it)", hub)
    if names[:4] != ("q", "k", "cos", "sin") or names[4:] not in (
        ("unsqueeze_dim",),
        ("position_ids", "unsqueeze_dim"),
    ):
        raise Unfit("(q, k, cos, sin[, position_ids], unsqueeze_dim)", signature_text(parameter_names(function)))
    source = _source(function, "apply_rotary_pos_emb")
    if "rotate_half(q" not in source or "repeat_interleave" in source:
        raise Unfit("rotate-half (NeoX) rotary", "another rotary formula")
    return {"legacy_position_ids": "position_ids" in names, "function": function}


def _class_source(site: Site) -> tuple[type, str]:
    """The class holding the target ``forward`` and its whitespace-free source."""
    cls = _require_class(site)
    return cls, _source(cls, cls.__qualname__)


def probe_rms_norm(site: Site, names: tuple[str, ...]) -> dict[str, Any]:
    _, cls_source = _class_source(site)
    if len(names) != 2:
        raise Unfit("forward(self, hidden_states)", f"forward{signature_text(parameter_names(site.value))}")
    offset = bool(_OFFSET.search(cls_source))
    if not offset and "self.weight*" not in cls_source:
        raise Unfit("an RMSNorm scaling by self.weight or (1 + self.weight)", "neither")
    return {"eps_attr": _eps_attr(cls_source), "offset": offset}


def probe_rms_norm_gated(site: Site, names: tuple[str, ...]) -> dict[str, Any]:
    _, cls_source = _class_source(site)
    if len(names) != 3 or names[2] != "gate":
        raise Unfit("forward(self, hidden_states, gate)", f"forward{signature_text(parameter_names(site.value))}")
    eps_attr = _eps_attr(cls_source)
    gated = _GATED.search(cls_source)
    if not gated or gated.start() < cls_source.index("rsqrt("):
        raise Unfit("normalise, then multiply by silu(gate)", "a different gating order or activation")
    return {"eps_attr": eps_attr}


def probe_mlp(site: Site, names: tuple[str, ...]) -> dict[str, Any]:
    _class_source(site)
    if len(names) != 2:
        raise Unfit("forward(self, x)", f"forward{signature_text(parameter_names(site.value))}")
    x = names[1]
    expected = f"self.down_proj(self.act_fn(self.gate_proj({x}))*self.up_proj({x}))"
    if expected not in _source(site.value, "forward"):
        raise Unfit("down_proj(act_fn(gate_proj(x)) * up_proj(x))", "another MLP body")
    return {}


def probe_experts(site: Site, names: tuple[str, ...]) -> dict[str, Any]:
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
