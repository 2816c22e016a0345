"""TEST DOUBLE for ``torch_npu``: CPU reference emulation of the NPU ops our kernels call.

Not torch_npu. Each function follows the op's documented definition (Ascend torch_npu / aclnn
API reference) with plain, differentiable torch code, so tests can run our replacement forwards
and backward on CPU. ``calls`` counts invocations per op, so tests can prove a kernel ran.
Install with ``install(monkeypatch)``, which puts this module at ``sys.modules["torch_npu"]``.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch

calls: Counter[str] = Counter()


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``rstd = 1/sqrt(mean(x^2, -1) + eps)`` (fp32); ``y = x * rstd * gamma`` in x's dtype."""
    calls["npu_rms_norm"] += 1
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``a, b = x.chunk(2, dim)``; ``silu(a) * b``."""
    calls["npu_swiglu"] += 1
    a, b = x.chunk(2, dim=dim)
    return torch.nn.functional.silu(a) * b


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """``half`` mode: ``x * r1 + cat(-x2, x1) * r2`` where ``x1, x2`` are the halves of ``x``."""
    calls["npu_rotary_mul"] += 1
    assert rotary_mode == "half"
    assert x.dtype == r1.dtype == r2.dtype, "npu_rotary_mul needs one dtype"
    x1, x2 = x.chunk(2, dim=-1)
    return x * r1 + torch.cat((-x2, x1), dim=-1) * r2


def npu_moe_token_permute(
    tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None, padded_mode: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``first = argsort(flatten(indices))`` (stable), ``sorted_indices = argsort(first)``,
    ``out[sorted_indices[i]] = tokens[i // topK]``. ``sorted_indices`` is int32."""
    calls["npu_moe_token_permute"] += 1
    assert not padded_mode and indices.dtype == torch.int32
    top_k = 1 if indices.dim() == 1 else indices.shape[1]
    first = torch.argsort(indices.reshape(-1), stable=True)
    sorted_indices = torch.argsort(first, stable=True)
    permuted = tokens.index_select(0, first // top_k)  # row sorted_indices[i] holds tokens[i // topK]
    if num_out_tokens:
        permuted = permuted[:num_out_tokens]
    return permuted, sorted_indices.to(torch.int32)


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Any = None,
) -> torch.Tensor:
    """``T[k] = permuted[S[k]] * P[i][j]``; ``out[i] = sum_{k=i*topK}^{(i+1)*topK-1} T[k]``."""
    calls["npu_moe_token_unpermute"] += 1
    assert not padded_mode
    top_k = 1 if probs is None else probs.shape[1]
    gathered = permuted_tokens.index_select(0, sorted_indices.long())
    gathered = gathered.view(-1, top_k, permuted_tokens.shape[-1])
    if probs is not None:
        assert probs.dtype == permuted_tokens.dtype
        gathered = gathered * probs.unsqueeze(-1)
    return gathered.sum(dim=1)


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias: Any = None,
    group_list: torch.Tensor | None = None,
    split_item: int = 0,
    group_type: int = -1,
    group_list_type: int = 0,
    **unused: Any,
) -> list[torch.Tensor]:
    """Single-tensor forms only. ``group_list_type=1``: ``group_list`` holds per-group sizes
    (``0``: cumulative ends). ``group_type=0`` (split M): ``x [M, K]``, ``weight [E, K, N]``,
    ``y[rows of e] = x[rows of e] @ weight[e]``, returned as one ``[M, N]`` (``split_item`` 2/3).
    ``group_type=2`` (split K): ``x [M, K]``, ``weight [K, N]``, ``y[e] = x[:, cols of e] @
    weight[rows of e]``, returned as one ``[E, M, N]``."""
    calls[f"npu_grouped_matmul[group_type={group_type}]"] += 1
    assert bias is None and len(x) == 1 and len(weight) == 1 and split_item in (2, 3)
    sizes = group_list.long()
    if group_list_type == 0:
        sizes = torch.diff(sizes, prepend=sizes.new_zeros(1))
    bounds = [0, *torch.cumsum(sizes, 0).tolist()]
    (a,), (b,) = x, weight
    if group_type == 0:
        assert b.dim() == 3 and b.shape[0] == len(sizes)
        parts = [a[bounds[e] : bounds[e + 1]] @ b[e] for e in range(len(sizes))]
        rest = a.shape[0] - bounds[-1]
        parts.append(a.new_zeros(rest, b.shape[-1]))
        return [torch.cat(parts, dim=0)]
    if group_type == 2:
        assert b.dim() == 2 and a.shape[1] == b.shape[0]
        return [
            torch.stack([a[:, bounds[e] : bounds[e + 1]] @ b[bounds[e] : bounds[e + 1]] for e in range(len(sizes))])
        ]
    raise NotImplementedError(f"group_type={group_type}")


def install(monkeypatch: Any) -> Any:
    """Make ``import torch_npu`` return this test double (undone by ``monkeypatch``)."""
    from verl_npu_autopatch.patches import _npu_kernels

    calls.clear()
    monkeypatch.setitem(sys.modules, "torch_npu", sys.modules[__name__])
    monkeypatch.setattr(_npu_kernels, "_torch_npu", None)
    return sys.modules[__name__]


def integer_histc(monkeypatch: Any) -> None:
    """TEST DOUBLE for the NPU's ``torch.histc``, which counts integer tensors (verl's MoE forwards
    pass the int64 expert indices); CPU torch takes floating tensors only, so integers are counted
    as floats here (exact for expert indices)."""
    import torch

    histc = torch.histc

    def npu_histc(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return histc(input if input.is_floating_point() else input.float(), *args, **kwargs)

    monkeypatch.setattr(torch, "histc", npu_histc)
