"""The vLLM patches reach fresh interpreters: a ``spawn`` child, and a real vLLM engine's
EngineCore and worker processes on CPU.

Nothing is pickled but a queue and a function named by module: each child activates the
process-wide engine from the installed ``.pth`` at its first vLLM import, with
``VERL_NPU_AUTOPATCH_DEVICE=npu`` inherited through the environment.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.vllm import vnpa_child
from verl_npu_autopatch.authoring.spec import Site
from verl_npu_autopatch.patches import vllm_moe, vllm_rotary_flash_attn_guard

MOE, ROTARY = "vllm.moe_weight_loader", "vllm.rotary_flash_attn_guard"


def expected_rotary_state() -> str:
    """What the rotary patch's check says about the installed class (``applied`` when it applies)."""
    from vllm.model_executor.layers.rotary_embedding import common

    patch = vllm_rotary_flash_attn_guard.PATCHES[0]
    cls = common.ApplyRotaryEmb
    site = Site(patch, patch.targets[0], common, cls, "__init__", cls.__dict__["__init__"])
    action = patch.check(site).action
    return "applied" if action == "apply" else action


def spawn_report(monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, Any]:
    """Run ``vnpa_child.import_and_report`` in a spawn child with ``env`` set; return its data."""
    for key in [k for k in os.environ if k.startswith("VERL_NPU_AUTOPATCH")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=vnpa_child.import_and_report, args=(queue,))
    child.start()
    try:
        data = json.loads(queue.get(timeout=300))
    finally:
        child.join(60)
    assert child.exitcode == 0
    assert data["pid"] != os.getpid()
    return data


def states(report: dict[str, Any]) -> dict[str, str]:
    return {r["name"]: r["state"] for r in report["records"]}


def test_spawn_child_importing_vllm_gets_both_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    data = spawn_report(monkeypatch, VERL_NPU_AUTOPATCH_DEVICE="npu")
    report = data["report"]
    assert report["status"] == "active", report
    assert report["trigger"] == "vllm"  # woken by the .pth observer at the first vLLM import
    got = states(report)
    assert got[MOE] == "applied", report
    assert got[ROTARY] == expected_rotary_state(), report
    assert data["marks"]["weight_loader"] == MOE
    assert data["marks"]["rotary_init"] == (ROTARY if got[ROTARY] == "applied" else None)


def test_spawn_child_on_this_host_without_forcing_stays_inactive(monkeypatch: pytest.MonkeyPatch) -> None:
    data = spawn_report(monkeypatch)
    assert data["report"]["status"] == "inactive"
    assert "torch_npu" in data["report"]["reason"]
    assert data["marks"]["weight_loader"] is None


# ---------------------------------------------------------------- a real vLLM engine on CPU

PROBE = '''
"""Test-only vLLM general plugin: writes this process's autopatch report to $VNPA_PROBE_DIR."""
import json, multiprocessing, os, sys

TARGETS = (
    "vllm.model_executor.layers.fused_moe.routed_experts",
    "vllm.model_executor.layers.fused_moe.layer",
    "vllm.model_executor.layers.rotary_embedding.common",
)


def _write(*_args):
    import verl_npu_autopatch

    data = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "process": multiprocessing.current_process().name,
        "argv0": sys.argv[0] if sys.argv else "",
        "loaded": [m for m in TARGETS if m in sys.modules],
        "report": verl_npu_autopatch.report().to_dict(),
    }
    path = os.path.join(os.environ["VNPA_PROBE_DIR"], f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def register():
    """Called by vLLM in every process; rewrites the report after each target module loads
    (these hooks run after the engine's, which were registered at the first vLLM import)."""
    import wrapt

    _write()
    for module in TARGETS:
        wrapt.register_post_import_hook(_write, module)
'''

#: ``sys.argv[0]`` of vLLM's model-inspection subprocess (``python -m ...models.registry``).
REGISTRY_SCRIPT = "vllm/model_executor/models/registry.py"

DRIVER = """
import json, os
from vllm import LLM, SamplingParams
llm = LLM(model=os.environ["VNPA_MODEL"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
          max_model_len=128, max_num_seqs=2, seed=0)
out = llm.generate([{"prompt_token_ids": [3, 4, 5, 6]}],
                   SamplingParams(max_tokens=4, temperature=0.0, detokenize=False), use_tqdm=False)
print("@@VNPA@@" + json.dumps({"pid": os.getpid(), "tokens": list(out[0].outputs[0].token_ids)}), flush=True)
"""


