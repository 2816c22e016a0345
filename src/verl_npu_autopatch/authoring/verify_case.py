"""What a ``doctor --verify`` case is, for the families that have one (``transformers_npu``,
``ascend_glm52``): tiny dimensions, a :class:`Case`, the live target and the upstream callable it
wraps, a module's parameters placed. Imported through those families by ``cli.verify`` only: torch."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from verl_npu_autopatch.authoring.patching import marked_by

#: Tiny dimensions: batch, sequence, hidden, intermediate (feed-forward), heads, kv heads, head dim, experts, top-k.
B, S, H, FF, HEADS, KV, D, E, K = 2, 8, 64, 32, 4, 2, 16, 4, 2


class Unverifiable(Exception):
    """The patch cannot be exercised here (the reason is the message)."""


@dataclass
class Call:
    """One call's arguments (an instance first for a method) and the leaves whose gradients are compared."""

    args: tuple[Any, ...]
    leaves: list[torch.Tensor]


@dataclass
class Case:
    """One applied kernel patch: ``patched`` and ``upstream`` take the arguments ``make`` builds;
    ``inputs`` describes them; ``trains``: backward compared too (else forward only, no autograd)."""

    name: str
    patched: Callable[..., Any]
    upstream: Callable[..., Any]
    make: Callable[[torch.dtype, torch.device], Call]
    inputs: str
    trains: bool = True


def resolve(target: str) -> tuple[Any, Any]:
    """``(owner, value)`` of a record target ``module:qualname`` in the live modules."""
    module, _, qualname = target.partition(":")
    owner: Any = None
    value: Any = sys.modules.get(module)
    if value is None:
        raise Unverifiable(f"{module} is not imported")
    for part in qualname.split("."):
        owner, value = value, getattr(value, part, None)
        if value is None:
            raise Unverifiable(f"{target} does not exist")
    return owner, value


def replaced(name: str, value: Any) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """``(patched, upstream)`` when the live ``value`` is patch ``name``'s replacement of ``__wrapped__``."""
    if marked_by(value) == name and callable(getattr(value, "__wrapped__", None)):
        return value, value.__wrapped__
    return None


def leaf(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A random input of ``shape`` in ``dtype`` on ``device`` whose gradient is compared."""
    return torch.randn(*shape, dtype=torch.float32).to(device=device, dtype=dtype).requires_grad_()


def placed(module: torch.nn.Module, dtype: torch.dtype, device: torch.device, norm: bool = False) -> Any:
    """``module`` with random parameters (norm scales around 1) in ``dtype`` on ``device``."""
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.rand(param.shape) + 0.5 if norm else torch.randn(param.shape) * 0.2)
    return module.to(device=device, dtype=dtype)
