"""The tiny inputs of ``doctor --verify`` for the transformers kernels: for one applied kernel
patch, its patched and its upstream (pre-patch) callable, and a builder of one call's arguments
in a dtype on a device (what a case is: ``authoring.verify_case``).

The upstream callable is the one the replacement wraps (``functools.wraps`` keeps it as
``__wrapped__``); behind transformers' experts dispatcher it is the eager forward the dispatcher
wraps, and the patched one is our registered implementation. Instances are built small: norms
by their own constructor, MLPs as a bare module holding the three projections the forward reads,
experts and MoE blocks from a tiny config. Imported by :mod:`verl_npu_autopatch.cli.verify` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from verl_npu_autopatch.authoring import normalized_source
from verl_npu_autopatch.authoring.verify_case import (
    FF,
    HEADS,
    KV,
    B,
    Call,
    Case,
    D,
    E,
    H,
    K,
    S,
    Unverifiable,
    leaf,
    placed,
    replaced,
    resolve,
)


def _pair(name: str, owner: Any, value: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(patched, upstream)`` for the live target ``value`` held by ``owner``."""
    pair = replaced(name, value)
    if pair is not None:
        return pair
    import verl_npu_autopatch.patches.transformers_npu.experts_interface as interface
    from verl_npu_autopatch.patches.transformers_npu.probes import dispatcher_interface

    dispatcher = dispatcher_interface(value)
    if dispatcher is not None and isinstance(owner, type) and interface.installed(owner):
        return dispatcher[interface.NAME], value.__wrapped__
    raise Unverifiable("the live target is not this patch's replacement")


def _norm(cls: type, gated: bool) -> Callable[[torch.dtype, torch.device], Call]:
    def make(dtype: torch.dtype, device: torch.device) -> Call:
        norm = placed(cls(H), dtype, device, norm=True)
        x = leaf(B, S, H, dtype=dtype, device=device)
        extra = (leaf(B, S, H, dtype=dtype, device=device),) if gated else ()
        return Call((norm, x, *extra), [x, *extra, norm.weight])

    return make


def _mlp(cls: Any) -> Callable[[torch.dtype, torch.device], Call]:
    from transformers.activations import ACT2FN

    def make(dtype: torch.dtype, device: torch.device) -> Call:
        mlp = cls.__new__(cls)
        torch.nn.Module.__init__(mlp)
        mlp.gate_proj = torch.nn.Linear(H, FF, bias=False)
        mlp.up_proj = torch.nn.Linear(H, FF, bias=False)
        mlp.down_proj = torch.nn.Linear(FF, H, bias=False)
        mlp.act_fn = ACT2FN["silu"]
        mlp = placed(mlp, dtype, device)
        x = leaf(B, S, H, dtype=dtype, device=device)
        return Call((mlp, x), [x, *mlp.parameters()])

    return make


def _rotary(upstream: Callable[..., Any]) -> tuple[Callable[[torch.dtype, torch.device], Call], int]:
    """q, k and the cos/sin tables, and how many channels rotate: half the head dim where
    upstream takes a partial rotary (``rotary_dim = cos.shape[-1]``, Qwen3-Next / Qwen3.5), else
    all of it."""
    rotated = D // 2 if "rotary_dim=cos.shape[-1]" in (normalized_source(upstream) or "") else D

    def make(dtype: torch.dtype, device: torch.device) -> Call:
        q = leaf(B, HEADS, S, D, dtype=dtype, device=device)
        k = leaf(B, KV, S, D, dtype=dtype, device=device)
        angles = torch.rand(B, S, rotated // 2) * 6.0
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = (t.to(device=device, dtype=dtype) for t in (emb.cos(), emb.sin()))
        return Call((q, k, cos, sin), [q, k])

    return make, rotated


def tiny_config() -> Any:
    """A transformers config holding every attribute the MoE experts and blocks read."""
    import transformers

    config_cls = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    return config_cls(
        hidden_size=H,
        intermediate_size=FF,
        moe_intermediate_size=FF,
        shared_expert_intermediate_size=FF,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        hidden_act="silu",
        rms_norm_eps=1e-6,
    )


def _routing(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token and their softmax weights (a leaf: the router trains). The
    last expert gets no token: its weight gradient must be zero as upstream's, which no torch_npu
    document promises for the K-split grouped matmul (docs/device-contract.md)."""
    index = torch.rand(B * S, E - 1).topk(K, dim=-1).indices.to(device)
    weights = torch.softmax(torch.randn(B * S, K), dim=-1).to(device=device, dtype=dtype).requires_grad_()
    return index, weights


def _experts(cls: type, block: bool) -> Callable[[torch.dtype, torch.device], Call]:
    def make(dtype: torch.dtype, device: torch.device) -> Call:
        module = placed(cls(tiny_config()), dtype, device)
        params = [p for p in module.parameters() if p.requires_grad]
        if block:
            x = leaf(B, S, H, dtype=dtype, device=device)
            return Call((module, x), [x, *params])
        x = leaf(B * S, H, dtype=dtype, device=device)
        index, weights = _routing(dtype, device)
        return Call((module, x, index, weights), [x, weights, *params])

    return make


def case(name: str, target: str) -> Case:
    """The case of the applied patch ``name`` (``transformers.<family>.<kind>``) on ``target``."""
    kind = name.rsplit(".", 1)[-1]
    owner, value = resolve(target)
    patched, upstream = _pair(name, owner, value)
    hidden = f"x [{B}, {S}, {H}]"
    if kind in ("rms_norm", "rms_norm_gated"):
        gated = kind == "rms_norm_gated"
        return Case(name, patched, upstream, _norm(owner, gated), hidden + (", gate alike" if gated else ""))
    if kind in ("mlp", "vision_mlp"):
        return Case(name, patched, upstream, _mlp(owner), f"{hidden}, intermediate {FF}")
    if kind == "rotary":
        make, rotated = _rotary(upstream)
        return Case(name, patched, upstream, make, f"q [{B}, {HEADS}, {S}, {D}], k {KV} heads, rotary dim {rotated}")
    if kind == "experts":
        block = target.endswith("SparseMoeBlock.forward")
        routed = f"{hidden} through the block" if block else f"{B * S} routed tokens"
        return Case(name, patched, upstream, _experts(owner, block), f"{routed}, {E} experts, top-{K}")
    raise Unverifiable(f"no tiny input for kernel kind {kind!r}")
