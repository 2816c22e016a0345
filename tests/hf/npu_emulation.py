"""TEST DOUBLE for ``torch_npu``: the NPU ops our kernels call, bound to the real op contract.

Not torch_npu. Every call is bound to the op's schema in a real torch_npu release
(:mod:`npu_contract`: ``TypeError`` on unknown keywords, keyword-only arguments given by position,
missing arguments, wrong types), then checked against the documented device rules in
:data:`RULES` (``ContractError``, a ``RuntimeError`` as the device's own checks raise), then
computed on CPU with plain differentiable torch code following the op's documented definition, and
its result checked against the schema's return type and arity.

``calls`` counts invocations per op (``npu_grouped_matmul[group_type=N]`` for the grouped matmul);
``trace`` records each call as the op receives it: its op and every bound argument, defaults filled
in (tensors as shape, dtype and strides), for the trace-parity tests. Install with
``install(monkeypatch)``, which puts this module at ``sys.modules["torch_npu"]``;
``use_release(version)`` picks the torch_npu release whose contract is enforced (default: the
newest).
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from tests.hf import meter, npu_contract

calls: Counter[str] = Counter()
trace: list[tuple[Any, ...]] = []
release = npu_contract.NEWEST
#: The floating dtypes the device takes; :func:`allow_float64` widens it for math-only checks.
floats: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)

#: Device rules beyond the schema: rule id -> where the rule comes from.
RULES: dict[str, str] = {
    "float_dtype": "every op here: fp16, bf16 or fp32 (torch_npu docs of each op)",
    "rms_norm.gamma_dtype": "npu_rms_norm docs: gamma's dtype must equal self's",
    "rms_norm.rank": "npu_rms_norm docs: self has 2 to 8 dimensions",
    "rotary.rank": "npu_rotary_mul docs: input, r1 and r2 are 4-dimensional",
    "rotary.dtype": "npu_rotary_mul: input, r1, r2 of one dtype (verl's hardware caller passes them alike)",
    "rotary.layout": "npu_rotary_mul docs: r1/r2 broadcast to input (11SD, B1SD, 1S1D, ...), D even and < 896",
    "rotary.mode": "npu_rotary_mul docs: rotary_mode 'half' or 'interleave'",
    "swiglu.split": "npu_swiglu docs: x splits in two halves along dim (1 to 8 dimensions)",
    "permute.shape": "npu_moe_token_permute docs: tokens [T, H], indices [T, topK], topK <= 512",
    "permute.indices_dtype": "npu_moe_token_permute docs: indices int64; verl's hardware caller passes int32",
    "permute.padded": "npu_moe_token_permute / unpermute docs: padded_mode only False",
    "unpermute.shape": "npu_moe_token_unpermute docs: permuted [T*topK, H], sorted_indices [T*topK], probs [T, topK]",
    "unpermute.dtype": "npu_moe_token_unpermute docs: permuted_tokens and probs of one dtype; indices int32/int64",
    "gmm.unsupported_argument": "npu_grouped_matmul: quantisation/activation arguments stay None (not emulated)",
    "gmm.group_list": "npu_grouped_matmul docs: group_list a 1-D int64 tensor, one entry per group (<= 1024)",
    "gmm.group_list_type": "npu_grouped_matmul docs: group_list_type 0 (cumsum) or 1 (sizes)",
    "gmm.group_type": "npu_grouped_matmul meta: group_type -1, 0 or 2 (schema default None is refused)",
    "gmm.split_item": "npu_grouped_matmul docs: single x/weight/y tensors need split_item 2 or 3",
    "gmm.single": "npu_grouped_matmul: one x and one weight tensor (the only form emulated)",
    "gmm.dtype": "npu_grouped_matmul docs (non-quantised): x and weight of one dtype",
    "gmm.m_split_layout": "npu_grouped_matmul docs, group_type 0: x [M, K] not transposed ('x不支持转置'), "
    "weight [E, K, N] 3-D",
    "gmm.weight_layout": "npu_grouped_matmul, group_type 0: each weight[e] row-major (docs) or transposed "
    "('支持weight转置'; verl 0.9.1 npu_patch.py 168-170 passes such views, a fused gate/up's halves too), "
    "nothing else",
    "gmm.k_split_layout": "npu_grouped_matmul, group_type 2 (torch_npu 2.14 meta, verl/MindSpeed hardware callers, "
    "CANN K-split docs): x a transposed [K, M] view, weight [K, N] not transposed",
    "gmm.group_sizes": "npu_grouped_matmul docs: the group sizes sum to the grouped axis",
    "gmm.meta_group_type_2": "torch_npu 2.6.0.post5 meta: group_type only -1 and 0 (compiled graphs refuse 2)",
}


class ContractError(RuntimeError):
    """A call the device refuses; ``rule`` names the entry of :data:`RULES`."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(f"[{rule}] {detail} ({RULES[rule]})")
        self.rule = rule


