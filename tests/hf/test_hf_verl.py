"""Next to verl's own transformers NPU patches (the real ``verl/models/transformers/npu_patch.py``
of verl 0.9.1, run against the real transformers Qwen modules), in both orders: ours first (our
hooks fired at import, then verl's FSDP start-up assigns its kernels) and verl first (our engine
activates late). Each target has exactly one owner, records name it, ``revert()`` is honest, and
a tiny Qwen3-MoE computes the same logits and gradients whoever owns what."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch

from tests.hf.conftest import PRESENT, VERL_OWNS, builders, randomize, restored
from tests.support.children import ROOT
from verl_npu_autopatch.authoring.patching import describe, marked_by
from verl_npu_autopatch.patches import transformers_npu

VERL = "verl.models.transformers.npu_patch"


def _live(target: str) -> Any:
    module, _, qualname = target.partition(":")
    holder: Any = importlib.import_module(module)
    parts = qualname.split(".")
    for part in parts[:-1]:
        holder = getattr(holder, part)
    return inspect.getattr_static(holder, parts[-1])


def _ours(engine: Any) -> dict[str, Any]:
    """Our transformers records (re-checked: ``report()``) for the families present here."""
    records = engine.report().records
    return {r.name: r for r in records if r.name.startswith("transformers.") and r.name.split(".")[1] in PRESENT}


def _expected_reason(family: str, kind: str, target: str) -> str:
    """verl's function by name; "only reached through" its block unless our record's live target
    is that block itself (transformers 4.x: the sparse-MoE block variant)."""
    function, block = VERL_OWNS[family][kind]
    reason = f"target owned by verl ({VERL}.{function})"
    return f"{reason} (only reached through {block})" if block and not target.endswith(f":{block}") else reason


def _assert_one_owner(engine: Any, baseline: dict[str, str]) -> list[str]:
    """Every target verl took is ``yielded`` to it by name and holds verl's code; every other
    target is as it would be without verl (applied: our code is live). Returns the applied names."""
    applied = []
    for name, record in _ours(engine).items():
        family, kind = name.split(".")[1:]
        if kind in VERL_OWNS.get(family, {}):
            assert (record.state, record.reason) == ("yielded", _expected_reason(family, kind, record.target)), name
            function, block = VERL_OWNS[family][kind]
            live = _live(f"{record.target.partition(':')[0]}:{block}" if block else record.target)
            assert describe(live) == f"{VERL}.{function}", name
            continue
        assert record.state == baseline[name], (name, record.reason)
        if record.state == "applied":
            assert marked_by(_live(record.target)) == name, name
            applied.append(name)
    return applied


# Tests taking both fixtures name ``make_engine`` first: pytest tears it down last, after ``verl``
# put the modules back, so revert() then finds our patches live again and undoes them all (an
# experts implementation displaced by verl's block would otherwise stay registered as the default
# for later tests).
@pytest.fixture
def baseline(make_engine: Any, verl: Any) -> dict[str, str]:
    """Our record states on this transformers without verl (then settled and reverted)."""
    engine = make_engine()
    records = _ours(engine)
    states = {name: record.state for name, record in records.items()}
    engine.settle(engine.pending_modules())
    engine.revert()
    # yielded only to another of our patches on a class two families share (4.57 Qwen2.5-VL's Qwen2RMSNorm)
    shared = {n: r.reason for n, r in records.items() if r.state == "yielded"}
    assert all(reason.startswith("target owned by transformers.") for reason in shared.values()), shared
    assert set(states.values()) <= {"applied", "unsupported", "yielded"}, states
    return states


def test_ours_first_then_verl_assigns(make_engine: Any, verl: Any, baseline: dict[str, str]) -> None:
    engine = make_engine()
    assert {n: r.state for n, r in _ours(engine).items()} == baseline
    verl.apply_npu_patches()  # what verl's FSDP engine start-up runs on an NPU host without Liger
    applied = _assert_one_owner(engine, baseline)
    verl_functions = {n: _live(r.target) for n, r in _ours(engine).items() if r.state == "yielded"}
    assert engine.revert() == applied  # only what is still ours
    assert {n: _live(r.target) for n, r in _ours(engine).items() if r.state == "yielded"} == verl_functions
    assert {n: r.state for n, r in _ours(engine).items() if n not in applied} == dict.fromkeys(
        verl_functions, "yielded"
    )


def test_verl_first_then_our_engine_activates(make_engine: Any, verl: Any, baseline: dict[str, str]) -> None:
    verl.apply_npu_patches()
    engine = make_engine()  # late activation: python -S + activate(), or the vLLM plugin
    applied = _assert_one_owner(engine, baseline)
    assert engine.revert() == applied
    experts = transformers_npu.patch_name("qwen3_moe", "experts")
    if experts in baseline:
        assert marked_by(_live(_ours(engine)[experts].target)) is None  # never installed under verl's block


def _run(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.float().sin().sum().backward()
    return logits.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.skipif("qwen3_moe" not in PRESENT, reason="this transformers has no Qwen3-MoE")
def test_tiny_qwen3_moe_same_logits_and_gradients_whoever_owns(make_engine: Any, verl: Any, npu: Any) -> None:
    module = importlib.import_module(transformers_npu.module_name("qwen3_moe"))
    model = randomize(builders()["qwen3_moe"]())  # layer 0 dense (Qwen3MoeMLP), layer 1 sparse
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    reference, reference_grads = _run(model, ids)
    assert not npu.calls

    def ours() -> None:
        make_engine(transformers_npu.family_patches("qwen3_moe"))

    def theirs() -> None:
        verl.NPU_PATCHES["qwen3_moe"]()

    # Each scenario runs a model built after its owners were installed, as one loaded after start-up
    # is (on transformers 5.x the experts implementation is chosen when the model is built), with the
    # reference weights.
    results, calls = {}, {}
    for label, steps in {
        "ours": (ours,),
        "verl": (theirs,),
        "ours, then verl": (ours, theirs),
        "verl, then ours": (theirs, ours),
    }.items():
        with restored([module]):
            for step in steps:
                step()
            built = builders()["qwen3_moe"]()
            built.load_state_dict(model.state_dict())
            npu.calls.clear()
            results[label] = _run(built, ids)
            calls[label] = dict(npu.calls)
    for label, (logits, grads) in results.items():
        torch.testing.assert_close(logits, reference, rtol=1e-3, atol=1e-4, msg=lambda m, s=label: f"{s}: {m}")
        assert grads.keys() == reference_grads.keys(), label
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], rtol=1e-3, atol=1e-4, msg=lambda m, n=name: n + m)
    # Nothing ran twice: with both installed every RMSNorm and rotary call is one NPU op, the
    # sparse layer runs verl's block (its experts GMMs), and only the dense MLP is ours.
    for label in ("ours, then verl", "verl, then ours"):
        both = calls[label]
        assert both["npu_rms_norm"] == calls["ours"]["npu_rms_norm"] == calls["verl"]["npu_rms_norm"], calls
        assert both["npu_rotary_mul"] == calls["ours"]["npu_rotary_mul"] == calls["verl"]["npu_rotary_mul"], calls
        for op in ("npu_moe_token_permute", "npu_grouped_matmul[group_type=0]", "npu_grouped_matmul[group_type=2]"):
            assert both[op] == calls["verl"][op], (label, op, calls)
        assert both["npu_swiglu"] == calls["verl"]["npu_swiglu"] + 1, calls  # + our dense-layer MLP
    assert calls["ours"]["npu_moe_token_permute"] == calls["verl"]["npu_moe_token_permute"] == 1


CHILD = """
import json, sys, types, importlib
sys.path[:0] = {paths!r}
from tests.hf import npu_emulation
sys.modules["torch_npu"] = npu_emulation
for name, sub in (("verl", ""), ("verl.models", "/models"), ("verl.models.transformers", "/models/transformers")):
    package = types.ModuleType(name)
    package.__path__ = [{verl_root!r} + sub]
    sys.modules[name] = package
