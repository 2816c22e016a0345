"""Our GLM-5.2 / CaMem / partial wake-up patches next to verl 0.9.1's own copies, in both orders.

verl's ``verl/utils/vllm/npu_vllm_patch.py`` runs unchanged (tests/support/verl_upstream.py) and its
functions are called as ``apply_npu_vllm_patches()`` calls them under
``VERL_VLLM_ASCEND_GLM52_PATCH=1``: ``patch_camem_sleep()``, ``patch_vllm_ascend_glm52()``,
``patch_vllm_glm52_partial_wake_up()``. Our engine reads the same switch. The targets are the real
vllm-ascend 0.23.0 files and vLLM 0.23.0's ``core.py``, loaded as the other tests here load them,
with the CPU test doubles of tests/ascend/doubles.py for torch_npu / torch.npu / acl.

"Ours first" is the normal case (our hooks fire at the target's import, verl runs later); "verl
first" is a late activation (``python -S`` + ``activate()``, or the vLLM plugin).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ascend import doubles
from tests.ascend.test_ascend_camem_sleep_sync import load_camem, sleep_events
from tests.ascend.test_rms_norm import EPS, HIDDEN, make_layer, reference_rms_norm
from tests.ascend.test_sfa import HEAD_DIM, N_HEAD, build_sfa, make_impl, run_indexer
from tests.ascend.test_vllm_engine_partial_wake_up import make_engine_core
from tests.support import release_loaders, upstream, verl_upstream
from verl_npu_autopatch.authoring.patching import MARKER
from verl_npu_autopatch.patches import ascend_camem_sleep_sync, ascend_glm52, vllm_engine_partial_wake_up
from verl_npu_autopatch.patches._verl import GLM52_MARKER, verl_owned
from verl_npu_autopatch.patches.ascend_glm52.rules import LAYERNORM, SFA

GLM = {"VERL_VLLM_ASCEND_GLM52_PATCH": "1"}  # verl's switch, which our configuration honours too
ORDERS = ["ours-first", "verl-first"]
VERL = "verl.utils.vllm.npu_vllm_patch"
SCALE = 1 / (N_HEAD**0.5 * HEAD_DIM**0.5)


@pytest.fixture(scope="session")
def verl_root() -> Path:
    return verl_upstream.root()


@pytest.fixture
def engines() -> Iterator[Callable[..., Any]]:
    with verl_upstream.engines() as start:
        yield start


def packaged(modules: dict[str, types.ModuleType]) -> dict[str, types.ModuleType]:
    """``modules`` plus stub parent packages holding them as attributes, so ``from
    vllm_ascend.attention import sfa_v1`` (verl's import style) finds them."""
    found = dict(modules)
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        while parent and parent != "vllm_ascend":
            package = found.get(parent) or doubles.stub_module(parent, "TEST DOUBLE: a vllm-ascend package")
            package.__path__ = []
            setattr(package, child, module)
            found[parent] = module = package
            parent, _, child = parent.rpartition(".")
    return found


@pytest.fixture
def verl(verl_root: Path, npu: None) -> Iterator[types.ModuleType]:
    """verl's real patch module, imported afresh (after the NPU doubles: verl checks torch.npu)."""
    with verl_upstream.packages(verl_root):
        yield verl_upstream.patch_module()


# ----------------------------------------------------------------------------- GLM-5.2 (sfa_v1, layernorm)
GLM_PATCHES = list(ascend_glm52.PATCHES)


#: The sites each GLM-5.2 fix changes on vllm-ascend 0.23.0.
GLM_SITES = {
    "ascend.rms_norm_residual": {f"{LAYERNORM}:AscendRMSNorm.forward_oot"},
    "ascend.sfa_keep_kv_b_proj": {f"{SFA}:AscendSFAImpl.process_weights_after_loading", f"{SFA}:dispose_layer"},
    "ascend.sfa_indexer_scale": {f"{SFA}:DeviceOperator.indexer_select_post_process"},
}


@release_loaders.loads(ascend_glm52, "vllm-ascend", ("0.23.0",), sites={"0.23.0": GLM_SITES}, param=True)
@pytest.fixture
def glm(request: pytest.FixtureRequest, releases: Any, npu: None) -> Iterator[types.SimpleNamespace]:
    """vllm-ascend's ``sfa_v1`` (its functions) and ``ops/layernorm.py`` (the whole file), of release
    ``request.param`` (0.23.0 when not parametrized)."""
    doubles.register_maybe_chunk_residual()
    root = releases[getattr(request, "param", "0.23.0")][0]
    sfa = build_sfa(root)
    with contextlib.contextmanager(doubles.load_layernorm)(root) as layernorm:
        modules = {"vllm_ascend.attention.sfa_v1": sfa, "vllm_ascend.ops.layernorm": layernorm}
        with doubles.modules(packaged(modules)):
            yield types.SimpleNamespace(sfa=sfa, layernorm=layernorm)


def live(owner: type, name: str) -> Any:
    value = owner.__dict__[name]
    return getattr(value, "__func__", value)


def run_glm(order: str, verl: types.ModuleType, start: Callable[..., Any]) -> Any:
    if order == "verl-first":
        verl.patch_vllm_ascend_glm52()
    engine = start(*GLM_PATCHES, **GLM)
    if order == "ours-first":
        verl.patch_vllm_ascend_glm52()
    return engine


def test_premise_verl_alone_scales_once_and_drops_the_norm_bias(glm: Any, verl: types.ModuleType) -> None:
    verl.patch_vllm_ascend_glm52()
    raw, received = run_indexer(glm.sfa)
    torch.testing.assert_close(received, raw * SCALE)
    layer = biased_layer(glm.layernorm)
    x, residual = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    out, _ = layer.forward_oot(x, residual)
    expected = reference_rms_norm(x + residual, layer.weight)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)  # the bias dropped


