"""The torch_npu op contract, read from real torch_npu releases: what the test double binds calls to.

Schemas are each op's ``func:`` line in ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``
of the released wheels users pin (the oldest, 2.6.0.post5, and the newest 2.x), downloaded once by
``scripts/compat-matrix``'s own code (sha256-checked against PyPI, cached under
``.cache/upstream/``), never installed. A call binds the way the real op's argument parser binds
it: unknown keywords, keyword-only arguments given by position, missing arguments and values of the
wrong type raise ``TypeError``, as ``torch_npu`` does.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.support.matrix import matrix_script

ROOT = Path(__file__).resolve().parents[2]
CODEGEN = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"

#: The wheels read (any platform's wheel carries the same schema file).
WHEELS = {
    "2.6.0.post5": "torch_npu-2.6.0.post5-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "2.14.0": "torch_npu-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl",
}
OLDEST, NEWEST = "2.6.0.post5", "2.14.0"

#: The ops our kernels and verl's ``npu_patch`` call.
OPS = (
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
    "npu_grouped_matmul",
)


@dataclass(frozen=True)
class Argument:
    """One schema argument: ``type`` as written (``Tensor[]?``), ``default`` (``None``: required)."""

    name: str
    type: str
    default: str | None
    keyword_only: bool


@dataclass(frozen=True)
class Schema:
    """One op's schema: its arguments and its return type as written (``(Tensor, Tensor)``)."""

    op: str
    arguments: tuple[Argument, ...]
    returns: str

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Every argument's value, defaults filled in; ``TypeError`` where torch_npu raises one."""
        positional = [a for a in self.arguments if not a.keyword_only]
        if len(args) > len(positional):
            raise TypeError(f"{self.op}() takes {len(positional)} positional arguments but {len(args)} were given")
        known = {a.name for a in self.arguments}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"{self.op}() got an unexpected keyword argument '{unknown[0]}'")
        bound: dict[str, Any] = {}
        for argument, value in zip(positional, args, strict=False):
            if argument.name in kwargs:
                raise TypeError(f"{self.op}() got multiple values for argument '{argument.name}'")
            bound[argument.name] = value
        for argument in self.arguments:
            if argument.name in kwargs:
                bound[argument.name] = kwargs[argument.name]
            elif argument.name not in bound:
                if argument.default is None:
                    raise TypeError(f"{self.op}() missing required argument '{argument.name}'")
                bound[argument.name] = default_value(argument.default)
            if not fits(argument.type, bound[argument.name]):
                value = bound[argument.name]
                raise TypeError(
                    f"{self.op}(): argument '{argument.name}' must be {argument.type}, not {type(value).__name__}"
                )
        return bound

    def check_result(self, result: Any) -> Any:
        """``result`` if it has the declared return type and arity (a double's own mistake otherwise)."""
        if not fits(self.returns, result):
            raise AssertionError(f"test double {self.op} returned {type(result).__name__}, schema says {self.returns}")
        return result


def default_value(text: str) -> Any:
    """A schema default as a Python value (``None``, ``-1``, ``1e-06``, ``'half'`` or ``"BSND"``, ``False``)."""
    constants = {"None": None, "True": True, "False": False}
    if text in constants:
        return constants[text]
    if text[:1] in ("'", '"'):
        return text[1:-1]
    return float(text) if any(c in text for c in ".e") else int(text)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # torch's parser refuses a bool


_SCALARS = {
    "Tensor": lambda v: isinstance(v, torch.Tensor),
    "int": _is_int,
    "float": lambda v: isinstance(v, float) or _is_int(v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "ScalarType": lambda v: isinstance(v, torch.dtype),
}


def fits(type_: str, value: Any) -> bool:
    """Whether ``value`` has schema type ``type_`` (``(A, B)``: a tuple of exactly those)."""
    if type_.startswith("("):
        parts = [p.strip() for p in type_.strip("()").split(",")]
        return isinstance(value, tuple) and len(value) == len(parts) and all(map(fits, parts, value))
    if type_.endswith("?"):
        return value is None or fits(type_[:-1], value)
    if type_.endswith("[]"):
        return isinstance(value, (list, tuple)) and all(fits(type_[:-2], v) for v in value)
    return _SCALARS[type_](value)


_FUNC = re.compile(r"^\s*-?\s*func:\s*(\w+)\((.*)\)\s*->\s*(.+?)\s*$")


def parse(line: str) -> Schema:
    """The :class:`Schema` of one ``func:`` line."""
    match = _FUNC.match(line)
    if match is None:
        raise ValueError(f"not a func line: {line!r}")
    op, text, returns = match.groups()
    arguments, keyword_only = [], False
    for item in (part.strip() for part in text.split(",")):
        if item == "*":
            keyword_only = True
            continue
        declaration, _, default = item.partition("=")
        type_, name = declaration.split()
        arguments.append(Argument(name, type_, default or None, keyword_only))
    return Schema(op, tuple(arguments), returns)


@functools.cache
def schemas(release: str, ops: tuple[str, ...] = OPS) -> dict[str, Schema]:
    """The schemas of ``ops`` (default :data:`OPS`) in torch_npu ``release`` (the plain overload of
    each op)."""
    script = matrix_script()
    root = script.extract(script.Artifact("torch-npu", release, WHEELS[release]), (CODEGEN,))
    found: dict[str, Schema] = {}
    for line in (root / CODEGEN).read_text().splitlines():
        match = _FUNC.match(line)  # overloads (``op.List``) do not match: the plain op is the one called
        if match and match.group(1) in ops:
            found[match.group(1)] = parse(line)
    missing = set(ops) - set(found)
    if missing:
        raise LookupError(f"torch_npu {release} has no schema for {sorted(missing)}")
    return found
