"""Test doubles for the Ascend pieces that cannot run on a CPU host (torch_npu, torch.npu, acl.rt,
vllm-ascend's ``maybe_chunk_residual`` op and a few vllm-ascend helpers).

Every function here is a TEST DOUBLE written from the documented definition of the op it stands
for, computed with plain CPU torch, and records its calls in :data:`EVENTS` so tests can check
what the code under test called and in which order. The torch_npu ops are bound to their schemas
in a real torch_npu release (``tests/hf/npu_contract.py``, the transformers double's contract:
``TypeError`` on an unknown keyword, a wrong arity or a wrong type, as torch_npu raises; the
result checked against the declared return type); :data:`CONTRACT` names the release. None of
it is used outside tests.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tests.hf import npu_contract
from tests.support import upstream

#: ``(name, details)`` of every double called, in call order. Cleared by :func:`installed`.
EVENTS: list[tuple[str, Any]] = []

#: Tensor-parallel layout the ``maybe_chunk_residual`` double uses (size, rank, pad rows).
TP = {"size": 1, "rank": 0, "pad": 0}


def names() -> list[str]:
    """The names of the recorded events, in order."""
    return [name for name, _ in EVENTS]


# ----------------------------------------------------------------------------- torch_npu
#: The torch_npu ops doubled here (their schemas are read from the release :data:`CONTRACT` names).
OPS = (
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_format_cast",
    "npu_lightning_indexer",
    "npu_rotary_mul",
    "npu_transpose_batchmatmul",
)

#: ``release``: the torch_npu release whose schemas the calls are bound to (the newest by default).
CONTRACT = {"release": npu_contract.NEWEST}


def bound(double: Callable[..., Any]) -> Callable[..., Any]:
    """``double`` behind the schema of its op: every call is bound (defaults filled in, passed by
    name) and the result checked against the declared return type."""

    @functools.wraps(double)
    def op(*args: Any, **kwargs: Any) -> Any:
        schema = npu_contract.schemas(CONTRACT["release"], OPS)[double.__name__]
        return schema.check_result(double(**schema.bind(args, kwargs)))

    return op


@bound
def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TEST DOUBLE of ``torch_npu.npu_rms_norm``: ``(x * rsqrt(mean(x², -1) + eps) * gamma, rstd)``,
    computed in float32 and returned in ``x``'s dtype (rstd stays float32)."""
    x = self
    EVENTS.append(("torch_npu.npu_rms_norm", x))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