def test_premise_without_verl_marker_both_sides_scale(glm: Any, verl: types.ModuleType, engines: Any) -> None:
    """Why ours carries verl's marker: verl's source check reads through our functools.wraps."""
    engines(*GLM_PATCHES, **GLM)
    delattr(live(glm.sfa.DeviceOperator, "indexer_select_post_process"), GLM52_MARKER)
    verl.patch_vllm_ascend_glm52()
    raw, received = run_indexer(glm.sfa)
    torch.testing.assert_close(received, raw * SCALE * SCALE)  # x 1/4096 instead of x 1/64 at GLM-5.2 size


@pytest.mark.parametrize("order", ORDERS)
def test_indexer_weights_are_scaled_exactly_once(glm: Any, verl: types.ModuleType, engines: Any, order: str) -> None:
    engine = run_glm(order, verl, engines)
    raw, received = run_indexer(glm.sfa)
    torch.testing.assert_close(received, raw * SCALE)
    operator = live(glm.sfa.DeviceOperator, "indexer_select_post_process")
    rec = engine.report()["ascend.sfa_indexer_scale"]
    if order == "ours-first":
        assert rec.state == "applied" and operator.__dict__[MARKER] == "ascend.sfa_indexer_scale", rec
        assert verl_owned(operator.__wrapped__) is None  # ours wraps the release's operator only
    else:
        owner = verl_owned(operator)
        assert owner == f"{VERL}._patch_glm52_sfa_indexer_scale.<locals>.patched_operator"
        assert (rec.state, rec.reason) == ("yielded", f"target owned by verl ({owner})")
        assert engine.revert("ascend.sfa_indexer_scale") == []  # nothing of ours to undo
        assert live(glm.sfa.DeviceOperator, "indexer_select_post_process") is operator


@pytest.mark.parametrize("order", ORDERS)
def test_kv_b_proj_is_kept_by_one_owner(glm: Any, verl: types.ModuleType, engines: Any, order: str) -> None:
    engine = run_glm(order, verl, engines)
    process = live(glm.sfa.AscendSFAImpl, "process_weights_after_loading")
    impl = make_impl(glm.sfa)
    impl.process_weights_after_loading(torch.bfloat16)
    assert impl.kv_b_proj.weight.numel() > 0  # kept for the next weight sync
    rec = engine.report()["ascend.sfa_keep_kv_b_proj"]
    if order == "ours-first":
        assert rec.state == "applied" and process.__dict__[MARKER] == "ascend.sfa_keep_kv_b_proj"
        assert verl_owned(glm.sfa.dispose_layer) is None  # verl's selective dispose_layer never installed
    else:
        assert rec.state == "yielded" and verl_owned(process) in rec.reason, rec
        assert (
            verl_owned(glm.sfa.dispose_layer)
            == f"{VERL}._patch_glm52_sfa_kv_b_proj_disposal.<locals>.selective_dispose_layer"
        )


def biased_layer(layernorm: types.ModuleType) -> torch.nn.Module:
    """An AscendRMSNorm with a non-zero norm bias (what an m4-quantised checkpoint loads)."""
    layer = make_layer(layernorm, torch.float32)
    layer.bias = torch.nn.Parameter(torch.linspace(-0.5, 0.5, HIDDEN), requires_grad=False)
    layer.bias_loaded = True
    return layer


@pytest.mark.parametrize("order", ORDERS)
def test_rms_norm_residual_added_once_and_ours_runs(glm: Any, verl: types.ModuleType, engines: Any, order: str) -> None:
    upstream_forward = live(glm.layernorm.AscendRMSNorm, "forward_oot")
    engine = run_glm(order, verl, engines)
    forward = live(glm.layernorm.AscendRMSNorm, "forward_oot")
    assert forward.__dict__[MARKER] == "ascend.rms_norm_residual" and forward.__wrapped__ is upstream_forward
    rec = engine.report()["ascend.rms_norm_residual"]
    assert rec.state == "applied", rec
    if order == "verl-first":
        assert f"replaces verl's {VERL}._patch_glm52_ascend_rms_norm.<locals>.patched_forward" in rec.reason

    layer = biased_layer(glm.layernorm)
    torch.manual_seed(1)
    x, residual = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    doubles.EVENTS.clear()
    out, new_residual = layer.forward_oot(x, residual)
    assert torch.equal(new_residual, x + residual)  # added once
    assert doubles.names() == ["torch.ops.vllm.maybe_chunk_residual", "torch_npu.npu_rms_norm"]
    expected = reference_rms_norm(x + residual, layer.weight) + layer.bias.double()  # the bias kept
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert layer.variance_epsilon == EPS

    assert engine.revert("ascend.rms_norm_residual") == ["ascend.rms_norm_residual"]
    back = live(glm.layernorm.AscendRMSNorm, "forward_oot")  # exactly what was live before ours
    if order == "verl-first":
        assert verl_owned(back) and back.__wrapped__ is upstream_forward
    else:  # verl skipped its copy (our marker), so the release's method is back
        assert back is upstream_forward


