"""A patch declares everything it touches: triggers run it (and are where its site is resolved),
secondary sites and the files its static rule reads are shown by ``status`` and ``list``."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from tests.support.children import run
from verl_npu_autopatch.authoring.patching import chain, mark, marked_by, set_attribute, set_entry, set_marked
from verl_npu_autopatch.authoring.spec import APPLY, ComputedSites, Patch, Reach, StaticRule, Target
from verl_npu_autopatch.cli import main as cli
from verl_npu_autopatch.engine import catalog, ownership
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.lifecycle import Engine
from verl_npu_autopatch.patches import ascend_routed_experts_capture, vllm_engine_partial_wake_up

TRIGGER = "autopatch_decl_trigger"
CHANGED = "autopatch_decl_changed"


def _modules(monkeypatch: pytest.MonkeyPatch, *, trigger: bool) -> type:
    changed = types.ModuleType(CHANGED)

    class Layer:
        def forward(self) -> str:
            return "upstream"

    changed.Layer = Layer
    monkeypatch.setitem(sys.modules, CHANGED, changed)
    if trigger:
        module = types.ModuleType(TRIGGER)
        module.__file__ = "/nowhere/trigger.py"
        monkeypatch.setitem(sys.modules, TRIGGER, module)
    return Layer


def _patch(seen: list[str]) -> Patch:
    def fix(site):  # replaces the declared target, not the trigger it was resolved on
        seen.append(str(site.target))

        def forward(self) -> str:
            return "fixed"

        return set_attribute(sys.modules[CHANGED].Layer, "forward", forward)

    return Patch(
        "test.triggered",
        "Runs when the trigger is imported; changes the target.",
        targets=(Target(CHANGED, "Layer.forward"),),
        reach=Reach(triggers=(Target(TRIGGER, "__file__"),)),
        fix=fix,
        device="any",
    )


def test_the_trigger_runs_the_patch_and_holds_its_site(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _modules(monkeypatch, trigger=True)
    seen: list[str] = []
    engine = Engine([_patch(seen)], Config(device="npu"))
    engine.activate("test")
    try:
        assert engine.records["test.triggered"].state == "applied"
        assert seen == [f"{TRIGGER}:__file__"] and layer().forward() == "fixed"
        assert engine.revert() == ["test.triggered"] and layer().forward() == "upstream"
    finally:
        engine.settle(engine.pending_modules())
        engine.revert()


def test_a_present_target_waits_for_its_trigger_import(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    layer = _modules(monkeypatch, trigger=False)
    (tmp_path / f"{TRIGGER}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, TRIGGER, raising=False)
    seen: list[str] = []
    engine = Engine([_patch(seen)], Config(device="npu"))
    engine.activate("test")
    try:
        assert engine.records["test.triggered"].state == "pending"
        assert engine.pending_modules() == [TRIGGER]
        assert seen == [] and layer().forward() == "upstream"
        __import__(TRIGGER)
        assert engine.records["test.triggered"].state == "applied"
        assert seen == [f"{TRIGGER}:__file__"] and layer().forward() == "fixed"
    finally:
        engine.settle(engine.pending_modules())
        engine.revert()
        sys.modules.pop(TRIGGER, None)


def test_hooks_are_the_triggers_else_the_targets() -> None:
    target, trigger = Target("a", "f"), Target("b", "__file__")
    plain = Patch("p.plain", "s", (target,), fix=lambda site: lambda: None)
    triggered = Patch("p.trig", "s", (target,), fix=lambda site: lambda: None, reach=Reach(triggers=(trigger,)))
    assert plain.hooks == (target,) and triggered.hooks == (trigger,)
    assert triggered.touches() == (trigger, target)


@pytest.mark.parametrize("reads", [(), ("/abs/vllm/x.py",), ("vllm/x.txt",)])
def test_a_static_rule_names_relative_python_files(reads: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="reads"):
        StaticRule(lambda tree: APPLY, reads=reads)


def test_ascend_capture_declares_its_trigger_and_marks_what_it_installs() -> None:
    (patch,) = ascend_routed_experts_capture.PATCHES
    assert [str(t) for t in patch.reach.triggers] == [f"{ascend_routed_experts_capture.WORKER}:__file__"]
    assert [str(t) for t in patch.targets] == [
        f"{ascend_routed_experts_capture.CAPTURER}:RoutedExpertsCapturer.capture"
    ]
    capturer = type("RoutedExpertsCapturer", (), {"capture": lambda self, layer_id, topk_ids: None})
    installed = lambda self, layer_id, topk_ids: "vllm-ascend's"  # noqa: E731
    fake = {
        ascend_routed_experts_capture.CAPTURER: types.SimpleNamespace(RoutedExpertsCapturer=capturer),
        ascend_routed_experts_capture.CAPTURE: types.SimpleNamespace(capture=installed),
    }
    original = capturer.__dict__["capture"]
    site = types.SimpleNamespace(patch=patch, handover=None)  # no hand-over: the trim is not enabled alongside
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ascend_routed_experts_capture.importlib, "import_module", fake.__getitem__)
        undo = patch.fix(site)  # type: ignore[arg-type]
    assert capturer.__dict__["capture"] is installed and marked_by(installed) == patch.name
    undo()
    assert capturer.__dict__["capture"] is original


def test_every_static_rule_is_on_its_patch_and_no_family_keeps_a_table() -> None:
    statics = {p.name.partition(".")[0] for p in catalog.builtin() if p.static is not None}
    assert statics == {"vllm", "ascend", "tensordict", "torch_npu", "megatron", "verl"}  # the decision table's rows
    for module in catalog.families():
        assert not hasattr(module, "STATIC") and not hasattr(module, "NOTES"), module.__name__
    assert ascend_routed_experts_capture.PATCHES[0].static.note is not None


def test_list_and_status_show_every_declared_site() -> None:
    (engine_patch,) = vllm_engine_partial_wake_up.PATCHES
    lines = cli.touches(engine_patch)
    assert lines == [
        "vllm.v1.engine.core:EngineCore.wake_up",
        "also changes vllm.v1.engine.core:DPEngineCoreProc.execute_dummy_batch",
        "decision table reads vllm/v1/engine/core.py",
    ]
    markdown = cli.catalog_markdown(cli.catalog_data())
    assert "triggered by the import of `vllm_ascend.patch.worker`" in markdown
    assert "also changes `vllm_ascend.attention.sfa_v1:dispose_layer`" in markdown
    assert "also changes `vllm.v1.engine.core:DPEngineCoreProc.execute_dummy_batch`" in markdown


def test_status_prints_what_each_patch_touches() -> None:
    proc = run(sys.executable, "from verl_npu_autopatch.cli.main import main; main(['status', '--json'])")
    plans = {p["name"]: p for p in json.loads(proc.stdout)["patches"]}
    assert "triggered by vllm_ascend.patch.worker:__file__" in plans["ascend.routed_experts_capture"]["touches"]
    text = run(sys.executable, "from verl_npu_autopatch.cli.main import main; main(['status', '--all'])").stdout
    assert "what each patch touches:" in text
    assert "also changes vllm.v1.engine.core:DPEngineCoreProc.execute_dummy_batch" in text


def test_every_builtin_patch_without_a_check_says_why() -> None:
    """``doctor --verify`` compares the transformers kernels and the vLLM-side arithmetic fixes
    (``verify.INFERENCE``) with upstream; every other built-in patch was decided (no arithmetic a
    tiny input can compare) and has its own reason, not the catch-all a plugin's patch gets."""
    from verl_npu_autopatch.cli import verify
    from verl_npu_autopatch.engine import catalog
    from verl_npu_autopatch.patches import transformers_npu

    names = [p.name for p in catalog.builtin()]
    checked = {name for name in names if verify.has_check(name)}
    kernels = {p.name for p in transformers_npu.PATCHES if p.name.rsplit(".", 1)[-1] in transformers_npu.KERNELS}
    assert kernels and checked == kernels | {"ascend.rms_norm_residual"}
    assert set(verify.INFERENCE) <= set(names)
    others = [name for name in names if name not in checked]
    assert others
    fallback = verify.not_numeric("plugin.anything")
    assert {name: verify.not_numeric(name) for name in others if verify.not_numeric(name) == fallback} == {}
    # a check and a reason for the same patch would contradict each other
    assert [key for key in verify.NOT_NUMERIC if key in checked] == []