@bound
def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TEST DOUBLE of ``torch_npu.npu_add_rms_norm``: the fused kernel adds ``x1 + x2`` in float32,
    normalizes that float32 sum, and returns ``(y, rstd, x1 + x2)`` in the input dtype."""
    EVENTS.append(("torch_npu.npu_add_rms_norm", (x1, x2)))
    total = x1.float() + x2.float()
    rstd = torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + epsilon)
    return (total * rstd * gamma.float()).to(x1.dtype), rstd, total.to(x1.dtype)


@bound
def npu_format_cast(self: torch.Tensor, acl_format: int, **options: Any) -> torch.Tensor:
    """TEST DOUBLE of ``torch_npu.npu_format_cast``: on CPU every format is ND, so the tensor itself
    (``options``: the release's optional dtype arguments, unused)."""
    EVENTS.append(("torch_npu.npu_format_cast", acl_format))
    return self


@bound
def npu_lightning_indexer(
    query: torch.Tensor, key: torch.Tensor, weights: torch.Tensor, **options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """TEST DOUBLE of ``torch_npu.npu_lightning_indexer``: records the ``weights`` it was given
    (what the scale patch changes) and returns a placeholder top-k tensor and no values (empty)."""
    EVENTS.append(("torch_npu.npu_lightning_indexer", {"query": query, "weights": weights, **options}))
    return torch.zeros(query.shape[0], 1, dtype=torch.int32), torch.empty(0, dtype=query.dtype)


@bound
def npu_rotary_mul(
    self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str, **options: Any
) -> torch.Tensor:
    """TEST DOUBLE of ``torch_npu.npu_rotary_mul`` (half-rotation RoPE, the only ``rotary_mode``
    doubled): ``x * r1 + cat(-x[..., d/2:], x[..., :d/2]) * r2``."""
    if rotary_mode != "half":
        raise NotImplementedError(f"the double computes rotary_mode='half' only, not {rotary_mode!r}")
    EVENTS.append(("torch_npu.npu_rotary_mul", self.shape))
    first, second = self.chunk(2, dim=-1)
    return self * r1 + torch.cat([-second, first], dim=-1) * r2


@bound
def npu_transpose_batchmatmul(input: torch.Tensor, weight: torch.Tensor, **options: Any) -> torch.Tensor:
    """TEST DOUBLE of ``torch_npu.npu_transpose_batchmatmul``: both operands batched 3-D tensors,
    permuted by ``perm_x1`` / ``perm_x2``, multiplied batch by batch, the result permuted by
    ``perm_y``. Operands of another rank or of mismatched batch / inner sizes raise
    ``RuntimeError``, as the kernel's shape check does on the device."""
    EVENTS.append(("torch_npu.npu_transpose_batchmatmul", (tuple(input.shape), tuple(weight.shape))))
    if input.dim() != 3 or weight.dim() != 3:
        raise RuntimeError(
            f"npu_transpose_batchmatmul: x1 and x2 must be 3-D, got {input.dim()}-D and {weight.dim()}-D"
        )
    x1 = input.permute(*(options.get("perm_x1") or (0, 1, 2)))
    x2 = weight.permute(*(options.get("perm_x2") or (0, 1, 2)))
    if x1.shape[0] != x2.shape[0] or x1.shape[2] != x2.shape[1]:
        raise RuntimeError(f"npu_transpose_batchmatmul: shapes {tuple(x1.shape)} and {tuple(x2.shape)} do not match")
    return torch.bmm(x1, x2).permute(*(options.get("perm_y") or (0, 1, 2)))


def _torch_npu_module() -> types.ModuleType:
    module = types.ModuleType("torch_npu")
    module.__doc__ = "TEST DOUBLE of torch_npu (see tests/ascend/doubles.py)."
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)  # for find_spec callers
    for function in (
        npu_rms_norm,
        npu_add_rms_norm,
        npu_format_cast,
        npu_lightning_indexer,
        npu_rotary_mul,
        npu_transpose_batchmatmul,
    ):
        setattr(module, function.__name__, function)
    return module


# ----------------------------------------------------------------------------- torch.npu / acl
def _torch_npu_namespace() -> types.ModuleType:
    """TEST DOUBLE of the ``torch.npu`` namespace: ``synchronize`` and ``empty_cache`` record an
    event (the real ones wait for / free device work); ``memory.NPUPluggableAllocator`` exists
    because camem.py uses it in an annotation evaluated at import."""
    npu = types.ModuleType("torch.npu")
    npu.synchronize = lambda device=None: EVENTS.append(("torch.npu.synchronize", device))
    npu.empty_cache = lambda: EVENTS.append(("torch.npu.empty_cache", None))
    npu.is_available = lambda: False  # no device: libraries probing for one must not use it
    npu.memory = types.SimpleNamespace(NPUPluggableAllocator=type("NPUPluggableAllocator", (), {}))
    return npu


def _acl_modules() -> dict[str, types.ModuleType]:
    """TEST DOUBLE of pyACL's ``acl.rt``: ``memcpy(dst, dst_max, src, count, kind)`` records the copy."""
    acl, rt = types.ModuleType("acl"), types.ModuleType("acl.rt")
    rt.memcpy = lambda *args: EVENTS.append(("acl.rt.memcpy", args)) or 0
    acl.rt = rt
    return {"acl": acl, "acl.rt": rt}


# ----------------------------------------------------------------------------- device memory under CaMem
#: Device address ranges (start -> size) CaMem's ``unmap_and_release`` released and its
#: ``create_and_map`` has not mapped again. Cleared by :func:`installed`.
UNMAPPED: dict[int, int] = {}


def unmap_and_release(device: int, size: int, ptr: int, handle: int) -> None:
    """TEST DOUBLE of the compiled ``python_unmap_and_release``: the range is no longer mapped."""
    EVENTS.append(("unmap_and_release", ptr))
    UNMAPPED[ptr] = size


def create_and_map(device: int, size: int, ptr: int, handle: int) -> None:
    """TEST DOUBLE of the compiled ``python_create_and_map``: new physical memory at the same
    address, whose contents are undefined (zeroed here)."""
    EVENTS.append(("create_and_map", ptr))
    UNMAPPED.pop(ptr, None)
    ctypes.memset(ptr, 0, size)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


#: Tensor methods that read a tensor's metadata only (properties: ``__get__``), never its memory.
METADATA = frozenset(
    ("__get__", "data_ptr", "untyped_storage", "storage_offset", "size", "dim", "stride", "numel", "element_size")
)


class DeviceTensor(torch.Tensor):
    """TEST DOUBLE of a tensor in NPU memory CaMem manages: an op that reads or writes it while its
    address lies in an :data:`UNMAPPED` range raises ``RuntimeError`` with ACL error 507899, as the
    device's memcpy / kernel launch fails on an unmapped virtual address (reading its metadata,
    :data:`METADATA`, does not). Views of it (``.data`` too) are device tensors as well; a copy to
    the host (``.cpu()``) is a plain tensor."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        devices = [t for t in _tensors((args, kwargs)) if isinstance(t, DeviceTensor)]
        with torch._C.DisableTorchFunctionSubclass():  # the checks below run as plain tensors
            for tensor in devices if getattr(func, "__name__", None) not in METADATA else ():
                address = tensor.data_ptr()
                if any(start <= address < start + size for start, size in UNMAPPED.items()):
                    name = getattr(func, "__name__", func)
                    raise RuntimeError(f"ACL error 507899: {name} on unmapped memory {address:#x}")
            result = func(*args, **kwargs)
            storages = {t.untyped_storage().data_ptr() for t in devices}
            aliases = isinstance(result, torch.Tensor) and result.untyped_storage().data_ptr() in storages
        return result.as_subclass(cls) if aliases else result


# ----------------------------------------------------------------------------- vllm-ascend op
def maybe_chunk_residual(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """TEST DOUBLE of vllm-ascend's ``torch.ops.vllm.maybe_chunk_residual``: when ``x`` holds only
    this TP rank's token shard, pad the residual by ``pad`` rows, split it into ``size`` chunks
    along dim 0 and return chunk ``rank``; otherwise return the residual unchanged."""
    EVENTS.append(("torch.ops.vllm.maybe_chunk_residual", residual.shape))
    if x.shape[0] == residual.shape[0]:
        return residual
    padded = torch.nn.functional.pad(residual, (0, 0, 0, TP["pad"]))
    return torch.chunk(padded, TP["size"], dim=0)[TP["rank"]].clone()


_LIBRARY: Any = None


def register_maybe_chunk_residual() -> None:
    """Register the double as ``torch.ops.vllm.maybe_chunk_residual`` (once per process)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("vllm", "FRAGMENT")
    library.define("maybe_chunk_residual(Tensor x, Tensor residual) -> Tensor")
    library.impl("maybe_chunk_residual", maybe_chunk_residual, "CPU")
    _LIBRARY = library


# ----------------------------------------------------------------------------- layernorm.py's imports
def _no_weight_prefetch() -> Any:
    """TEST DOUBLE of vllm-ascend's ``get_weight_prefetch_method()``: a method that prefetches nothing."""
    return types.SimpleNamespace(maybe_prefetch_mlp_weight_postprocess=lambda x: None)


#: What the release's ``vllm_ascend/ops/layernorm.py`` imports from vllm-ascend: module -> TEST
#: DOUBLES of the names. ``enable_custom_op`` is False: no compiled vllm_ascend_C here, so the
#: release takes its torch_npu path.
LAYERNORM_IMPORTS: dict[str, dict[str, Any]] = {
    "vllm_ascend.device.device_op": {"DeviceOperator": object},
    "vllm_ascend.ops.triton.layernorm_gated": {"layer_norm_fwd_npu": None},
    "vllm_ascend.utils": {"enable_custom_op": lambda: False, "get_weight_prefetch_method": _no_weight_prefetch},
}


# ----------------------------------------------------------------------------- installation
def stub_module(name: str, doc: str = "TEST DOUBLE", **attributes: Any) -> types.ModuleType:
    """A module named ``name`` holding ``attributes`` (a stand-in for a vllm-ascend module)."""
    module = types.ModuleType(name)
    module.__doc__ = doc
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


@contextmanager
def alone_in_package(module: types.ModuleType) -> Iterator[types.ModuleType]:
    """``module`` in ``sys.modules`` under a stand-in parent package holding it only; yields it."""
    parent = module.__name__.rpartition(".")[0]
    package = stub_module(parent, f"TEST DOUBLE: holds {module.__name__} only")
    package.__path__ = []
    with modules({parent: package, module.__name__: module}):
        yield module


@contextmanager
def modules(mapping: dict[str, types.ModuleType]) -> Iterator[None]:
    """Put ``mapping`` into ``sys.modules`` and restore what was there afterwards."""
    saved = {name: sys.modules.get(name) for name in mapping}
    sys.modules.update(mapping)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@contextmanager
def installed() -> Iterator[None]:
    """Install the torch_npu, torch.npu and acl.rt doubles and a ``vllm_ascend`` package stand-in
    (the engine gates patches whose top-level package is not importable) for one test."""
    EVENTS.clear()
    UNMAPPED.clear()
    TP.update(size=1, rank=0, pad=0)
    had_npu = hasattr(torch, "npu")
    previous = getattr(torch, "npu", None)
    torch.npu = _torch_npu_namespace()
    try:
        package = stub_module("vllm_ascend", "TEST DOUBLE: the vllm-ascend package is importable")
        package.__path__ = []  # a package (its submodules are put into sys.modules by the tests)
        attention = stub_module("vllm_ascend.attention", "TEST DOUBLE: holds only the submodules a test puts in")
        attention.__path__ = []  # so a submodule no test installed is known absent (find_spec: None)
        stand_ins = {"vllm_ascend": package, "vllm_ascend.attention": attention}
        with modules({"torch_npu": _torch_npu_module(), **stand_ins, **_acl_modules()}):
            yield
    finally:
        if had_npu:
            torch.npu = previous
        else:
            del torch.npu


def load_layernorm(root: Path) -> Iterator[types.ModuleType]:
    """The release's ``vllm_ascend/ops/layernorm.py`` run unchanged as ``vllm_ascend.ops.layernorm``
    (in ``sys.modules`` while the generator is suspended), its vllm-ascend imports stubbed with the
    doubles of :data:`LAYERNORM_IMPORTS`."""
    name = "vllm_ascend.ops.layernorm"
    stubs = {module: stub_module(module, **names) for module, names in LAYERNORM_IMPORTS.items()}
    with modules(stubs):
        module = upstream.load_file(root / "vllm_ascend/ops/layernorm.py", name)
        with modules({name: module}):
            yield module