import verl_npu_autopatch
from transformers.models.qwen3_moe import modeling_qwen3_moe
npu_patch = importlib.import_module("verl.models.transformers.npu_patch")
{order}
report = verl_npu_autopatch.report()
states = {{r.name: [r.state, r.reason] for r in report.records if r.name.startswith("transformers.qwen3_moe.")}}
targets = {{r.name: r.target for r in report.records if r.name.startswith("transformers.qwen3_moe.")}}
reverted = verl_npu_autopatch.revert("transformers.qwen3_moe")
block = modeling_qwen3_moe.Qwen3MoeSparseMoeBlock.forward.__name__
out = {{"trigger": report.trigger, "states": states, "targets": targets, "reverted": reverted, "block": block}}
print(json.dumps(out))
"""


@pytest.mark.parametrize("order", ["ours-first", "verl-first"])
def test_process_wide_engine_in_both_orders(order: str, verl: Any) -> None:
    """The real start-up path: ``.pth`` hooks fire at the transformers import, then verl assigns;
    or ``python -S`` (no ``.pth``), verl assigns, then ``verl_npu_autopatch.activate()``."""
    import json
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    steps = {
        "ours-first": "npu_patch.apply_npu_patches()",
        "verl-first": "npu_patch.apply_npu_patches()\nverl_npu_autopatch.activate()",
    }
    code = CHILD.format(
        paths=[sysconfig.get_paths()["purelib"]],
        verl_root=str(Path(verl.__file__).parents[2]),
        order=steps[order],
    )
    args = ["-S"] if order == "verl-first" else []
    env = {"VERL_NPU_AUTOPATCH_DEVICE": "npu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["trigger"] == "api") is (order == "verl-first")  # else the start-up hook woke it
    name = "transformers.qwen3_moe."
    assert out["states"] == {
        name + "rms_norm": ["yielded", _expected_reason("qwen3_moe", "rms_norm", out["targets"][name + "rms_norm"])],
        name + "rotary": ["yielded", _expected_reason("qwen3_moe", "rotary", out["targets"][name + "rotary"])],
        name + "experts": ["yielded", _expected_reason("qwen3_moe", "experts", out["targets"][name + "experts"])],
        name + "mlp": ["applied", "fix installed"],
    }
    assert out["reverted"] == [name + "mlp"]
    assert out["block"] == "qwen3_moe_sparse_moe_block_forward_npu"
