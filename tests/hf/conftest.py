"""Fixtures for the transformers/Liger tests: tiny random models, the torch_npu test double, and
private engines (``Engine(PATCHES, Config(device="npu"))``) closed after each test."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import npu_emulation  # noqa: E402
import transformers  # noqa: E402,F401  (the process-wide engine activates now, before the test double exists)
from tiny_configs import rope_arguments  # noqa: E402

from verl_npu_autopatch.config import Config  # noqa: E402
from verl_npu_autopatch.engine import Engine  # noqa: E402
from verl_npu_autopatch.patches import liger, transformers_npu  # noqa: E402

ALL_PATCHES = [*transformers_npu.PATCHES, *liger.PATCHES]

#: Families whose modeling module exists in the installed transformers.
MODELS_DIR = Path(importlib.util.find_spec("transformers.models").origin).parent
PRESENT = [f for f in transformers_npu.MODELS if (MODELS_DIR / f / f"modeling_{f}.py").exists()]

DIMS = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1)
LINEAR = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_conv_kernel_dim=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def _causal(config_cls: str, model_cls: str, module: str, **extra: Any) -> Callable[[], Any]:
    def build() -> Any:
        mod = importlib.import_module(module)
        cls = getattr(importlib.import_module(module.replace("modeling_", "configuration_")), config_cls)
        config = cls(**{**DIMS, **rope_arguments(cls, extra)})
        config._attn_implementation = "eager"
        return getattr(mod, model_cls)(config)

    return build


def builders() -> dict[str, Callable[[], Any]]:
    m = transformers_npu.module_name
    rope_partial = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    return {
        "qwen2": _causal("Qwen2Config", "Qwen2ForCausalLM", m("qwen2")),
        "qwen3": _causal("Qwen3Config", "Qwen3ForCausalLM", m("qwen3")),
        "qwen3_moe": _causal("Qwen3MoeConfig", "Qwen3MoeForCausalLM", m("qwen3_moe"), mlp_only_layers=[0], **MOE),
        "qwen2_5_vl": _causal(
            "Qwen2_5_VLTextConfig",
            "Qwen2_5_VLTextModel",
            m("qwen2_5_vl"),
            rope_parameters=mrope,
        ),
        "qwen3_vl": _causal("Qwen3VLTextConfig", "Qwen3VLTextModel", m("qwen3_vl"), rope_parameters=mrope),
        "qwen3_vl_moe": _causal(
            "Qwen3VLMoeTextConfig", "Qwen3VLMoeTextModel", m("qwen3_vl_moe"), rope_parameters=mrope, **MOE
        ),
        "qwen3_next": _causal(
            "Qwen3NextConfig",
            "Qwen3NextForCausalLM",
            m("qwen3_next"),
            shared_expert_intermediate_size=24,
            **MOE,
            **LINEAR,
            **rope_partial,
        ),
        "qwen3_5": _causal("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", m("qwen3_5"), **LINEAR, **rope_partial),
        "qwen3_5_moe": _causal(
            "Qwen3_5MoeTextConfig",
            "Qwen3_5MoeForCausalLM",
            m("qwen3_5_moe"),
            shared_expert_intermediate_size=24,
            **MOE,
            **LINEAR,
            **rope_partial,
        ),
    }


def randomize(model: Any, seed: int = 0) -> Any:
    """Every parameter random (norm weights too, so the kernels see non-trivial scales)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The torch_npu test double, installed as ``sys.modules["torch_npu"]`` for this test."""
    return npu_emulation.install(monkeypatch)


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Engine]]:
    """Private active engines; afterwards every applied patch is reverted and every record still
    pending is closed, so their import hooks stay inert in later tests."""
    engines: list[Engine] = []

    def make(patches: list | None = None, **config: Any) -> Engine:
        engine = Engine(list(ALL_PATCHES if patches is None else patches), Config(device="npu", **config))
        engine.activate("test")
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.revert()
        engine.close("test finished")