# ----------------------------------------------------------------------------- CaMem
@pytest.fixture
def camem(releases: Any, npu: None) -> Iterator[types.ModuleType]:
    with (
        contextlib.contextmanager(load_camem)(releases["0.23.0"][0]) as module,
        doubles.modules(packaged({"vllm_ascend.device_allocator.camem": module})),
    ):
        yield module


@pytest.mark.parametrize("order", ORDERS)
def test_camem_synchronizes_once_before_unmapping(camem: Any, verl: types.ModuleType, engines: Any, order: str) -> None:
    if order == "verl-first":
        verl.patch_camem_sleep()
    engine = engines(*ascend_camem_sleep_sync.PATCHES, **GLM)
    if order == "ours-first":
        verl.patch_camem_sleep()
    events = sleep_events(camem)
    assert events[:3] == ["torch.npu.synchronize", "unmap_and_release", "unmap_and_release"]
    assert events.count("torch.npu.synchronize") == 1
    rec = engine.report()["ascend.camem_sleep_sync"]
    sleep = live(camem.CaMemAllocator, "sleep")
    if order == "ours-first":
        assert rec.state == "applied" and sleep.__dict__[MARKER] == "ascend.camem_sleep_sync"
    else:
        assert (rec.state, rec.reason) == ("yielded", f"target owned by verl ({verl_owned(sleep)})")
        assert verl_owned(sleep) == f"{VERL}.patch_camem_sleep.<locals>.patched_sleep"


# ----------------------------------------------------------------------------- EngineCore partial wake-up
WAKE = "vllm.engine_partial_wake_up"


@pytest.fixture
def core(releases: Any, npu: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """vLLM 0.23.0's EngineCore methods (plus ``run_engine_core``, which verl swaps) as
    ``vllm.v1.engine.core``, also as the package attribute verl's ``from vllm.v1.engine import core``
    reads."""
    import vllm.v1.engine as package

    module = upstream.load_subset(
        releases["0.23.0"][1] / "vllm/v1/engine/core.py",
        "vllm.v1.engine.core",
        {
            "EngineCore": ("wake_up", "execute_dummy_batch"),
            "EngineCoreProc": ("run_engine_core",),
            "DPEngineCoreProc": ("run_busy_loop",),
        },
    )
    monkeypatch.setattr(package, "core", module, raising=False)
    with doubles.modules({"vllm.v1.engine.core": module}):
        yield module


@pytest.mark.parametrize("order", ORDERS)
def test_partial_wake_up_has_one_owner(core: Any, verl: types.ModuleType, engines: Any, order: str) -> None:
    upstream_wake_up = live(core.EngineCore, "wake_up")
    entry = core.EngineCoreProc.__dict__["run_engine_core"]
    if order == "verl-first":
        verl.patch_vllm_glm52_partial_wake_up()
    engine = engines(*vllm_engine_partial_wake_up.PATCHES, **GLM)
    if order == "ours-first":
        verl.patch_vllm_glm52_partial_wake_up()

    wake_up, dummy = live(core.EngineCore, "wake_up"), live(core.DPEngineCoreProc, "execute_dummy_batch")
    owners = {verl_owned(wake_up) is not None, verl_owned(dummy) is not None}
    assert len(owners) == 1  # both methods from the same side
    assert wake_up.__wrapped__ is upstream_wake_up  # nobody wrapped the other's fix
    rec = engine.report()[WAKE]
    if order == "ours-first":
        assert rec.state == "applied" and wake_up.__dict__[MARKER] == WAKE, rec
        assert core.EngineCoreProc.__dict__["run_engine_core"] is entry  # verl saw it patched: no swap
    else:
        assert rec.state == "yielded" and f"verl ({VERL}.patch_vllm_glm52_partial_wake_up" in rec.reason, rec

    engine_core = make_engine_core(core)
    engine_core.wake_up(["weights", "scheduling"])
    engine_core.execute_dummy_batch()
    assert engine_core.model_executor.calls == [("wake_up", ["weights"])]  # no resume, no dummy while asleep
    engine_core.wake_up(["kv_cache"])
    assert engine_core.model_executor.calls[1:] == [("wake_up", ["kv_cache"]), "resume"]
