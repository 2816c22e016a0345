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

from tests.support import tiers

tiers.require(__file__)  # before importing what this environment may lack

HERE = Path(__file__).resolve().parent

import transformers  # noqa: E402,F401  (the process-wide engine activates now, before the test double exists)

from tests.hf import npu_emulation  # noqa: E402
from tests.hf.tiny_configs import DIMS, LINEAR, MOE, MROPE, rope_arguments  # noqa: E402
from verl_npu_autopatch.engine.config import Config  # noqa: E402
from verl_npu_autopatch.engine.lifecycle import Engine  # noqa: E402
from verl_npu_autopatch.patches import liger_arbitration as liger  # noqa: E402
from verl_npu_autopatch.patches import transformers_npu  # noqa: E402

ALL_PATCHES = [*transformers_npu.PATCHES, *liger.PATCHES]

#: Families whose modeling module exists in the installed transformers.
MODELS_DIR = Path(importlib.util.find_spec("transformers.models").origin).parent
PRESENT = [f for f in transformers_npu.MODELS if (MODELS_DIR / f / f"modeling_{f}.py").exists()]


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
    mrope = MROPE
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
    """Private active engines; afterwards every record still pending is settled (its modules
    count as absent) and every applied patch is reverted, so their import hooks stay inactive in
    later tests (wrapt hooks cannot be unregistered; a hook finds nothing pending)."""
    engines: list[Engine] = []

    def make(patches: list | None = None, **config: Any) -> Engine:
        engine = Engine(list(ALL_PATCHES if patches is None else patches), Config(device="npu", **config))
        engine.activate("test")
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.settle(engine.pending_modules())
        engine.revert()


# --------------------------------------------------------------------------- verl's own npu_patch
ROOT = HERE.parents[1]
VERL_VERSION = "0.9.1"
VERL_NPU_PATCH = "verl/models/transformers/npu_patch.py"


def _verl_source() -> Path:
    """verl's released ``npu_patch.py``, downloaded (sha256-checked against the index, cached in
    .cache/upstream) by ``scripts/compat-matrix``'s own code."""
    from tests.support.matrix import matrix_script

    script = matrix_script()
    artifact = script.Artifact("verl", VERL_VERSION, f"verl-{VERL_VERSION}-py3-none-any.whl")
    return script.extract(artifact, (VERL_NPU_PATCH,)) / "verl"


#: What verl 0.9.1's per-family functions assign, as (our kind -> verl's callable, and the
#: enclosing block forward when verl takes the block our experts are only reached through).
VERL_OWNS: dict[str, dict[str, tuple[str, str | None]]] = {
    "qwen2": {
        "rms_norm": ("rms_norm_forward_npu", None),
        "mlp": ("silu_forward_npu", None),
        "rotary": ("apply_rotary_pos_emb_npu", None),
    },
    "qwen2_5_vl": {"rms_norm": ("rms_norm_forward_npu", None), "vision_mlp": ("silu_forward_npu", None)},
    "qwen3": {
        "rms_norm": ("rms_norm_forward_npu", None),
        "mlp": ("silu_forward_npu", None),
        "rotary": ("apply_rotary_pos_emb_npu", None),
    },
    "qwen3_moe": {
        "rms_norm": ("rms_norm_forward_npu", None),
        "rotary": ("apply_rotary_pos_emb_npu", None),
        "experts": ("qwen3_moe_sparse_moe_block_forward_npu", "Qwen3MoeSparseMoeBlock.forward"),
    },
    "qwen3_vl": {"rms_norm": ("rms_norm_forward_npu", None), "mlp": ("silu_forward_npu", None)},
    "qwen3_vl_moe": {
        "rms_norm": ("rms_norm_forward_npu", None),
        "rotary": ("apply_rotary_pos_emb_npu", None),
        "experts": ("NPUQwen3VLMoeTextSparseMoeBlock.forward", "Qwen3VLMoeTextSparseMoeBlock.forward"),
    },
    "qwen3_next": {
        "rms_norm": ("qwen3_next_rms_norm_forward_npu", None),
        "rms_norm_gated": ("qwen3_next_rms_norm_forward_gated_npu", None),
        "rotary": ("qwen3_next_apply_rotary_pos_emb_npu", None),
        "experts": ("qwen3_next_sparse_moe_block_forward_npu", "Qwen3NextSparseMoeBlock.forward"),
    },
    "qwen3_5": {
        "rms_norm": ("qwen3_next_rms_norm_forward_npu", None),
        "rms_norm_gated": ("qwen3_next_rms_norm_forward_gated_npu", None),
        "rotary": ("qwen3_next_apply_rotary_pos_emb_npu", None),
    },
    "qwen3_5_moe": {
        "rms_norm": ("qwen3_next_rms_norm_forward_npu", None),
        "rms_norm_gated": ("qwen3_next_rms_norm_forward_gated_npu", None),
        "rotary": ("qwen3_next_apply_rotary_pos_emb_npu", None),
        "experts": ("qwen3_5_moe_experts_forward_npu", None),
    },
}


@pytest.fixture
def verl(npu: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """verl's real ``verl.models.transformers.npu_patch`` (release 0.9.1), imported for real under
    its own name; only verl's heavy package ``__init__`` chain (ray, tensordict, ...) is replaced by
    empty packages pointing at the release's directories. Every family module is restored after
    the test (verl assigns its kernels for good)."""
    import types

    try:
        root = _verl_source()
    except OSError as exc:  # only when PyPI truly cannot be reached
        pytest.skip(f"cannot download verl {VERL_VERSION} from PyPI: {exc}")
    for name, sub in (("verl", ""), ("verl.models", "models"), ("verl.models.transformers", "models/transformers")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root / sub)]
            sys.modules[name] = package
    modules = [importlib.import_module(transformers_npu.module_name(f)) for f in PRESENT]
    with restored(modules):
        yield importlib.import_module("verl.models.transformers.npu_patch")


class restored:
    """Context manager putting back every module attribute and class attribute of ``modules``
    (and of the classes defined there) as they were on entry."""

    def __init__(self, modules: list[Any]) -> None:
        self.saved = [
            (
                module,
                dict(vars(module)),
                {
                    c: dict(vars(c))
                    for c in vars(module).values()
                    if isinstance(c, type) and c.__module__ == module.__name__
                },
            )
            for module in modules
        ]

    def __enter__(self) -> restored:
        return self

    def __exit__(self, *exc: object) -> None:
        for module, names, classes in self.saved:
            for cls, attrs in classes.items():
                for key in [k for k in vars(cls) if k not in attrs and not k.startswith("__")]:
                    delattr(cls, key)
                for key, value in attrs.items():
                    if not key.startswith("__") and vars(cls).get(key) is not value:
                        setattr(cls, key, value)
            for key, value in names.items():
                if module.__dict__.get(key) is not value:
                    setattr(module, key, value)
