"""Arbitration with the real Liger-Kernel, in either order. Each scenario runs in a fresh child
interpreter (Liger rebinds transformers module attributes for good); Liger kernels never run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.support.children import ROOT

PRELUDE = textwrap.dedent(
    """
    import json, sys
    from tests.hf.tiny_configs import MROPE, rope_arguments
    from verl_npu_autopatch.engine.config import Config
    from verl_npu_autopatch.engine.lifecycle import Engine
    from verl_npu_autopatch.patches import liger_arbitration as liger, transformers_npu
    from verl_npu_autopatch.authoring.patching import marked_by

    def make_engine():
        engine = Engine([*transformers_npu.PATCHES, *liger.PATCHES], Config(device="npu"))
        engine.activate("test")
        return engine

    def owner(target):
        module, _, qualname = target.partition(":")
        obj, holders = sys.modules[module], []
        for part in qualname.split("."):
            holders.append(obj)
            obj = getattr(obj, part)
        origins = [getattr(getattr(o, "__func__", o), "__module__", "") or "" for o in [obj, *holders[1:]]]
        if any(o.startswith("liger_kernel") for o in origins):
            return "liger"
        if marked_by(obj):
            return "ours"
        if isinstance(holders[-1], type) and transformers_npu.dispatcher_interface(obj) is not None:
            # transformers 5.x experts: registered
            from verl_npu_autopatch.patches.transformers_npu import experts_interface
            return "ours" if experts_interface.installed(holders[-1]) else "upstream"
        return "upstream"

    def dump(engine, families, **extra):
        records = {
            name: {"state": r.state, "reason": r.reason, "target": r.target,
                   "owner": owner(r.target) if r.target.split(":")[0] in sys.modules else None}
            for name, r in engine.records.items()
            if name.split(".")[1] in families or name == "liger.arbitration"
        }
        print(json.dumps({"records": records, **extra}))

    def liger_takes(family, records, **switches):
        # our kinds of `family` whose target the live Liger function rebinds with these switches on,
        # read from Liger's own code by liger.rebound_names
        import liger_kernel.transformers.monkey_patch as mp
        rebound = liger.rebound_names(getattr(mp, f"apply_liger_kernel_to_{family}"))
        taken = []
        for name, r in records.items():
            kind = name.rsplit(".", 1)[1]
            switch = liger.LIGER_SWITCH.get(kind)
            holders = {part.partition(":")[2].split(".")[0] for part in r["target"].split(" | ")}
            if name.startswith(f"transformers.{family}.") and switches.get(switch) and holders & rebound[switch]:
                taken.append(kind)
        return sorted(taken)

    def liger_version():
        import importlib.metadata
        return importlib.metadata.version("liger-kernel")

    def tiny(family, model_cls, config_cls, **extra):
        import importlib
        module = importlib.import_module(transformers_npu.module_name(family))
        cls = getattr(module, config_cls)
        config = cls(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, **rope_arguments(cls, extra))
        return getattr(module, model_cls)(config)
    """
)


def child(code: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def family(records: dict, name: str) -> dict:
    return {k.rsplit(".", 1)[1]: v for k, v in records.items() if k.startswith(f"transformers.{name}.")}


def assert_one_owner(records: dict) -> None:
    """Applied means our kernel is live; yielded means it is not (and Liger's may be)."""
    for name, record in records.items():
        if name == "liger.arbitration":
            assert record["state"] == "applied", record
        elif record["state"] == "applied":
            assert record["owner"] == "ours", (name, record)
        else:
            assert record["state"] == "yielded" and record["owner"] != "ours", (name, record)


def test_liger_applied_after_us_takes_over_its_targets() -> None:
    out = child(
        """
        engine = make_engine()
        import transformers.models.qwen2.modeling_qwen2, transformers.models.qwen3.modeling_qwen3
        import transformers.models.qwen3_next.modeling_qwen3_next
        before = {n: r.state for n, r in engine.records.items() if n.split(".")[1] in ("qwen2", "qwen3")}
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2, apply_liger_kernel_to_qwen3
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_next
        apply_liger_kernel_to_qwen2()
        apply_liger_kernel_to_qwen3(rope=False)
        apply_liger_kernel_to_qwen3_next()
        expert_mlp = owner("transformers.models.qwen3_next.modeling_qwen3_next:Qwen3NextMLP.forward")
        dump(engine, ("qwen2", "qwen3", "qwen3_next"), before=before, expert_mlp=expert_mlp)
        """
    )
    assert set(out["before"].values()) == {"applied"} and len(out["before"]) == 6
    records = out["records"]
    assert_one_owner(records)
    qwen2, qwen3, qwen3_next = family(records, "qwen2"), family(records, "qwen3"), family(records, "qwen3_next")
    for kind in ("rms_norm", "mlp", "rotary"):
        assert qwen2[kind]["owner"] == "liger"
        assert qwen2[kind]["reason"] == "target handed to liger-kernel (apply_liger_kernel_to_qwen2)"
    assert qwen3["rms_norm"]["owner"] == qwen3["mlp"]["owner"] == "liger"
    assert "apply_liger_kernel_to_qwen3)" in qwen3["mlp"]["reason"]
    assert (qwen3["rotary"]["state"], qwen3["rotary"]["owner"]) == ("applied", "ours")  # rope=False
    # Liger has no gated RMSNorm and leaves rope off for Qwen3-Next: those stay ours.
    assert qwen3_next["rms_norm_gated"]["state"] == qwen3_next["rotary"]["state"] == "applied"
    assert qwen3_next["rms_norm"]["owner"] == "liger"
    if qwen3_next["experts"]["target"].endswith("SparseMoeBlock.forward"):
        # transformers 4.x: Liger swaps the per-expert MLP class but not the block forward, which stays
        # ours (it reads the experts' weights into one grouped matmul; Liger's MLP forward is not called).
        assert qwen3_next["experts"]["owner"] == "ours" and out["expert_mlp"] == "liger"
    else:
        assert qwen3_next["experts"]["owner"] == "liger"  # LigerExperts


def test_liger_on_an_instance_as_verl_calls_it() -> None:
    out = child(
        """
        engine = make_engine()
        model = tiny("qwen3", "Qwen3ForCausalLM", "Qwen3Config")
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        models = [model, tiny("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", **moe),
                  tiny("qwen3_vl_moe", "Qwen3VLMoeTextModel", "Qwen3VLMoeTextConfig", rope_parameters=MROPE, **moe)]
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
        for m in models:
            _apply_liger_kernel_to_instance(model=m, fused_linear_cross_entropy=False, swiglu=True)
        layer, moe_layer = model.model.layers[0], models[1].model.layers[0]
        bound = {
            "mlp": layer.mlp.forward.__func__.__module__,
            "norm": layer.input_layernorm.forward.__func__.__module__,
            "class_mlp_marked": bool(marked_by(type(layer.mlp).forward)),
            "class_norm_marked": bool(marked_by(type(layer.input_layernorm).forward)),
            "moe_mlp_class": marked_by(sys.modules[
                transformers_npu.module_name("qwen3_moe")].Qwen3MoeMLP.forward),
            "moe_experts": None if hasattr(moe_layer.mlp.experts, "__iter__")
            else moe_layer.mlp.experts.forward.__func__.__module__,
            "expert_mlp": [e.forward.__func__.__module__ for e in moe_layer.mlp.experts]
            if hasattr(moe_layer.mlp.experts, "__iter__") else None,
        }
        records = {n: {"target": r.target} for n, r in engine.records.items()}
        switches = dict(rms_norm=True, swiglu=True, rope=True)
        def swiglu_kinds(f):
            return {"mlp", "experts"} & {n.rsplit(".", 1)[1] for n in records if n.startswith(f"transformers.{f}.")}
        kept = {f: sorted(swiglu_kinds(f) - set(liger_takes(f, records, **switches)))
                for f in ("qwen3", "qwen3_moe", "qwen3_vl_moe")}
        dump(engine, ("qwen3", "qwen3_moe", "qwen3_vl_moe"), bound=bound, kept=kept, liger=liger_version())
        """
    )
    records = out["records"]
    assert_one_owner(records)
    transformers4 = out["bound"]["expert_mlp"] is not None
    kept = out["kept"]  # swiglu targets the live Liger code does not rebind
    if out["liger"] == "0.8.5" and not transformers4:
        # Liger 0.8.5 (transformers 5): swiglu=True replaces Qwen3MLP and the MoE experts, but not
        # the Qwen3-MoE / Qwen3-VL-MoE dense MLPs.
        assert kept == {"qwen3": [], "qwen3_moe": ["mlp"], "qwen3_vl_moe": ["mlp"]}
    if out["liger"] == "0.7.0" and transformers4:
        # Liger 0.7.0 (transformers 4.57): swiglu=True replaces Qwen3MLP and Qwen3MoeMLP (the
        # per-expert MLP class), neither sparse-MoE block nor the Qwen3-VL-MoE text MLP.
        assert kept == {"qwen3": [], "qwen3_moe": ["experts"], "qwen3_vl_moe": ["experts", "mlp"]}
    for name in ("qwen3", "qwen3_moe", "qwen3_vl_moe"):
        for kind, record in family(records, name).items():
            if kind in kept[name]:
                assert (record["state"], record["owner"]) == ("applied", "ours"), (name, kind, record)
                why = f"kept: apply_liger_kernel_to_{name}(swiglu=True) does not replace {record['target']}"
                assert record["reason"].startswith("fix installed") and record["reason"].endswith(f"; {why}")
                continue
            assert record["state"] == "yielded", (name, kind, record)
            assert record["reason"] == (
                f"target handed to liger-kernel (_apply_liger_kernel_to_instance -> apply_liger_kernel_to_{name})"
            )
    if out["bound"]["expert_mlp"] is None:
        assert family(records, "qwen3_moe")["experts"]["owner"] == "liger"  # LigerExperts
        assert out["bound"]["moe_experts"].startswith("liger_kernel")
    else:
        # transformers 4.x: a ModuleList of per-expert MLPs inside the block, each Liger's now; the
        # block forward stays ours (it reads their weights into grouped matmuls, never calls them).
        assert family(records, "qwen3_moe")["experts"]["owner"] == "ours"
        assert all(m.startswith("liger_kernel") for m in out["bound"]["expert_mlp"]), out["bound"]["expert_mlp"]
    assert out["bound"]["mlp"].startswith("liger_kernel") and out["bound"]["norm"].startswith("liger_kernel")
    assert out["bound"]["class_mlp_marked"] is out["bound"]["class_norm_marked"] is False
    # Qwen3MoeMLP's class forward: ours where Liger does not replace it, else given back to upstream.
    ours_there = "transformers.qwen3_moe.mlp" if "mlp" in kept["qwen3_moe"] else None
    assert out["bound"]["moe_mlp_class"] == ours_there


def test_liger_function_that_raises_takes_nothing() -> None:
    out = child(
        """
        engine = make_engine()
        model = tiny("qwen3_vl", "Qwen3VLTextModel", "Qwen3VLTextConfig", rope_parameters=MROPE)
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
        error = None
        try:
            _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False, swiglu=True)
        except ImportError as exc:
            error = str(exc)
        records = {n: {"target": r.target} for n, r in engine.records.items()}
        taken = liger_takes("qwen3_vl", records, rms_norm=True, swiglu=True, rope=True)
        dump(engine, ("qwen3_vl",), error=error, taken=taken)
        """
    )
    records = out["records"]
    assert_one_owner(records)
    states = {k: (v["state"], v["owner"]) for k, v in family(records, "qwen3_vl").items()}
    if out["error"] is not None:
        # Liger 0.8.5's Qwen3-VL code cannot import its output class on transformers 5.24: it raises
        # before replacing anything, so our kernels stay, and say so.
        assert "LigerQwen3VLCausalLMOutputWithPast" in out["error"]
        assert states == dict.fromkeys(("rms_norm", "mlp", "rotary"), ("applied", "ours"))
    else:
        # This Liger's Qwen3-VL code runs on this transformers (0.8.5 on 5.9, 0.7.0 on 4.57): it takes
        # exactly what its code rebinds (no swiglu code for Qwen3-VL: the MLP stays ours).
        assert out["taken"] == ["rms_norm", "rotary"], out["taken"]
        assert states == {**dict.fromkeys(out["taken"], ("yielded", "liger")), "mlp": ("applied", "ours")}
        for kind in out["taken"]:
            assert family(records, "qwen3_vl")[kind]["reason"] == (
                "target handed to liger-kernel (_apply_liger_kernel_to_instance -> apply_liger_kernel_to_qwen3_vl)"
            )


def test_liger_applied_before_us_is_left_alone() -> None:
    out = child(
        """
        import transformers.models.qwen2.modeling_qwen2 as q2
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2, apply_liger_kernel_to_qwen3
        apply_liger_kernel_to_qwen2()
        apply_liger_kernel_to_qwen3()
        import transformers.models.qwen3.modeling_qwen3
        engine = make_engine()
        dump(engine, ("qwen2", "qwen3"))
        """
    )
    records = out["records"]
    assert_one_owner(records)
    for name in ("qwen2", "qwen3"):
        for kind, record in family(records, name).items():
            assert record["state"] == "yielded" and record["owner"] == "liger", (name, kind, record)
            assert record["reason"].startswith("target owned by liger-kernel (liger_kernel.transformers."), record
    assert "LigerRMSNorm.forward" in records["transformers.qwen2.rms_norm"]["reason"]


def test_liger_applied_before_us_keeps_what_it_does_not_replace() -> None:
    out = child(
        """
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe
        apply_liger_kernel_to_qwen3_moe()  # class level, before our engine activates
        engine = make_engine()
        records = {n: {"target": r.target} for n, r in engine.records.items()}
        taken = liger_takes("qwen3_moe", records, rms_norm=True, swiglu=True, rope=True)
        dump(engine, ("qwen3_moe",), taken=taken, liger=liger_version())
        """
    )
    records = out["records"]
    assert_one_owner(records)
    qwen3_moe = family(records, "qwen3_moe")
    # What the engine saw live at apply time matches what Liger's code rebinds (its defaults: all on).
    for kind, record in qwen3_moe.items():
        expected = ("yielded", "liger") if kind in out["taken"] else ("applied", "ours")
        assert (record["state"], record["owner"]) == expected, (kind, record)
    transformers4 = qwen3_moe["experts"]["target"].endswith("SparseMoeBlock.forward")
    if out["liger"] == "0.8.5" and not transformers4:
        # Liger 0.8.5 leaves Qwen3MoeMLP (the dense layers' MLP) alone on transformers 5: ours runs there.
        assert out["taken"] == ["experts", "rms_norm", "rotary"]
        assert "LigerExperts.forward" in qwen3_moe["experts"]["reason"]
    if out["liger"] == "0.7.0" and transformers4:
        # Liger 0.7.0 swaps the per-expert MLP class, not the sparse-MoE block: the block stays ours.
        assert out["taken"] == ["mlp", "rms_norm", "rotary"]
        assert "LigerQwen3MoeSwiGLUMLP.forward" in qwen3_moe["mlp"]["reason"]


def test_liger_before_the_modeling_module_is_imported() -> None:
    out = child(
        """
        engine = make_engine()
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3
        assert "transformers.models.qwen3.modeling_qwen3" not in sys.modules
        apply_liger_kernel_to_qwen3()
        dump(engine, ("qwen3",))
        """
    )
    records = out["records"]
    assert_one_owner(records)
    assert {k: v["owner"] for k, v in family(records, "qwen3").items()} == dict.fromkeys(
        ("rms_norm", "mlp", "rotary"), "liger"
    )


def test_revert_restores_liger_untouched() -> None:
    out = child(
        """
        engine = make_engine()
        import liger_kernel.transformers.monkey_patch as mp
        wrapped = mp.MODEL_TYPE_TO_APPLY_LIGER_FN["qwen3"] is mp.apply_liger_kernel_to_qwen3
        marked = bool(marked_by(mp.apply_liger_kernel_to_qwen3))
        engine.revert()
        print(json.dumps({"wrapped": wrapped, "marked": marked,
                          "after": bool(marked_by(mp.apply_liger_kernel_to_qwen3)),
                          "table": bool(marked_by(mp.MODEL_TYPE_TO_APPLY_LIGER_FN["qwen3"])),
                          "instance": bool(marked_by(mp._apply_liger_kernel_to_instance))}))
        """
    )
    assert out == {"wrapped": True, "marked": True, "after": False, "table": False, "instance": False}
