"""Our tester classes for transformers' own ``ModelTesterMixin`` (``test_modeling_common.py`` from
the installed release's sdist, copied beside this file at run time): one tiny random model per MoE
family, SiLU experts so our kernel fits. Run by ``tests/hf/test_hf_upstream_mixin.py`` in a child
pytest whose ``conftest.py`` activates our patches with the torch_npu test double."""

from __future__ import annotations

import importlib
import unittest
from typing import Any

import torch

from tests.hf import tiny_configs  # the repository root is on the child's PYTHONPATH

from .test_modeling_common import ModelTesterMixin

#: The shared tiny dimensions with MoE, SiLU experts (so our kernel fits) and a padding token.
DIMS = {**tiny_configs.DIMS, **tiny_configs.MOE, "hidden_act": "silu", "pad_token_id": 0}
LINEAR = {**tiny_configs.LINEAR, "shared_expert_intermediate_size": 24}
MROPE = {"rope_parameters": tiny_configs.MROPE}

#: family -> (config class, model class, extra config arguments)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", LINEAR),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", LINEAR),
    "qwen3_vl_moe": ("Qwen3VLMoeTextConfig", "Qwen3VLMoeTextModel", MROPE),
}


def _module(family: str, kind: str) -> Any | None:
    try:
        return importlib.import_module(f"transformers.models.{family}.{kind}_{family}")
    except ImportError:
        return None


class Tester:
    """What ``ModelTesterMixin`` asks of ``self.model_tester``."""

    batch_size = 2
    seq_length = 7
    is_training = True

    def __init__(self, parent: unittest.TestCase, family: str) -> None:
        self.parent = parent
        config_cls, _, extra = FAMILIES[family]
        self.config_cls = getattr(_module(family, "configuration"), config_cls)
        self.extra = extra
        for name, value in DIMS.items():
            setattr(self, name, value)

    def get_config(self) -> Any:
        return self.config_cls(**{**DIMS, **tiny_configs.rope_arguments(self.config_cls, self.extra)})

    def prepare_config_and_inputs_for_common(self) -> tuple[Any, dict[str, torch.Tensor]]:
        input_ids = torch.randint(1, self.vocab_size, (self.batch_size, self.seq_length))
        mask = torch.ones_like(input_ids)
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


def _test_case(family: str) -> type | None:
    modeling = _module(family, "modeling")
    if modeling is None:
        return None
    model_cls = getattr(modeling, FAMILIES[family][1])

    def setUp(self: Any) -> None:
        self.model_tester = Tester(self, family)

    return type(
        f"{model_cls.__name__}UpstreamMixinTest",
        (ModelTesterMixin, unittest.TestCase),
        {"all_model_classes": (model_cls,), "setUp": setUp, "__module__": __name__},
    )


for _family in FAMILIES:
    _case = _test_case(_family)
    if _case is not None:
        globals()[_case.__name__] = _case
del _case, _family
