"""``ascend.fused_moe_copies`` on the releases' real ``vllm_ascend/patch/platform/patch_fused_moe.py``
and the paired vLLM's real model modules.

vLLM's ``fused_moe`` package (and its ``layer`` module) is a stand-in holding vLLM's factories as
doubles that return what they were called with. The model modules ``qwen3_moe`` and
``deepseek_v2`` run their own ``from vllm.model_executor.layers.fused_moe import ...`` statements
(``upstream.load_imports``) *before* vllm-ascend's module runs, as when verl imports them early;
then the release's whole ``patch_fused_moe.py`` runs (``upstream.load_file``, its imports of
vllm-ascend doubled) and replaces the names in the package.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_fused_moe_copies as family

NAME = "ascend.fused_moe_copies"
APPLIES = ("0.24.0rc1", "0.25.1rc1", "0.26.0rc1")
MODELS = tuple(f"{family.MODELS}.{m}" for m in family.MODEL_FILES)


def _vllm_factory(name: str) -> Any:
    def factory(*args: Any, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        return name, kwargs

    factory.__name__ = factory.__qualname__ = name
    return factory


class AscendMoERunner:
    """TEST DOUBLE: vllm-ascend's MoE runner class."""


def _ascend_doubles() -> dict[str, types.ModuleType]:
    eplb = types.SimpleNamespace(dynamic_eplb=False, expert_map_path=None, num_redundant_experts=0)
    config = types.SimpleNamespace(eplb_config=eplb)
    found = {
        "vllm_ascend.utils": doubles.stub_module("vllm_ascend.utils", is_310p=lambda: False),
        "vllm_ascend.ascend_config": doubles.stub_module("vllm_ascend.ascend_config", get_ascend_config=lambda: config),
        "vllm_ascend.ops.fused_moe.fused_moe": doubles.stub_module(
            "vllm_ascend.ops.fused_moe.fused_moe", AscendMoERunner=AscendMoERunner
        ),
        "vllm_ascend.ops.activation": doubles.stub_module("vllm_ascend.ops.activation", SituActivationConfig=type),
    }
    for package in ("vllm_ascend.ops", "vllm_ascend.ops.fused_moe", "vllm_ascend.patch", "vllm_ascend.patch.platform"):
        found[package] = doubles.stub_module(package, "TEST DOUBLE: a package")
        found[package].__path__ = []
    return found


def _fused_moe_package(monkeypatch: pytest.MonkeyPatch) -> dict[str, types.ModuleType]:
    """The stand-in package and its ``layer`` module, both holding vLLM's (double) factories; the
    real ``vllm.model_executor.layers`` names the stand-in as its ``fused_moe`` for the test (``import
    a.b.c as x`` reaches ``c`` through the parent's attribute once the real one was imported)."""
    factories = {name: _vllm_factory(name) for name in family.NAMES}
    gate = type("GateLinear", (), {"__doc__": "TEST DOUBLE: also imported by deepseek_v2"})
    package = doubles.stub_module(family.PACKAGE, "TEST DOUBLE: vLLM's fused_moe package", GateLinear=gate, **factories)
    package.__path__ = []
    layer = doubles.stub_module(f"{family.PACKAGE}.layer", "TEST DOUBLE: vLLM's fused_moe layer", **factories)
    package.layer = layer
    monkeypatch.setattr(importlib.import_module("vllm.model_executor.layers"), "fused_moe", package, raising=False)
    return {family.PACKAGE: package, layer.__name__: layer}


