"""Replacement forwards for the transformers Qwen families, built on torch_npu fused kernels.

Imported only by the transformers kernel builders (``builders``) at fix time, i.e.
once a modeling module (and therefore torch) is loaded. ``torch_npu`` itself is imported on the
first call of a replacement, never at import.

Every factory receives the original callable and what the structural probe found (attribute
names, layout) and returns a replacement that keeps the original's metadata. Replacements fall
back to the original when an instance does not fit the kernel (a non-SiLU activation, biased or
interleaved experts, expert parallelism), so a surprising configuration is slow, never wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

_torch_npu: Any = None


def npu() -> Any:
    """``torch_npu``, imported on first use."""
    global _torch_npu
    if _torch_npu is None:
        import torch_npu

        _torch_npu = torch_npu
    return _torch_npu


_SILU_TYPES = ("SiLU", "SiLUActivation")


def is_silu(act: Any) -> bool:
    """Whether an MLP's ``act_fn`` computes SiLU (``nn.SiLU``, transformers' ``SiLUActivation``)."""
    return act is F.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ in _SILU_TYPES


# --------------------------------------------------------------------------- RMSNorm
def rms_norm(original: Callable, eps_attr: str, offset: bool) -> Callable:
    """``npu_rms_norm`` replacement of an RMSNorm forward.

    ``offset=False``: Llama/Qwen2 style, ``weight * normalize(x)`` in the promoted dtype of
    input and weight. ``offset=True``: Qwen3-Next/Qwen3.5 style, ``normalize(x) * (1 + weight)``
    in fp32, cast back to the input dtype.
    """
    return (_offset_rms_norm if offset else _plain_rms_norm)(original, eps_attr)


def _offset_rms_norm(original: Callable, eps_attr: str) -> Callable:
    @functools.wraps(original)
    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        gamma = 1.0 + self.weight.float()
        out = npu().npu_rms_norm(hidden_states.float(), gamma, epsilon=getattr(self, eps_attr))[0]
        return out.type_as(hidden_states)

    return forward


def _plain_rms_norm(original: Callable, eps_attr: str) -> Callable:
    @functools.wraps(original)
    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if hidden_states.dtype != weight.dtype:  # the usual case (equal dtypes) pays for no cast
            dtype = torch.promote_types(hidden_states.dtype, weight.dtype)
            hidden_states, weight = hidden_states.to(dtype), weight.to(dtype)
        return npu().npu_rms_norm(hidden_states, weight, epsilon=getattr(self, eps_attr))[0]

    return forward


def _activation(norm: Any) -> str:
    """A gated norm's activation (``"silu"`` where the class names none, as 4.57's): read from the
    instance dict, not through ``nn.Module.__getattr__``, which raises each call where it is absent."""
    if torch.compiler.is_compiling():
        return getattr(norm, "activation", "silu")
    return norm.__dict__.get("activation", "silu")


def rms_norm_gated(original: Callable, eps_attr: str) -> Callable:
    """``npu_rms_norm`` replacement of a gated RMSNorm: ``weight * normalize(x) * silu(gate)``,
    normalised before gating, result in the input dtype."""

    @functools.wraps(original)
    def forward(self: Any, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if gate is None or _activation(self) not in ("silu", "swish"):
            return original(self, hidden_states, gate)
        dtype = hidden_states.dtype
        out = npu().npu_rms_norm(hidden_states.float(), self.weight.float(), epsilon=getattr(self, eps_attr))[0]
        return (out * F.silu(gate.float())).to(dtype)

    return forward


# --------------------------------------------------------------------------- SwiGLU MLP
#: The instance attribute caching ``(act_fn, is_silu(act_fn))`` of a module.
SILU_FLAG = "_verl_npu_autopatch_silu"


def swiglu_parts(module: Any) -> tuple[Any, Any, Any] | None:
    """``(gate_proj, up_proj, down_proj)`` of an MLP whose ``act_fn`` is SiLU, else ``None``.

    Decided once per module and activation: the verdict is kept beside the ``act_fn`` it was made
    for (:data:`SILU_FLAG`; a replaced ``act_fn`` is decided afresh), and the submodules are read
    from ``_modules`` (no ``nn.Module.__getattr__``), so a call costs less than reading the three
    projections as attributes. A compiled trace reads them as attributes, caching nothing."""
    if torch.compiler.is_compiling():
        fits = is_silu(getattr(module, "act_fn", None))
        return (module.gate_proj, module.up_proj, module.down_proj) if fits else None
    modules = module._modules
    act = modules.get("act_fn")  # an activation module (nn.SiLU, SiLUActivation)
    if act is None:
        act = getattr(module, "act_fn", None)  # a plain function
    cached = module.__dict__.get(SILU_FLAG)
    if cached is None or cached[0] is not act:
        cached = module.__dict__[SILU_FLAG] = (act, is_silu(act))
    return (modules["gate_proj"], modules["up_proj"], modules["down_proj"]) if cached[1] else None


def swiglu_mlp(original: Callable) -> Callable:
    """``npu_swiglu`` replacement of ``down(act(gate(x)) * up(x))`` when ``act`` is SiLU."""

    @functools.wraps(original)
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        parts = swiglu_parts(self)
        if parts is None:
            return original(self, x)
        gate, up, down = parts
        return down(npu().npu_swiglu(torch.cat((gate(x), up(x)), dim=-1), dim=-1))

    return forward


# --------------------------------------------------------------------------- rotary
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the leading ``cos.shape[-1]`` channels; the rest passes through."""
    rotary_dim = cos.shape[-1]
    mul = npu().npu_rotary_mul
    if rotary_dim == x.shape[-1]:
        return mul(x, cos, sin)
    return torch.cat((mul(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def _rotate_both(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rotate(q), rotate(k))`` with ``cos``/``sin`` unsqueezed at ``unsqueeze_dim`` and in q's
    dtype (npu_rotary_mul takes one dtype; upstream's rotary embedding already returns q's dtype,
    so the usual call casts nothing)."""
    if cos.dtype != q.dtype:
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotary(original: Callable, legacy_position_ids: bool) -> Callable:
    """``npu_rotary_mul`` replacement of ``apply_rotary_pos_emb`` (full or partial rotary dim).

    ``legacy_position_ids``: the original signature is ``(q, k, cos, sin, position_ids=None,
    unsqueeze_dim=1)`` (older transformers) rather than ``(q, k, cos, sin, unsqueeze_dim=1)``.
    """
    return (_legacy_rotary if legacy_position_ids else _plain_rotary)(original)


def _legacy_rotary(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply_rotary_pos_emb(
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        unsqueeze_dim: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotate_both(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def _plain_rotary(original: Callable) -> Callable:
    @functools.wraps(original)
    def apply_rotary_pos_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotate_both(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


# --------------------------------------------------------------------------- MoE
class GroupedMatmul(torch.autograd.Function):
    """``y[rows of group e] = x[rows of group e] @ weight[e]`` with ``npu_grouped_matmul``.

    ``x``: ``[M, K]`` rows sorted by group; ``weight``: ``[E, K, N]``; ``counts``: ``[E]`` int64 rows
    per group (``group_list_type=1``). Backward: ``dx`` is the same grouped matmul of ``dy`` with
    each ``weight[e]`` transposed; ``dweight[e] = x_e^T @ dy_e``, a grouped matmul split along K
    (``group_type=2``), zero for an empty group.

    The calls mirror verl's hardware-validated ``NPUGmmFunction`` (``verl/models/transformers/
    npu_patch.py``) and the torch_npu contract (``npu_grouped_matmul`` docs: "x不支持转置", x is never
    transposed in the M split, "支持weight转置"; the K split reads x as ``[K, M]``, i.e. a transposed
    view of a row-major ``[M, K]``, as the torch_npu 2.14 meta function says). So ``weight`` is
    taken row-major or as the transposed view of an ``F.linear``-layout ``[E, N, K]`` parameter (verl
    passes such views on hardware), ``dx`` takes the transposed *view* of the weight (no copy of
    every expert's weight at any pass) and ``dweight`` the transposed *view* of ``x``: a contiguous
    copy would lose the transposition the K split needs. For a transposed-view weight ``dweight``
    is computed transposed (``dy^T`` split along K against ``x``), so it arrives in the layout of the
    tensor the view reads and accumulates there without a copy.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()  # row-major [M, K]: not transposed here, a transposed view in the K split
        ctx.save_for_backward(x, weight, counts)
        return npu().npu_grouped_matmul(
            [x], [weight], group_list=counts, split_item=2, group_type=0, group_list_type=1
        )[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, counts = ctx.saved_tensors
        grad = grad.contiguous()  # dx's x and dweight's weight: neither may be transposed
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = npu().npu_grouped_matmul(
                [grad], [weight.transpose(1, 2)], group_list=counts, split_item=2, group_type=0, group_list_type=1
            )[0]
        if ctx.needs_input_grad[1]:
            # dW^T[e] = dy_e^T @ x_e where the weight is the transposed view of an [E, N, K] tensor: the
            # gradient then comes in that tensor's own layout (no copy when it accumulates into it).
            swap = _transposed_view(weight)
            a, b = (grad, x) if swap else (x, grad)
            grad_w = npu().npu_grouped_matmul(
                [a.transpose(0, 1)], [b], group_list=counts, split_item=3, group_type=2, group_list_type=1
            )[0]
            grad_w = grad_w.transpose(1, 2) if swap else grad_w
        return grad_x, grad_w, None


def _transposed_view(weight: torch.Tensor) -> bool:
    """Whether each ``weight[e]`` is the transposed view of a row-major matrix."""
    rows = weight.shape[-2]
    return rows > 1 and weight.stride(-2) == 1 and weight.stride(-1) == rows


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Differentiable grouped matmul (see :class:`GroupedMatmul`)."""
    return GroupedMatmul.apply(x, weight, counts)


def group_counts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert, ``[num_experts]`` in the index dtype (int64 from ``topk``): one ``histc``, as
    verl's hardware-run callers count (the NPU's ``histc`` counts integer tensors in their own
    dtype); a fixed length, unlike ``torch.bincount``'s, which ``torch.export`` cannot trace."""
    return torch.histc(top_k_index, bins=num_experts, min=0, max=num_experts)


def routed_experts(
    tokens: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU experts over routed tokens: permute → GMM(gate_up) → swiglu → GMM(down) → unpermute.

    ``tokens``: ``[T, H]``; ``top_k_index``/``top_k_weights``: ``[T, K]``; ``gate_up``:
    ``[E, H, 2I]`` (gate columns first); ``down``: ``[E, I, H]``. Returns ``[T, H]``, each token the
    routing-weighted sum of its experts' outputs.
    """
    ops = npu()
    # int32 indices as verl's hardware-run callers pass them (the torch_npu docs name int64; both run)
    permuted, sorted_indices = ops.npu_moe_token_permute(tokens, top_k_index.to(torch.int32))
    counts = group_counts(top_k_index, gate_up.shape[0])
    hidden = grouped_matmul(permuted, gate_up, counts)
    hidden = grouped_matmul(ops.npu_swiglu(hidden, dim=-1), down, counts)
    probs = top_k_weights if top_k_weights.dtype == hidden.dtype else top_k_weights.to(hidden.dtype)
    out = ops.npu_moe_token_unpermute(hidden, sorted_indices, probs=probs)
    return out if out.dtype == tokens.dtype else out.to(tokens.dtype)


def experts_fit(experts: Any) -> bool:
    """Whether a fused experts module is one the kernel reproduces: SiLU, concatenated gate/up, no
    bias, not expert-parallel (transformers 5.x sets these flags; older classes lack them)."""
    return (
        is_silu(getattr(experts, "act_fn", None))
        and not getattr(experts, "has_bias", False)
        and getattr(experts, "has_gate", True)
        and getattr(experts, "is_concatenated", True)
        and not getattr(experts, "_is_expert_parallel", False)
    )


def run_fused_experts(
    experts: Any, transposed: bool, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The kernel on a fused experts module. ``transposed=False``: ``gate_up_proj`` is
    ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` (``F.linear`` layout); ``True``: ``[E, H, 2I]``
    and ``[E, I, H]``. The module's own ``is_transposed`` flag wins when it has one."""
    flip = getattr(experts, "is_transposed", transposed)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    # [E, K, N] as they are ([E, H, 2I] row-major) or as transposed views of the F.linear layout: the
    # grouped matmul takes a transposed weight (see GroupedMatmul), so no expert weight is copied.
    if not flip:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return routed_experts(tokens, top_k_index, top_k_weights, gate_up, down)


def fused_experts(original: Callable, transposed: bool) -> Callable:
    """Replacement of a fused ``Experts.forward(hidden_states, top_k_index, top_k_weights)`` that
    transformers does not dispatch (no ``@use_experts_implementation``). Falls back to the original
    when :func:`experts_fit` says no."""

    @functools.wraps(original)
    def forward(
        self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if not experts_fit(self):
            return original(self, hidden_states, top_k_index, top_k_weights)
        return run_fused_experts(self, transposed, hidden_states, top_k_index, top_k_weights)

    return forward


def _expert_fits(expert: Any) -> bool:
    return all(
        getattr(getattr(expert, n, None), "bias", 1) is None for n in ("gate_proj", "up_proj", "down_proj")
    ) and is_silu(getattr(expert, "act_fn", None))


def _route(block: Any, tokens: torch.Tensor, normalize: bool | None) -> tuple[torch.Tensor, ...]:
    """``(router_logits, top-k weights in the token dtype, top-k index)`` of a linear-router block:
    softmax in fp32, top-k, renormalised when ``normalize`` (``None``: the block's
    ``norm_topk_prob``)."""
    router_logits = block.gate(tokens)
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, index = torch.topk(probs, block.top_k, dim=-1)
    if getattr(block, "norm_topk_prob", False) if normalize is None else normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return router_logits, weights.to(tokens.dtype), index


def legacy_moe_block(original: Callable) -> Callable:
    """Replacement of a legacy sparse-MoE block forward (transformers 4.x): ``gate`` is a linear
    router, ``experts`` a ``ModuleList`` of per-expert SwiGLU MLPs; returns ``(hidden, logits)``.
    A block with a ``shared_expert`` (Qwen3-Next) adds ``sigmoid(shared_expert_gate(x)) *
    shared_expert(x)``.
    """

    @functools.wraps(original)
    def forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts = self.experts
        if not all(_expert_fits(expert) for expert in experts):
            return original(self, hidden_states)
        batch, seq, hidden = hidden_states.shape
        tokens = hidden_states.view(-1, hidden)
        router_logits, weights, index = _route(self, tokens, None)
        # One stack per weight ([2E, I, H] read as [E, 2I, H]: each expert's gate rows, then its up
        # rows), then transposed views: every expert weight is copied once, as verl's stacks copy it.
        gate_up = torch.stack([w for e in experts for w in (e.gate_proj.weight, e.up_proj.weight)])
        gate_up = gate_up.view(len(experts), -1, hidden)
        down = torch.stack([e.down_proj.weight for e in experts])
        out = routed_experts(tokens, index, weights, gate_up.transpose(1, 2), down.transpose(1, 2))
        if getattr(self, "shared_expert", None) is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return out.view(batch, seq, hidden), router_logits

    return forward


def fused_moe_block(original: Callable, transposed: bool) -> Callable:
    """Replacement of a sparse-MoE block forward whose ``experts`` is one fused module called as
    ``experts(hidden, routing_weights, router_indices)`` (transformers 4.57 Qwen3-VL-MoE, where
    the experts module cannot be given routed tokens): routes like upstream (softmax, top-k,
    always renormalised) and runs the kernel on the fused ``gate_up_proj``/``down_proj``; returns
    ``(hidden [B, S, H], router_logits)``."""

    @functools.wraps(original)
    def forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts = self.experts
        if not experts_fit(experts):
            return original(self, hidden_states)
        batch = hidden_states.shape[0]
        tokens = hidden_states.reshape(-1, self.hidden_size)
        router_logits, weights, index = _route(self, tokens, True)
        out = run_fused_experts(experts, transposed, tokens, index, weights)
        return out.view(batch, -1, self.hidden_size), router_logits

    return forward