def require(ok: bool, rule: str, detail: str) -> None:
    if not ok:
        raise ContractError(rule, detail)


def use_release(version: str) -> None:
    """Enforce the contract of torch_npu ``version`` (one of :data:`npu_contract.WHEELS`)."""
    global release
    npu_contract.schemas(version)  # fails here, not at the first call, when it cannot be read
    release = version


def summary(value: Any) -> Any:
    """A trace entry's view of an argument: tensors as ``(shape, dtype, strides)``."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype).removeprefix("torch."), value.stride())
    if isinstance(value, (list, tuple)):
        return tuple(summary(v) for v in value)
    return value


def _op(function: Callable[..., Any]) -> Callable[..., Any]:
    """Bind every call to the schema of ``function``'s op, record it, check what it returns."""
    name = function.__name__

    @functools.wraps(function)
    def op(*args: Any, **kwargs: Any) -> Any:
        schema = npu_contract.schemas(release)[name]
        bound = schema.bind(args, kwargs)
        trace.append((name, tuple((k, summary(v)) for k, v in bound.items())))
        calls[name if name != "npu_grouped_matmul" else f"{name}[group_type={bound['group_type']}]"] += 1
        return schema.check_result(meter.run_as_one_op(function, bound))

    return op


def _float(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        require(tensor.dtype in floats, "float_dtype", str(tensor.dtype))


def transposed(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """The docs' "transposed": shape ``[M, K]`` with strides ``[1, M]`` (last two dims)."""
    return len(shape) >= 2 and strides[-2] == 1 and strides[-1] == shape[-2]


def is_transposed(tensor: torch.Tensor) -> bool:
    return transposed(tuple(tensor.shape), tensor.stride())


def layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> str:
    """A traced tensor's layout as the rules see it: ``row-major``, ``transposed`` or ``strided``."""
    expected, row_major = 1, True
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        row_major &= size == 1 or stride == expected
        expected *= size
    return "row-major" if row_major else "transposed" if transposed(shape, strides) else "strided"


def dense_matrices(tensor: torch.Tensor) -> bool:
    """Each matrix (last two dims) row-major or transposed, whatever the stride between matrices
    (a transposed half of a fused ``[E, 2I, H]`` weight, as verl passes it, is still one)."""
    rows, cols = tensor.shape[-2:]
    row_stride, col_stride = tensor.stride()[-2:]
    row_major = (col_stride == 1 or cols == 1) and (row_stride == cols or rows == 1)
    return row_major or ((row_stride == 1 or rows == 1) and (col_stride == rows or cols == 1))


def plain(tensor: torch.Tensor) -> bool:
    """Not transposed: row-major, or any other strides the framework copies before the kernel
    (verl's hardware-run backward passes a column slice of the gate/up gradient)."""
    return tensor.is_contiguous() or not is_transposed(tensor)


@_op
def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``rstd = 1/sqrt(mean(x^2, -1) + eps)`` (fp32); ``y = x * rstd * gamma`` in x's dtype."""
    _float(self, gamma)
    require(gamma.dtype == self.dtype, "rms_norm.gamma_dtype", f"{self.dtype} and {gamma.dtype}")
    require(2 <= self.dim() <= 8, "rms_norm.rank", f"{self.dim()} dimensions")
    x32 = self.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(self.dtype), rstd


@_op
def npu_swiglu(self: torch.Tensor, dim: int) -> torch.Tensor:
    """``a, b = x.chunk(2, dim)``; ``silu(a) * b``."""
    _float(self)
    require(1 <= self.dim() <= 8 and self.shape[dim] % 2 == 0, "swiglu.split", f"shape {tuple(self.shape)}, dim {dim}")
    a, b = self.chunk(2, dim=dim)
    return torch.nn.functional.silu(a) * b


@_op
def npu_rotary_mul(
    self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str, rotate: Any = None
) -> torch.Tensor:
    """``half`` mode: ``x * r1 + cat(-x2, x1) * r2`` where ``x1, x2`` are the halves of ``x``."""
    _float(self, r1, r2)
    require(rotary_mode in ("half", "interleave"), "rotary.mode", rotary_mode)
    require(self.dim() == r1.dim() == r2.dim() == 4, "rotary.rank", f"{self.dim()}, {r1.dim()}, {r2.dim()}")
    require(self.dtype == r1.dtype == r2.dtype, "rotary.dtype", f"{self.dtype}, {r1.dtype}, {r2.dtype}")
    depth = self.shape[-1]
    broadcast = all(c in (1, x) for c, x in zip(r1.shape, self.shape, strict=False))
    require(
        r1.shape == r2.shape and broadcast and r1.shape[-1] == depth and depth % 2 == 0 and depth < 896,
        "rotary.layout",
        f"input {tuple(self.shape)}, r1 {tuple(r1.shape)}, r2 {tuple(r2.shape)}",
    )
    require(rotary_mode == "half" and rotate is None, "rotary.mode", "only 'half' without rotate is emulated")
    x1, x2 = self.chunk(2, dim=-1)
    return self * r1 + torch.cat((-x2, x1), dim=-1) * r2


@_op
def npu_moe_token_permute(
    tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None, padded_mode: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``first = argsort(flatten(indices))`` (stable), ``sorted_indices = argsort(first)``,
    ``out[sorted_indices[i]] = tokens[i // topK]``. ``sorted_indices`` is int32 (the docs)."""
    _float(tokens)
    require(not padded_mode, "permute.padded", "padded_mode=True")
    require(indices.dtype in (torch.int32, torch.int64), "permute.indices_dtype", str(indices.dtype))
    ok = tokens.dim() == 2 and indices.dim() == 2 and indices.shape[0] == tokens.shape[0] and indices.shape[1] <= 512
    require(ok, "permute.shape", f"tokens {tuple(tokens.shape)}, indices {tuple(indices.shape)}")
    top_k = indices.shape[1]
    first = torch.argsort(indices.reshape(-1), stable=True)
    sorted_indices = torch.argsort(first, stable=True)
    permuted = tokens.index_select(0, first // top_k)  # row sorted_indices[i] holds tokens[i // topK]
    if num_out_tokens:
        permuted = permuted[:num_out_tokens]
    return permuted, sorted_indices.to(torch.int32)


@_op
def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None,
    padded_mode: bool,
    restore_shape: Any,
) -> torch.Tensor:
    """``T[k] = permuted[S[k]] * P[i][j]``; ``out[i] = sum_{k=i*topK}^{(i+1)*topK-1} T[k]``."""
    _float(permuted_tokens)
    require(not padded_mode, "permute.padded", "padded_mode=True")
    top_k = 1 if probs is None else probs.shape[1]
    rows = sorted_indices.shape[0] if sorted_indices.dim() == 1 else -1
    ok = permuted_tokens.dim() == 2 and rows == permuted_tokens.shape[0]
    ok = ok and (probs is None or (probs.dim() == 2 and probs.shape[0] * top_k == rows))
    shapes = [tuple(t.shape) for t in (permuted_tokens, sorted_indices, probs) if t is not None]
    require(ok, "unpermute.shape", f"shapes {shapes}")
    dtypes_ok = sorted_indices.dtype in (torch.int32, torch.int64)
    dtypes_ok = dtypes_ok and (probs is None or probs.dtype == permuted_tokens.dtype)
    require(
        dtypes_ok,
        "unpermute.dtype",
        f"{permuted_tokens.dtype}, {sorted_indices.dtype}, {getattr(probs, 'dtype', None)}",
    )
    gathered = permuted_tokens.index_select(0, sorted_indices.long()).view(-1, top_k, permuted_tokens.shape[-1])
    if probs is not None:
        gathered = gathered * probs.unsqueeze(-1)
    return gathered.sum(dim=1)


_GMM_UNEMULATED = (
    "bias",
    "scale",
    "offset",
    "antiquant_scale",
    "antiquant_offset",
    "per_token_scale",
    "activation_input",
    "activation_quant_scale",
    "activation_quant_offset",
    "tuning_config",
    "output_dtype",
)


@_op
def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    group_list: torch.Tensor | None,
    split_item: int,
    group_type: int | None,
    group_list_type: int,
    act_type: int,
    **rest: Any,
) -> list[torch.Tensor]:
    """Single-tensor forms. ``group_list_type=1``: per-group sizes (``0``: cumulative ends).
    ``group_type=0`` (split M): ``x [M, K]``, ``weight [E, K, N]``, ``y[rows of e] = x[rows of e] @
    weight[e]``, one ``[M, N]``. ``group_type=2`` (split K): ``x`` a transposed ``[K, M]`` view,
    ``weight [M, N]``, ``y[e] = x[:, cols of e] @ weight[rows of e]``, one ``[E, K, N]``; an empty
    group gives zeros (assumed, as verl assumes: no doc says it)."""
    given = [k for k in _GMM_UNEMULATED if rest.get(k) is not None] + (["act_type"] if act_type else [])
    require(not given, "gmm.unsupported_argument", ", ".join(given))
    require(group_type in (-1, 0, 2), "gmm.group_type", repr(group_type))
    meta_refuses = release == npu_contract.OLDEST and group_type == 2 and torch.compiler.is_compiling()
    require(not meta_refuses, "gmm.meta_group_type_2", f"torch_npu {release} under torch.compile")
    require(len(x) == 1 and len(weight) == 1, "gmm.single", f"{len(x)} x, {len(weight)} weight")
    require(split_item in (2, 3), "gmm.split_item", repr(split_item))
    require(group_list_type in (0, 1), "gmm.group_list_type", repr(group_list_type))
    (a,), (b,) = x, weight
    _float(a, b)
    require(a.dtype == b.dtype, "gmm.dtype", f"{a.dtype} and {b.dtype}")
    groups = b.shape[0] if group_type == 0 else None
    ok = group_list is not None and group_list.dtype == torch.int64 and group_list.dim() == 1
    ok = ok and group_list.shape[0] <= 1024 and group_list.shape[0] == (groups or group_list.shape[0])
    require(ok, "gmm.group_list", f"{None if group_list is None else (group_list.dtype, tuple(group_list.shape))}")
    sizes = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    bounds = [0, *torch.cumsum(sizes, 0).tolist()]
    if group_type == 2:
        ok = a.dim() == 2 and b.dim() == 2 and is_transposed(a) and plain(b) and a.shape[1] == b.shape[0]
        require(ok, "gmm.k_split_layout", f"x {tuple(a.shape)} strides {a.stride()}, weight {tuple(b.shape)}")
        require(bounds[-1] == a.shape[1], "gmm.group_sizes", f"{bounds[-1]} rows of {a.shape[1]}")
        return [
            torch.stack([a[:, bounds[e] : bounds[e + 1]] @ b[bounds[e] : bounds[e + 1]] for e in range(len(sizes))])
        ]
    ok = a.dim() == 2 and b.dim() == 3 and plain(a) and a.shape[1] == b.shape[1]
    require(ok, "gmm.m_split_layout", f"x {tuple(a.shape)} strides {a.stride()}, weight {tuple(b.shape)}")
    require(dense_matrices(b), "gmm.weight_layout", f"weight {tuple(b.shape)} strides {b.stride()}")
    require(bounds[-1] == a.shape[0], "gmm.group_sizes", f"{bounds[-1]} rows of {a.shape[0]}")
    return [torch.cat([a[bounds[e] : bounds[e + 1]] @ b[e] for e in range(len(sizes))], dim=0)]


def install(monkeypatch: Any, version: str = npu_contract.NEWEST) -> Any:
    """Make ``import torch_npu`` return this test double and ``torch.histc`` count integers as the
    NPU's does (both undone by ``monkeypatch``), enforcing the contract of torch_npu ``version``."""
    from verl_npu_autopatch.patches.transformers_npu import kernels as npu_kernels

    calls.clear()
    trace.clear()
    monkeypatch.setattr(sys.modules[__name__], "release", release)  # put back after the test
    use_release(version)
    monkeypatch.setitem(sys.modules, "torch_npu", sys.modules[__name__])
    monkeypatch.setattr(npu_kernels, "_torch_npu", None)
    integer_histc(monkeypatch)  # the expert counts (ours and verl's) are an integer histc, as on the device
    return sys.modules[__name__]


def allow_float64(monkeypatch: Any) -> None:
    """Also take float64 (no device does): for ``gradcheck`` of a kernel's math, which needs double
    precision. Every other rule still holds."""
    monkeypatch.setattr(sys.modules[__name__], "floats", (*floats, torch.float64))


def integer_histc(monkeypatch: Any = None) -> None:
    """TEST DOUBLE for the NPU's ``torch.histc``, which counts integer tensors in their own dtype
    (verl's MoE forwards pass the int64 expert indices and hand the int64 counts to
    ``npu_grouped_matmul``); CPU torch takes floating tensors only, so integers are counted as
    floats and the counts returned in the input's dtype (exact for expert indices)."""
    histc = torch.histc

    def npu_histc(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input.is_floating_point():
            return histc(input, *args, **kwargs)
        return histc(input.float(), *args, **kwargs).to(input.dtype)

    if monkeypatch is None:  # a child process standing in for the device: for its whole life
        torch.histc = npu_histc
    else:
        monkeypatch.setattr(torch, "histc", npu_histc)
