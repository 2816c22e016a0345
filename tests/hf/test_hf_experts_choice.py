"""The experts kernel among transformers' own experts implementations (5.x), the fused-block
variant (4.57 Qwen3-VL-MoE), and fixed-length group counts."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from tests.hf.conftest import PRESENT, builders, randomize
from verl_npu_autopatch.patches import _npu_kernels, transformers_npu
from verl_npu_autopatch.patching import parameter_names

MOE = [f for f in ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_vl_moe") if f in PRESENT]


def _experts_forward(family: str) -> Any:
    """The live experts target of ``family`` (variant 1 of its ``experts`` patch)."""
    module = importlib.import_module(transformers_npu.module_name(family))
    variants = dict(transformers_npu.MODELS[family])["experts"]
    return getattr(getattr(module, variants[0].split(".")[0], None), "forward", None)


def _ids() -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))


def _out(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=_ids())
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.mark.parametrize("family", MOE)
def test_an_explicit_experts_choice_runs_upstream_and_no_choice_runs_ours(
    family: str, npu: Any, make_engine: Any
) -> None:
    if transformers_npu.dispatcher_interface(_experts_forward(family)) is None:
        # transformers 4.x: no experts dispatcher, so no user choice to respect.
        from transformers.modeling_utils import PreTrainedModel

        assert not hasattr(PreTrainedModel, "set_experts_implementation")
        return
    reference = _out(randomize(builders()[family]()))
    engine = make_engine()
    assert engine.records[f"transformers.{family}.experts"].state == "applied"

    model = randomize(builders()[family]())
    assert model.config._experts_implementation == "npu_grouped_mm"  # no choice made: ours
    torch.testing.assert_close(_out(model), reference, rtol=1e-3, atol=1e-4)
    assert npu.calls["npu_moe_token_permute"] > 0
    for choice in ("eager", "batched_mm", "grouped_mm"):
        npu.calls.clear()
        model.set_experts_implementation(choice)
        torch.testing.assert_close(_out(model), reference, rtol=1e-3, atol=1e-4)
        assert npu.calls["npu_moe_token_permute"] == 0, choice  # upstream's code ran

    engine.revert()
    npu.calls.clear()
    model.set_experts_implementation("npu_grouped_mm")  # still a valid name after revert: runs upstream eager
    torch.testing.assert_close(_out(model), reference, rtol=1e-3, atol=1e-4)
    assert not npu.calls
    assert randomize(builders()[family]()).config._experts_implementation != "npu_grouped_mm"


def test_qwen3_vl_moe_fused_block_variant_where_the_experts_take_dense_weights(npu: Any, make_engine: Any) -> None:
    """transformers 4.57: ``Qwen3VLMoeTextExperts.forward(hidden, routing_weights, router_indices)``
    fails the probe and the engine applies the block variant; on 5.x the experts variant applies."""
    if "qwen3_vl_moe" not in PRESENT:
        pytest.fail("transformers without qwen3_vl_moe: update the family table")
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as mod

    legacy = parameter_names(mod.Qwen3VLMoeTextExperts.forward)[2:] == (
        "routing_weights",
        "router_indices",
    )
    model = randomize(builders()["qwen3_vl_moe"]())
    block = next(m for m in model.modules() if type(m).__name__ == "Qwen3VLMoeTextSparseMoeBlock")
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5))
    references = {}
    for training in (True, False):  # upstream's two experts paths: a loop (training) and dense bmm (eval)
        block.train(training)
        references[training] = block(x)

    engine = make_engine()
    record = engine.records["transformers.qwen3_vl_moe.experts"]
    assert record.state == "applied", record.reason
    if not legacy:
        assert record.target.endswith(":Qwen3VLMoeTextExperts.forward")
        return
    assert record.target.endswith(":Qwen3VLMoeTextSparseMoeBlock.forward")
    assert record.reason.startswith("fix installed on variant 2 of 2 (")
    assert "passed over: expected transformers.models.qwen3_vl_moe" in record.reason
    for training in (True, False):
        block.train(training)
        npu.calls.clear()
        out, logits = block(x)
        torch.testing.assert_close(out, references[training][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(logits, references[training][1])
        assert npu.calls["npu_moe_token_permute"] == 1 and npu.calls["npu_grouped_matmul[group_type=0]"] == 2


def test_group_counts_have_a_fixed_length_under_torch_export(npu: Any) -> None:
    """One ``histc`` of the integer indices (the double counts integers as the NPU's does)."""

    class Counts(torch.nn.Module):
        def forward(self, index: torch.Tensor) -> torch.Tensor:
            return _npu_kernels.group_counts(index, 6)

    index = torch.tensor([[0, 2], [2, 5], [5, 5]])
    program = torch.export.export(Counts(), (index,))
    (node,) = [n for n in program.graph.nodes if n.op == "output"]
    assert tuple(node.args[0][0].meta["val"].shape) == (6,)  # static, not data-dependent
    torch.testing.assert_close(program.module()(index), torch.tensor([1, 0, 2, 0, 0, 3]))
    torch.testing.assert_close(_npu_kernels.group_counts(index, 6), torch.bincount(index.reshape(-1), minlength=6))
