"""``megatron.mtp_postprocess`` on the real megatron-core ``GPTModel._postprocess`` of 0.16.1 (has
the bug), 0.17.0rc0 (first release with the truthy test) and 0.19.2 (the newest), loaded from the
release files like the ascend suite does (megatron-core itself needs no install)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from tests.support import release_loaders, upstream
from tests.verl.helpers import record, release_root, start
from verl_npu_autopatch.patches import megatron_mtp_postprocess

NAME = "megatron.mtp_postprocess"
GPT = megatron_mtp_postprocess.GPT


def _gpt_module(version: str) -> types.ModuleType:
    """The release's ``gpt_model.py`` with only ``GPTModel._postprocess``, run as its real module."""
    root = release_root("megatron-core", version)
    namespace = {"torch": torch, "has_config_logger_enabled": lambda config: False}
    return upstream.load_subset(
        root / "megatron" / "core" / "models" / "gpt" / "gpt_model.py",
        GPT,
        {"GPTModel": ("_postprocess",)},
        namespace=namespace,
    )


@release_loaders.loads(
    megatron_mtp_postprocess,
    "megatron-core",
    ("0.16.1", "0.17.0rc0", "0.19.2"),
    sites={"0.16.1": {f"{GPT}:GPTModel._postprocess"}},
)
@pytest.fixture
def megatron(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install a release's ``gpt_model`` under its real name (and a bare ``megatron`` package so
    the engine's "is megatron installed" gate holds); returns a loader ``version -> module``."""

    def install(version: str) -> types.ModuleType:
        module = _gpt_module(version)
        monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
        monkeypatch.setitem(sys.modules, GPT, module)
        return module

    return install


class Config:
    def __init__(self, mtp_num_layers: Any) -> None:
        self.mtp_num_layers = mtp_num_layers


class OutputLayer:
    """Records what ``mtp_num_layers`` the original ``_postprocess`` saw when it reached the
    output layer; returns logits ``[s, b, v]`` (or raises, to test the restore on errors)."""

    def __init__(self, model: Any, fail: bool = False) -> None:
        self.model, self.fail, self.seen = model, fail, []

    def __call__(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> Any:
        self.seen.append(self.model.config.mtp_num_layers)
        if self.fail:
            raise RuntimeError("output layer failed")
        return hidden_states * 2, None


def _model(module: types.ModuleType, mtp_num_layers: Any, fail: bool = False) -> Any:
    model = module.GPTModel()
    model.config = Config(mtp_num_layers)
    model.training, model.post_process, model.share_embeddings_and_output_weights = False, True, False
    model.output_layer = OutputLayer(model, fail)
    return model


def _log_probs_call(model: Any) -> torch.Tensor:
    hidden = torch.ones(3, 2, 4)  # [s, b, h]
    return model._postprocess(hidden, None, None, None, None, None, None)  # labels=None: log-prob path


def test_real_0_16_1_crashes_without_the_patch(megatron: Any) -> None:
    model = _model(megatron("0.16.1"), 0)
    with pytest.raises(AttributeError, match="clone"):
        _log_probs_call(model)


def test_check_applies_on_0_16_1_and_the_wrapper_hands_none_then_restores_zero(megatron: Any, engines: list) -> None:
    module = megatron("0.16.1")
    engine = start(engines, megatron_mtp_postprocess.PATCHES)
    assert record(engine, NAME) == ("applied", "fix installed")

    model = _model(module, 0)
    logits = _log_probs_call(model)
    assert model.output_layer.seen == [None], "the original ran with mtp_num_layers=None"
    assert model.config.mtp_num_layers == 0, "restored afterwards"
    assert logits.shape == (2, 3, 4)  # [b, s, h]: the labels=None return of the real code

    failing = _model(module, 0, fail=True)
    with pytest.raises(RuntimeError, match="output layer failed"):
        _log_probs_call(failing)
    assert failing.output_layer.seen == [None]
    assert failing.config.mtp_num_layers == 0, "restored also when the original raises"

    unset = _model(module, None)
    _log_probs_call(unset)
    assert unset.output_layer.seen == [None] and unset.config.mtp_num_layers is None

    engine.revert()
    with pytest.raises(AttributeError, match="clone"):
        _log_probs_call(_model(module, 0))


@pytest.mark.parametrize("version", ["0.17.0rc0", "0.19.2"])
def test_check_says_fixed_upstream_on_the_truthy_releases(megatron: Any, engines: list, version: str) -> None:
    module = megatron(version)
    engine = start(engines, megatron_mtp_postprocess.PATCHES)
    state, reason = record(engine, NAME)
    assert state == "fixed-upstream", reason
    assert "truth" in reason
    original = module.GPTModel._postprocess
    assert not hasattr(original, "__verl_npu_autopatch__")


def test_check_says_unsupported_on_0_15_3(megatron: Any, engines: list) -> None:
    megatron("0.15.3")
    engine = start(engines, megatron_mtp_postprocess.PATCHES)
    state, reason = record(engine, NAME)
    assert state == "unsupported"
    assert "self.mtp_process" in reason
