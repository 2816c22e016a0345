"""The experts kernel among transformers' own experts implementations (5.x), the fused-block
variant (4.57 Qwen3-VL-MoE), and fixed-length group counts."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf.conftest import PRESENT, builders, randomize
from verl_npu_autopatch.authoring.patching import parameter_names
from verl_npu_autopatch.patches import transformers_npu
from verl_npu_autopatch.patches.transformers_npu import kernels as npu_kernels

ROOT = Path(__file__).resolve().parents[2]
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

    given = randomize(builders()[family]())  # built with ours by default: upstream's choice back at revert

    engine.revert()
    assert "npu_grouped_mm" not in transformers_npu.dispatcher_interface(_experts_forward(family))  # as before
    npu.calls.clear()
    model.set_experts_implementation("eager")
    torch.testing.assert_close(_out(model), reference, rtol=1e-3, atol=1e-4)
    upstream = randomize(builders()[family]()).config._experts_implementation
    assert upstream != "npu_grouped_mm" and given.config._experts_implementation == upstream
    torch.testing.assert_close(_out(given), _out(randomize(builders()[family]())), rtol=1e-3, atol=1e-4)
    assert not npu.calls


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
            return npu_kernels.group_counts(index, 6)

    index = torch.tensor([[0, 2], [2, 5], [5, 5]])
    program = torch.export.export(Counts(), (index,))
    (node,) = [n for n in program.graph.nodes if n.op == "output"]
    assert tuple(node.args[0][0].meta["val"].shape) == (6,)  # static, not data-dependent
    torch.testing.assert_close(program.module()(index), torch.tensor([1, 0, 2, 0, 0, 3]))
    torch.testing.assert_close(npu_kernels.group_counts(index, 6), torch.bincount(index.reshape(-1), minlength=6))


def _gelu_experts(model: Any) -> Any:
    """``model`` with every fused experts module's activation made GELU: a misfit for the kernel."""
    from transformers.activations import ACT2FN

    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "act_fn"):
            module.act_fn = ACT2FN["gelu"]
    return model


@pytest.mark.parametrize("family", MOE)
def test_experts_the_kernel_does_not_fit_run_what_transformers_would_have(
    family: str, npu: Any, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GELU expert under our default runs upstream's own default choice (``grouped_mm``), not
    the eager per-expert loop: the same output, no NPU call, and upstream's function ran."""
    interface = transformers_npu.dispatcher_interface(_experts_forward(family))
    if interface is None:  # transformers 4.x: no experts dispatcher, no upstream choice to fall back to
        return
    upstream = randomize(_gelu_experts(builders()[family]()))
    assert upstream.config._experts_implementation == "grouped_mm"  # transformers' own default here
    reference = _out(upstream)
    make_engine()
    model = randomize(_gelu_experts(builders()[family]()))
    assert model.config._experts_implementation == "npu_grouped_mm"
    ran: list[str] = []
    grouped_mm = interface["grouped_mm"]
    spy = lambda *args: ran.append("grouped_mm") or grouped_mm(*args)  # noqa: E731
    monkeypatch.setitem(type(interface)._global_mapping, "grouped_mm", spy)
    torch.testing.assert_close(_out(model), reference, rtol=1e-4, atol=1e-5)
    assert ran and not npu.calls["npu_moe_token_permute"]


COMPILE_CHILD = """
import sys

import torch

from tests.hf import npu_emulation
from tests.hf.conftest import builders, randomize
from tests.hf.test_hf_experts_choice import _gelu_experts, _ids
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.lifecycle import Engine
from verl_npu_autopatch.patches import transformers_npu

sys.modules["torch_npu"] = npu_emulation
Engine(transformers_npu.family_patches("qwen3_moe")[-1:], Config(device="npu")).activate("test")
model = randomize(_gelu_experts(builders()["qwen3_moe"]())).eval()
assert model.config._experts_implementation == "npu_grouped_mm"
compiled = torch.compile(model, fullgraph=True, backend="eager")
with torch.no_grad():
    torch.testing.assert_close(compiled(input_ids=_ids()).logits, model(input_ids=_ids()).logits)
assert not npu_emulation.calls
print("compiled fullgraph")
"""


def test_a_misfit_compiles_fullgraph_as_upstream_does() -> None:
    """transformers' own ``test_generate_compile_model_forward_fullgraph`` needs the experts to
    compile without a graph break; the eager per-expert loop (data-dependent) breaks it. Only the
    experts patch is on (the test double's ops read their contract from files, which no graph
    holds), in a child: a process whose dynamo first ran under the test double's ``torch.histc``
    cannot trace the real one."""
    if transformers_npu.dispatcher_interface(_experts_forward("qwen3_moe")) is None:
        return  # transformers 4.x: the block variant, no dispatcher
    assert transformers_npu.family_patches("qwen3_moe")[-1].name.endswith(".experts")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", COMPILE_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled fullgraph" in proc.stdout, proc.stderr[-4000:]