def _changing_everywhere(monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, Patch]:
    """A module with a class and a dispatch table, and a patch whose fix replaces the target,
    a secondary site and each table entry (the sites declared by ``computed``)."""
    module = types.ModuleType(CHANGED)
    module.Layer = type("Layer", (), {"forward": lambda self: "up", "backward": lambda self: "up"})
    module.TABLE = {"a": lambda: "up", "b": lambda: "up"}
    monkeypatch.setitem(sys.modules, CHANGED, module)

    def fix(site):
        undos = [
            set_marked(module.Layer, name, lambda self: "ours", "test.everywhere") for name in ("forward", "backward")
        ]
        undos += [set_entry(module.TABLE, key, mark(lambda: "ours", "test.everywhere")) for key in list(module.TABLE)]
        return chain(*undos)

    patch = Patch(
        "test.everywhere",
        "Changes a target, a secondary site and the entries of a table.",
        targets=(Target(CHANGED, "Layer.forward"),),
        reach=Reach(
            secondary=(Target(CHANGED, "Layer.backward"),),
            computed=(ComputedSites(CHANGED, "TABLE[<key>]", lambda live: tuple(f"TABLE[{k}]" for k in live.TABLE)),),
        ),
        fix=fix,
        device="any",
    )
    return module, patch