@release_loaders.loads(
    family,
    "vllm-ascend",
    ("0.23.0", "0.23.0.post1", *APPLIES),
    sites={
        "0.24.0rc1": {f"{model}:{name}" for model in MODELS for name in family.NAMES},
        "0.26.0rc1": {f"{model}:{family.NAMES[0]}" for model in MODELS},
    },
    param=True,
)
@pytest.fixture
def moe(
    request: pytest.FixtureRequest, releases: dict, npu: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[types.SimpleNamespace]:
    """One release (``request.param``; ``"X@V"``: under a vLLM that reports version ``V``, not the
    paired one): the model modules imported, then vllm-ascend's module run."""
    label, _, reported = request.param.partition("@")
    ascend_root, vllm_root = releases[label]
    vllm_version = reported or upstream.matrix_script().paired_vllm(label)
    stand_ins = {**_ascend_doubles(), **_fused_moe_package(monkeypatch)}
    stand_ins["vllm_ascend.utils"].vllm_version_is = lambda version: version == vllm_version
    with doubles.modules(stand_ins):
        models = {}
        for name in MODELS:
            path = vllm_root / f"{name.replace('.', '/')}.py"
            models[name] = upstream.load_imports(path, name, (family.PACKAGE,))
        with doubles.modules(models):
            original = stand_ins[family.PACKAGE].FusedMoE
            path = Path(ascend_root, *family.PATCH_MODULE.split(".")).with_suffix(".py")
            ascend = upstream.load_file(path, family.PATCH_MODULE)
            with doubles.modules({family.PATCH_MODULE: ascend}):
                yield types.SimpleNamespace(
                    package=stand_ins[family.PACKAGE], models=models, ascend=ascend, original=original
                )


@pytest.mark.parametrize("moe", APPLIES, indirect=True)
def test_release_leaves_the_early_model_modules_with_vllms_factory(moe: types.SimpleNamespace) -> None:
    assert moe.package.FusedMoE is moe.ascend._ascend_FusedMoE  # vllm-ascend replaced it in the package
    for model in moe.models.values():
        assert model.FusedMoE is moe.original  # the stale copy: vLLM's own factory
        assert model.FusedMoE(8, 2)[1].get("runner_cls") is None  # built without vllm-ascend's runner


@pytest.mark.parametrize("moe", APPLIES, indirect=True)
def test_patch_rebinds_the_copies_to_vllm_ascends_factory_and_revert_restores_them(
    moe: types.SimpleNamespace,
) -> None:
    mapping = family.NAMES[1]
    mappings = {name: getattr(model, mapping, None) for name, model in moe.models.items()}
    engine = upstream.run_engine(family.PATCHES)
    record = engine.report()[NAME]
    assert (record.state, record.reason) == ("applied", "fix installed"), record.reason
    for model in moe.models.values():
        assert model.FusedMoE is moe.package.FusedMoE is moe.ascend._ascend_FusedMoE
        assert model.FusedMoE(8, 2)[1]["runner_cls"] is AscendMoERunner
        if mappings[model.__name__] is not None:  # 0.24.0rc1 replaces the mapping too; the others keep vLLM's
            assert getattr(model, mapping) is getattr(moe.package, mapping)
    assert engine.revert() == [NAME]
    for model in moe.models.values():
        assert model.FusedMoE is moe.original
        assert getattr(model, mapping, None) is mappings[model.__name__]
    assert moe.package.FusedMoE is moe.ascend._ascend_FusedMoE  # vllm-ascend's own replacement stays


@pytest.mark.parametrize("moe", ["0.24.0rc1"], indirect=True)
def test_0_24_rebinds_the_expert_params_mapping_copies_too(moe: types.SimpleNamespace) -> None:
    mapping = family.NAMES[1]
    copies = [m for m in moe.models.values() if hasattr(m, mapping)]
    assert copies and all(getattr(m, mapping).__module__ != family.PATCH_MODULE for m in copies)
    engine = upstream.run_engine(family.PATCHES)
    assert engine.report()[NAME].state == "applied"
    assert all(getattr(m, mapping) is moe.ascend._ascend_fused_moe_make_expert_params_mapping for m in copies)


@pytest.mark.parametrize("moe", ["0.25.1rc1"], indirect=True)
def test_a_copy_displaced_afterwards_supersedes_the_record(moe: types.SimpleNamespace) -> None:
    engine = upstream.run_engine(family.PATCHES)
    model = moe.models[MODELS[0]]
    model.FusedMoE = print
    record = engine.report()[NAME]
    assert (record.state, record.reason.split(", now")[0]) == ("superseded", f"also changes {MODELS[0]}:FusedMoE")


@pytest.fixture
def release_module(
    request: pytest.FixtureRequest, releases: dict, npu: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[types.ModuleType]:
    """vllm-ascend's module of release ``request.param`` as the check sees it: its real file (not run)."""
    path = Path(releases[request.param][0], *family.PATCH_MODULE.split(".")).with_suffix(".py")
    module = doubles.stub_module(family.PATCH_MODULE, "TEST DOUBLE: the release's file, not executed")
    module.__file__ = str(path)
    with doubles.modules({**_fused_moe_package(monkeypatch), family.PATCH_MODULE: module}):
        yield module


@pytest.mark.parametrize("release_module", ["0.27.1rc1", "0.30.0rc2"], indirect=True)
def test_releases_rebinding_the_copies_themselves_are_fixed_upstream(release_module: types.ModuleType) -> None:
    record = upstream.run_engine(family.PATCHES).report()[NAME]
    assert record.state == "fixed-upstream", record.reason
    assert "rebinds the copies in vllm.model_executor.models itself" in record.reason


@pytest.mark.parametrize("moe", ["0.23.0", "0.23.0.post1"], indirect=True)
def test_0_23_replaces_nothing_under_its_paired_vllm(moe: types.SimpleNamespace) -> None:
    assert moe.package.FusedMoE is moe.original and not hasattr(moe.ascend, "_original_FusedMoE")
    record = upstream.run_engine(family.PATCHES).report()[NAME]
    assert record.state == "unsupported" and "not replaced under this vLLM" in record.reason, record.reason
    assert all(model.FusedMoE is moe.original for model in moe.models.values())


@pytest.mark.parametrize("moe", ["0.23.0@0.24.0", "0.23.0.post1@0.24.0"], indirect=True)
def test_0_23_under_another_vllm_replaces_and_the_patch_applies(moe: types.SimpleNamespace) -> None:
    assert moe.package.FusedMoE is moe.ascend._ascend_FusedMoE
    engine = upstream.run_engine(family.PATCHES)
    assert engine.report()[NAME].state == "applied", engine.report()[NAME].reason
    assert all(model.FusedMoE is moe.ascend._ascend_FusedMoE for model in moe.models.values())
    assert engine.revert() == [NAME]
    assert all(model.FusedMoE is moe.original for model in moe.models.values())
