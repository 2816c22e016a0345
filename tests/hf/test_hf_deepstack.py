"""``transformers.<qwen3_vl|qwen3_vl_moe>.deepstack_clone`` on the installed transformers' own
``_deepstack_process``: the in-place write verl issue #5498 hit, and the fix.

The incoming hidden states are a view returned by a custom autograd ``Function``, the case autograd
refuses to modify in place. transformers 4.57.6 (the ``hf-4.57`` env) raises there; patched, it
returns upstream 5.x's result with upstream's gradients. transformers 5.x (the ``hf`` and ``hf-5.9``
envs) clones itself: the record says ``fixed-upstream`` and nothing is installed.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch

from verl_npu_autopatch.patches import transformers_deepstack

TOKENS, HIDDEN = 6, 4
FAMILIES = list(transformers_deepstack.MODELS)


class ViewOfInput(torch.autograd.Function):
    """Returns a view of its input, as a fused decoder kernel may."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _text_model(family: str) -> type:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(module, transformers_deepstack.MODELS[family])


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    leaf = torch.randn(1, TOKENS, HIDDEN, requires_grad=True)
    mask = torch.tensor([[False, True, True, False, True, False]])
    embeds = torch.randn(int(mask.sum()), HIDDEN, requires_grad=True)
    return leaf, ViewOfInput.apply(leaf), mask, embeds


def _expected(leaf: torch.Tensor, mask: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """DeepStack by definition: the visual features added at the masked positions."""
    return leaf + torch.zeros_like(leaf).masked_scatter(mask.unsqueeze(-1), embeds)


def _fixed_upstream(family: str) -> bool:
    source = inspect.getsource(_text_model(family)._deepstack_process)
    return transformers_deepstack.CLONED in "".join(source.split())


@pytest.mark.parametrize("family", FAMILIES)
def test_deepstack_on_a_custom_function_view(family: str, make_engine: Any) -> None:
    cls = _text_model(family)
    leaf, hidden, mask, embeds = _inputs()
    (patch,) = [p for p in transformers_deepstack.PATCHES if p.name == f"transformers.{family}.deepstack_clone"]
    if _fixed_upstream(family):
        record = make_engine([patch]).report()[patch.name]
        assert record.state == "fixed-upstream", record.reason
        assert "clones hidden_states" in record.reason
    else:
        with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
            cls._deepstack_process(None, hidden, mask, embeds)  # the release itself (verl #5498)
        original = cls.__dict__["_deepstack_process"]
        engine = make_engine([patch])
        assert engine.report()[patch.name].state == "applied"
        leaf, hidden, mask, embeds = _inputs()
        out = cls._deepstack_process(None, hidden, mask, embeds)
        torch.testing.assert_close(out, _expected(leaf.detach(), mask, embeds.detach()))
        out.square().sum().backward()
        grads = leaf.grad.clone(), embeds.grad.clone()
        leaf.grad = embeds.grad = None
        _expected(leaf, mask, embeds).square().sum().backward()
        torch.testing.assert_close(grads, (leaf.grad, embeds.grad))
        engine.revert()
        assert cls.__dict__["_deepstack_process"] is original