def test_a_computed_site_is_declared_and_its_displacement_supersedes_the_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module, patch = _changing_everywhere(monkeypatch)
    assert cli.touches(patch)[1:] == [
        f"also changes {CHANGED}:Layer.backward",
        f"also changes {CHANGED}:TABLE[<key>] (found in the live module)",
    ]
    assert f"also changes `{CHANGED}:TABLE[<key>]` (found in the live module)" in cli._markdown_site(
        cli.touches(patch)[2]
    )
    engine = Engine([patch], Config(device="npu"))
    engine.activate("test")
    try:
        assert engine.report().records[0].state == "applied"
        assert set(ownership.declared_values(patch)) == {
            f"{CHANGED}:Layer.backward",
            f"{CHANGED}:TABLE[a]",
            f"{CHANGED}:TABLE[b]",
        }
        other = module.TABLE["b"] = lambda: "another owner's"
        (record,) = engine.report().records
        assert (record.state, record.reason.split(", now")[0]) == ("superseded", f"also changes {CHANGED}:TABLE[b]")
        assert engine.revert() == [] and module.TABLE["b"] is other  # the later owner is never clobbered
        assert marked_by(module.Layer.__dict__["backward"]) == "test.everywhere"
    finally:
        engine.settle(engine.pending_modules())


def test_undo_restores_every_declared_site(monkeypatch: pytest.MonkeyPatch) -> None:
    module, patch = _changing_everywhere(monkeypatch)
    before = {
        "forward": module.Layer.__dict__["forward"],
        "backward": module.Layer.__dict__["backward"],
        **module.TABLE,
    }
    engine = Engine([patch], Config(device="npu"))
    engine.activate("test")
    assert all(marked_by(v) == patch.name for v in ownership.declared_values(patch).values())
    assert engine.revert() == ["test.everywhere"]
    after = {"forward": module.Layer.__dict__["forward"], "backward": module.Layer.__dict__["backward"], **module.TABLE}
    assert after == before


def test_list_and_status_show_where_each_patch_is_defined(capsys: pytest.CaptureFixture[str]) -> None:
    """``path.py:line`` of the family line that makes the patch (past the helpers that build it)."""
    root = Path(catalog.__file__).resolve().parents[2]
    cli.main(["list", "--json"])
    where = {e["name"]: e["defined_at"] for e in json.loads(capsys.readouterr().out)}
    for patch in catalog.builtin():
        path, _, line = where[patch.name].rpartition(":")
        text = (root / path).read_text(encoding="utf-8").splitlines()[int(line) - 1]
        assert path.startswith("verl_npu_autopatch/patches/") and "/_" not in path.replace("/__init__", ""), path
        assert "Patch(" in text or "patch(" in text or "PATCHES" in text, (patch.name, text)
    assert where["megatron.mtp_postprocess"].startswith("verl_npu_autopatch/patches/megatron_mtp_postprocess.py:")
    made_here = Patch("p.here", "s", (Target("a", "f"),), fix=lambda site: lambda: None)
    assert made_here.defined_at.startswith("tests/unit/test_declarations.py:")
    cli.main(["status", "--all"])
    assert f"  liger.arbitration ({where['liger.arbitration']}):" in capsys.readouterr().out
