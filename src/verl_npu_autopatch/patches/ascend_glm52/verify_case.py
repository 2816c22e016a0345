"""The tiny input of ``doctor --verify`` for ``ascend.rms_norm_residual``: vllm-ascend's
``AscendRMSNorm.forward_oot`` with a residual, the fix (explicit ``x + residual``, then a plain
RMSNorm) against the release's method it wraps (the fused add-RMSNorm).

The layer is built by its own constructor inside a vLLM config context (``AscendRMSNorm.__init__``
reads the current config, as vLLM's ``CustomOp`` does); both callables get the same layer, hidden
states and residual. Inference code: compared forward only (both outputs, the normed states and
the new residual), without autograd. Imported by :mod:`verl_npu_autopatch.cli.verify` only (what a
case is: ``authoring.verify_case``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from verl_npu_autopatch.authoring.verify_case import B, Call, Case, H, S, Unverifiable, placed, replaced, resolve

#: Tokens of the tiny batch (vLLM flattens batch and sequence).
TOKENS = B * S


def _rms_norm_residual(cls: type) -> Callable[[torch.dtype, torch.device], Call]:
    def make(dtype: torch.dtype, device: torch.device) -> Call:
        config = importlib.import_module("vllm.config")  # vLLM, like every upstream: never an import statement
        with config.set_current_vllm_config(config.VllmConfig()):
            layer = cls(H)
        layer = placed(layer, dtype, device, norm=True)
        x, residual = (torch.randn(TOKENS, H).to(device=device, dtype=dtype) for _ in range(2))
        return Call((layer, x, residual), [])

    return make


def case(name: str, target: str) -> Case:
    """The case of the applied patch ``name`` (``ascend.rms_norm_residual``) on ``target``."""
    owner, value = resolve(target)
    pair = replaced(name, value)
    if pair is None:
        raise Unverifiable("the live target is not this patch's replacement")
    inputs = f"x and residual [{TOKENS}, {H}], forward only (inference)"
    return Case(name, *pair, _rms_norm_residual(owner), inputs, trains=False)