def write_tiny_moe(path: Path) -> None:
    """A random 2-layer Qwen3-MoE checkpoint (per-expert tensors, float32), made here: no downloads.
    ``moe_intermediate_size`` 48 against hidden 64 keeps the expert shapes unambiguous."""
    import torch
    from safetensors.torch import save_file

    vocab, hidden, inter, experts, layers, heads, kv_heads, head_dim = 512, 64, 48, 4, 2, 4, 2, 64
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 128,
        "moe_intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 256,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "norm_topk_prob": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).contiguous()

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    tensors["lm_head.weight"] = rand(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        tensors[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        tensors[p + "self_attn.q_norm.weight"] = torch.ones(head_dim)
        tensors[p + "self_attn.k_norm.weight"] = torch.ones(head_dim)
        tensors[p + "mlp.gate.weight"] = rand(experts, hidden)
        for e in range(experts):
            tensors[p + f"mlp.experts.{e}.gate_proj.weight"] = rand(inter, hidden)
            tensors[p + f"mlp.experts.{e}.up_proj.weight"] = rand(inter, hidden)
            tensors[p + f"mlp.experts.{e}.down_proj.weight"] = rand(hidden, inter)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def write_probe_plugin(site: Path) -> None:
    """The probe module plus a dist-info declaring it as a ``vllm.general_plugins`` entry point;
    on PYTHONPATH only for the engine's processes, nothing is installed."""
    site.mkdir(parents=True)
    (site / "vnpa_engine_probe.py").write_text(textwrap.dedent(PROBE))
    info = site / "vnpa_engine_probe-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vnpa-engine-probe\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nvnpa_engine_probe = vnpa_engine_probe:register\n")


def test_real_vllm_engine_processes_report_patches_applied(tmp_path: Path) -> None:
    model, site, out = tmp_path / "tiny-moe", tmp_path / "site", tmp_path / "reports"
    write_tiny_moe(model)
    write_probe_plugin(site)
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_NPU_AUTOPATCH") and k != "PYTHONPATH"}
    env.update(
        VERL_NPU_AUTOPATCH_DEVICE="npu",
        VLLM_TARGET_DEVICE="cpu",
        VLLM_WORKER_MULTIPROC_METHOD="spawn",
        VLLM_CPU_KVCACHE_SPACE="1",
        PYTHONPATH=str(site),
        VNPA_PROBE_DIR=str(out),
        VNPA_MODEL=str(model),
        # A cold cache every run: vLLM then inspects the model class in a subprocess of the driver
        # (``python -m vllm.model_executor.models.registry``), which imports the MoE layer too.
        VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
    )
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0 and "@@VNPA@@" in proc.stdout, proc.stderr[-6000:]
    driver = json.loads(proc.stdout.rsplit("@@VNPA@@", 1)[1].splitlines()[0])
    assert len(driver["tokens"]) == 4

    reports = [json.loads(p.read_text()) for p in out.glob("*.json")]
    inspectors = [r for r in reports if r["argv0"].endswith(REGISTRY_SCRIPT)]
    assert all(r["ppid"] == driver["pid"] for r in inspectors)  # the driver's model inspection
    by_process = {r["process"]: r for r in reports if r["pid"] != driver["pid"] and r not in inspectors}
    engine_core = [r for name, r in by_process.items() if name.startswith("EngineCore")]
    assert engine_core, sorted(by_process)
    rotary = expected_rotary_state()
    routed, common = (
        "vllm.model_executor.layers.fused_moe.routed_experts",
        "vllm.model_executor.layers.rotary_embedding.common",
    )
    # Every engine process is active with both patches armed; whichever process imported a target
    # (the model is built by the worker, a child of EngineCore) reports its patch decided there.
    loaders = [r for r in by_process.values() if routed in r["loaded"]]
    assert loaders, sorted(by_process)
    for r in by_process.values():
        assert r["report"]["status"] == "active", r
        assert r["report"]["trigger"] == "vllm", r  # the .pth observer, at the first vLLM import
        got = states(r["report"])
        assert got[MOE] == ("applied" if routed in r["loaded"] else "pending"), r
        assert got[ROTARY] == (rotary if common in r["loaded"] else "pending"), r
    core_pids = {r["pid"] for r in engine_core}
    assert all(r["ppid"] == driver["pid"] for r in engine_core)  # EngineCore: the driver's child
    assert all(r["pid"] in core_pids or r["ppid"] in core_pids for r in loaders)
    for r in inspectors:  # the inspection subprocess builds no model, but its records are armed too
        assert r["report"]["status"] == "active", r
        assert states(r["report"])[MOE] == ("applied" if routed in r["loaded"] else "pending"), r
    summary = {
        name: {n: s for n, s in states(r["report"]).items() if n in (MOE, ROTARY)} for name, r in by_process.items()
    }
    print("\nengine processes:", summary)


def test_patch_catalog_lists_both_vllm_patches() -> None:
    from verl_npu_autopatch.engine import catalog

    names = [p.name for p in catalog.builtin()]
    assert MOE in names and ROTARY in names
    assert vllm_moe.PATCHES[0].groups == vllm_rotary_flash_attn_guard.PATCHES[0].groups == ("vllm",)
