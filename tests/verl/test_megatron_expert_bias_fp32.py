"""``megatron.expert_bias_fp32`` on the real megatron-core: the release's wheel is put on
``sys.path`` and imported as is (``Float16Module``, ``TopKRouter``, ``TransformerConfig``), on CPU.
The only stand-in: ``torch.cuda.current_device`` answers ``"cpu"`` while the router registers its
buffers (the CPU torch has no CUDA device)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.support import release_loaders
from tests.verl.helpers import forget_megatron, import_megatron, record, start
from verl_npu_autopatch.patches import megatron_expert_bias_fp32

NAME = "megatron.expert_bias_fp32"
#: A bias whose bf16 rounding shows: every entry changes when cast.
BIAS = torch.tensor([1e-3 + 1e-7, 0.3, -0.2, 1.0001], dtype=torch.float32)


@release_loaders.loads(
    megatron_expert_bias_fp32,
    "megatron-core",
    ("0.12.1", "0.16.1", "0.17.0"),
    sites={"0.16.1": {f"{megatron_expert_bias_fp32.MODULE}:Float16Module.__init__"}},
)
@pytest.fixture
def megatron_release(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Import a megatron-core release from its wheel's files; forgets it after the test."""

    yield lambda version: import_megatron(monkeypatch, version, "megatron.core.transformer.module")[0]
    forget_megatron()


def _router_model(monkeypatch: pytest.MonkeyPatch, bf16: bool = True) -> tuple[Any, Any]:
    """``(config, model)``: a real ``MegatronModule`` holding a real ``TopKRouter`` with expert bias."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        add_bias_linear=False,
        bf16=bf16,
        fp16=not bf16,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    kwargs = {}
    if "pg_collection" in inspect.signature(TopKRouter.__init__).parameters:
        from megatron.core.process_groups_config import ProcessGroupCollection

        groups = ProcessGroupCollection()
        for name in ("tp", "cp", "tp_cp", "tp_dp_cp"):
            setattr(groups, name, None)
        kwargs["pg_collection"] = groups
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")

    class Model(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config)
            self.router = TopKRouter(config, **kwargs)

    model = Model()
    with torch.no_grad():
        model.router.expert_bias.copy_(BIAS)
    return config, model


@pytest.mark.parametrize("version", ["0.12.1", "0.16.1", "0.17.0"])
def test_the_real_float16_module_rounds_the_bias_without_the_patch(
    megatron_release: Any, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    module = megatron_release(version)
    config, model = _router_model(monkeypatch)
    wrapped = module.Float16Module(config, model)
    bias = wrapped.module.router.expert_bias
    assert bias.dtype == torch.bfloat16
    assert not torch.equal(bias.float(), BIAS), "the cast lost the mantissa"


@pytest.mark.parametrize("version", ["0.12.1", "0.16.1", "0.17.0"])
def test_with_the_patch_the_bias_stays_the_same_fp32_tensor(
    megatron_release: Any, monkeypatch: pytest.MonkeyPatch, engines: list, version: str
) -> None:
    module = megatron_release(version)
    engine = start(engines, megatron_expert_bias_fp32.PATCHES)
    assert record(engine, NAME) == ("applied", "fix installed")

    config, model = _router_model(monkeypatch)
    router = model.router
    before = router.expert_bias
    wrapped = module.Float16Module(config, model)
    assert router.expert_bias is before, "the very tensor the router held: no copy"
    assert router.expert_bias.dtype == torch.float32 and torch.equal(router.expert_bias, BIAS)
    assert router.weight.dtype == torch.bfloat16, "the rest of the model is still cast"
    assert router.local_tokens_per_expert.dtype == torch.bfloat16, "only expert_bias is kept"
    state = wrapped.state_dict()
    (key,) = [k for k in state if k.endswith("router.expert_bias")]
    assert state[key].dtype == torch.float32, "still a persistent buffer, saved in fp32"
    assert "local_tokens_per_expert" not in "".join(state), "the non-persistent buffers stay so"

    engine.revert()
    config, model = _router_model(monkeypatch)
    assert module.Float16Module(config, model).module.router.expert_bias.dtype == torch.bfloat16


def test_the_fp16_branch_is_kept_too(megatron_release: Any, monkeypatch: pytest.MonkeyPatch, engines: list) -> None:
    module = megatron_release("0.16.1")
    start(engines, megatron_expert_bias_fp32.PATCHES)
    config, model = _router_model(monkeypatch, bf16=False)
    wrapped = module.Float16Module(config, model)
    assert wrapped.module.router.weight.dtype == torch.float16
    assert wrapped.module.router.expert_bias.dtype == torch.float32
    assert torch.equal(wrapped.module.router.expert_bias, BIAS)
