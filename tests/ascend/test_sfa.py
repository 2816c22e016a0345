"""``ascend.sfa_keep_kv_b_proj`` and ``ascend.sfa_indexer_scale`` on real release code.

``sfa_v1.py`` imports ~100 vllm-ascend modules, so the test runs only the functions the patches
touch, taken from the downloaded release with their original file and line numbers
(``upstream.load_subset``): ``AscendSFAImpl.process_weights_after_loading`` and
``.indexer_select_post_process`` (sfa_v1.py), ``BaseDeviceAdaptor.indexer_select_post_process``
(device/device_op.py), ``dispose_layer`` / ``dispose_tensor`` (utils.py). Their other globals are
CPU test doubles (tests/ascend/doubles.py) or the real vLLM classes.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator

import pytest
import torch

from tests.ascend import doubles
from tests.support import upstream
from verl_npu_autopatch.engine.lifecycle import PatchError
from verl_npu_autopatch.patches import ascend_glm52

NAME = "vllm_ascend.attention.sfa_v1"
KEEP = [p for p in ascend_glm52.PATCHES if p.name == "ascend.sfa_keep_kv_b_proj"]
SCALE = [p for p in ascend_glm52.PATCHES if p.name == "ascend.sfa_indexer_scale"]
L, N, NOPE, V = 4, 2, 3, 2  # kv_lora_rank, local heads, qk_nope_head_dim, v_head_dim
N_HEAD, HEAD_DIM, ROPE = 4, 8, 2  # indexer heads, indexer head dim, rope dim
FORMAT_HOOK: list = []  # callables run inside the npu_format_cast double (mid-call)


def build_sfa(root) -> types.ModuleType:
    """A ``vllm_ascend.attention.sfa_v1`` holding the release's own functions."""
    from vllm.logger import logger
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    torch_npu = types.SimpleNamespace(**vars(sys.modules["torch_npu"]))
    inner_cast = torch_npu.npu_format_cast

    def npu_format_cast(tensor, acl_format):
        for hook in list(FORMAT_HOOK):
            hook()
        return inner_cast(tensor, acl_format)

    torch_npu.npu_format_cast = npu_format_cast
    utils = upstream.load_subset(
        root / "vllm_ascend/utils.py",
        "vllm_ascend.utils",
        {},
        ("dispose_layer", "dispose_tensor"),
        {"torch": torch, "Any": object},
    )
    device_op = upstream.load_subset(
        root / "vllm_ascend/device/device_op.py",
        "vllm_ascend.device.device_op",
        {"BaseDeviceAdaptor": ("indexer_select_post_process",)},
        (),
        {"torch": torch, "torch_npu": torch_npu, "Any": object},
    )
    device_type = types.SimpleNamespace(A5="A5", A3="A3")
    return upstream.load_subset(
        root / "vllm_ascend/attention/sfa_v1.py",
        NAME,
        {"AscendSFAImpl": ("process_weights_after_loading", "indexer_select_post_process")},
        (),
        {
            "torch": torch,
            "torch_npu": torch_npu,
            "logger": logger,
            "HAS_TRITON": False,
            "UnquantizedLinearMethod": UnquantizedLinearMethod,
            "ACL_FORMAT_FRACTAL_ND": 2,
            "dispose_layer": utils.dispose_layer,
            "DeviceOperator": device_op.BaseDeviceAdaptor,
            # TEST DOUBLES for vllm-ascend helpers: ND weights stay ND; an A3 (not A5) device.
            "maybe_trans_nz": lambda weight: weight,
            "record_attention_compute_start": lambda: None,
            "get_ascend_device_type": lambda: device_type.A3,
            "AscendDeviceType": device_type,
        },
    )


@pytest.fixture
def sfa(releases, npu) -> Iterator[types.ModuleType]:
    FORMAT_HOOK.clear()
    module = build_sfa(releases["0.23.0"][0])
    with doubles.modules({NAME: module}):
        yield module
    FORMAT_HOOK.clear()


def make_impl(sfa: types.ModuleType, seed: int = 0):
    """An ``AscendSFAImpl`` carrying the attributes the two release methods read."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    torch.manual_seed(seed)
    impl = object.__new__(sfa.AscendSFAImpl)
    impl.kv_b_proj = torch.nn.Linear(L, N * (NOPE + V), bias=False).requires_grad_(False)  # as vLLM's
    impl.kv_b_proj.quant_method = UnquantizedLinearMethod()
    impl.kv_lora_rank, impl.local_num_heads, impl.qk_nope_head_dim, impl.v_head_dim = L, N, NOPE, V
    impl.enable_dsa_cp = impl.enable_sfa_prolog_v3 = impl.enable_mlapo = impl.enable_sparse_li_c8 = False
    impl.has_indexer, impl.n_head, impl.head_dim, impl.qk_rope_head_dim = True, N_HEAD, HEAD_DIM, ROPE
    impl.is_rope_neox_style, impl.use_torch_npu_lightning_indexer, impl.layer_name = False, True, "layers.0"
    return impl


def expected_w_uv(weight: torch.Tensor) -> torch.Tensor:
    """W_UV by definition: kv_b_proj.weight (out x L) transposed, split per head into [nope | v],
    the v part, heads first: shape (N, L, V)."""
    per_head = weight.detach().t().reshape(L, N, NOPE + V)
    return per_head[:, :, NOPE:].permute(1, 0, 2)


# ----------------------------------------------------------------------------- kv_b_proj
def test_release_disposes_kv_b_proj(sfa):
    impl = make_impl(sfa)
    impl.process_weights_after_loading(torch.bfloat16)
    assert impl.kv_b_proj.weight.numel() == 0
    with pytest.raises(RuntimeError):  # a later RL weight sync has nowhere to load into
        impl.kv_b_proj.weight.data.copy_(torch.ones(N * (NOPE + V), L))


def test_patched_keeps_kv_b_proj_for_the_next_weight_sync(sfa):
    engine = upstream.run_engine(KEEP, VERL_VLLM_ASCEND_GLM52_PATCH="1")
    assert engine.report()["ascend.sfa_keep_kv_b_proj"].state == "applied"
    impl = make_impl(sfa)
    first = impl.kv_b_proj.weight.detach().clone()
    impl.process_weights_after_loading(torch.bfloat16)
    assert torch.equal(impl.kv_b_proj.weight.detach(), first)
    torch.testing.assert_close(impl.W_UV, expected_w_uv(first))

    update = torch.randn(N * (NOPE + V), L)  # the RL weight sync loads new weights, then re-runs
    with torch.no_grad():
        impl.kv_b_proj.weight.copy_(update)
    w_uv = impl.W_UV
    impl.process_weights_after_loading(torch.bfloat16)
    assert impl.W_UV is w_uv  # refreshed in place (graph-captured address kept)
    torch.testing.assert_close(impl.W_UV, expected_w_uv(update))


def test_other_layers_are_still_disposed(sfa):
    upstream.run_engine(KEEP, VERL_NPU_AUTOPATCH_ENABLE="ascend.sfa_keep_kv_b_proj")
    impl, other = make_impl(sfa), torch.nn.Linear(3, 3).requires_grad_(False)
    FORMAT_HOOK.append(lambda: sfa.dispose_layer(other))  # disposed while impl's call runs
    impl.process_weights_after_loading(torch.bfloat16)
    assert other.weight.numel() == 0 and impl.kv_b_proj.weight.numel() > 0
    sfa.dispose_layer(impl.kv_b_proj)  # outside the call nothing is preserved
    assert impl.kv_b_proj.weight.numel() == 0


def test_preservation_does_not_leak_into_other_threads(sfa):
    engine = upstream.run_engine(KEEP, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert engine.report()["ascend.sfa_keep_kv_b_proj"].state == "applied"
    impl, seen = make_impl(sfa), []

    def dispose_from_another_thread() -> None:
        worker = threading.Thread(target=sfa.dispose_layer, args=(impl.kv_b_proj,))
        worker.start()
        worker.join()
        seen.append(impl.kv_b_proj.weight.numel())

    FORMAT_HOOK.append(dispose_from_another_thread)
    impl.process_weights_after_loading(torch.bfloat16)
    assert seen == [0]  # while this thread preserved kv_b_proj, the other thread's dispose still ran


def test_nested_calls_preserve_both_layers(sfa):
    upstream.run_engine(KEEP, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    outer, inner = make_impl(sfa, 1), make_impl(sfa, 2)

    def run_inner_once() -> None:
        FORMAT_HOOK.clear()
        inner.process_weights_after_loading(torch.bfloat16)

    FORMAT_HOOK.append(run_inner_once)
    outer.process_weights_after_loading(torch.bfloat16)  # outer disposes after inner returned
    assert inner.kv_b_proj.weight.numel() > 0 and outer.kv_b_proj.weight.numel() > 0


def test_revert_restores_method_and_module_global(sfa):
    method, dispose = sfa.AscendSFAImpl.__dict__["process_weights_after_loading"], sfa.dispose_layer
    engine = upstream.run_engine(KEEP, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert sfa.dispose_layer is not dispose
    assert engine.revert() == ["ascend.sfa_keep_kv_b_proj"]
    assert sfa.dispose_layer is dispose
    assert sfa.AscendSFAImpl.__dict__["process_weights_after_loading"] is method


# ----------------------------------------------------------------------------- indexer scale
def run_indexer(sfa, **attributes: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the release's ``AscendSFAImpl.indexer_select_post_process`` (on an impl with
    ``attributes`` besides the usual ones); return (raw head weights, weights the lightning indexer
    received)."""
    impl = make_impl(sfa)
    vars(impl).update(attributes)
    tokens = 3
    kw = torch.randn(tokens, HEAD_DIM + N_HEAD)
    impl.wk_weights_proj = lambda x: (kw, None)
    impl.wq_b = lambda q_c: (torch.randn(tokens, N_HEAD * HEAD_DIM), None)
    cos = sin = torch.ones(tokens, 1, 1, ROPE)
    kv_cache = (None, None, torch.zeros(1), None)
    metadata = types.SimpleNamespace(block_table=torch.zeros(1, 1, dtype=torch.int32))
    seq = torch.tensor([tokens])
    doubles.EVENTS.clear()
    impl.indexer_select_post_process(
        torch.randn(tokens, 16), torch.randn(tokens, 8), kv_cache, metadata, cos, sin, seq, seq
    )
    (call,) = [details for name, details in doubles.EVENTS if name == "torch_npu.npu_lightning_indexer"]
    return kw[:, HEAD_DIM:], call["weights"]


def test_release_passes_unscaled_indexer_weights(sfa):
    raw, received = run_indexer(sfa)
    assert torch.equal(received, raw)


def test_patched_indexer_weights_are_scaled(sfa):
    engine = upstream.run_engine(SCALE, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert engine.report()["ascend.sfa_indexer_scale"].state == "applied"
    assert isinstance(sfa.DeviceOperator.__dict__["indexer_select_post_process"], staticmethod)
    raw, received = run_indexer(sfa)
    torch.testing.assert_close(received, raw / (N_HEAD**0.5 * HEAD_DIM**0.5))
    engine.revert()
    raw, received = run_indexer(sfa)
    assert torch.equal(received, raw)


def test_indexer_without_sfa_impl_is_unsupported_and_strict_raises(releases, npu):
    """0.30.0rc2 dropped the ``sfa_impl`` parameter: the check names what it expected and found."""
    root = releases["0.30.0rc2"][0]
    device_op = upstream.load_subset(
        root / "vllm_ascend/device/device_op.py",
        "vllm_ascend.device.device_op",
        {"BaseDeviceAdaptor": ("indexer_select_post_process",)},
        (),
        {"torch": torch, "Any": object},
    )
    module = types.ModuleType(NAME)
    module.DeviceOperator = device_op.BaseDeviceAdaptor
    original = module.DeviceOperator.__dict__["indexer_select_post_process"]
    with doubles.modules({NAME: module}):
        record = upstream.run_engine(SCALE, VERL_NPU_AUTOPATCH_ENABLE="glm52").report()["ascend.sfa_indexer_scale"]
        assert record.state == "unsupported"
        assert "sfa_impl, q_li" in record.reason and "found DeviceOperator.indexer_select_post_process(q_li," in (
            record.reason
        )
        assert module.DeviceOperator.__dict__["indexer_select_post_process"] is original
        with pytest.raises(PatchError, match=r"ascend\.sfa_indexer_scale"):
            upstream.run_engine(SCALE, VERL_NPU_AUTOPATCH_ENABLE="glm52", VERL_NPU_AUTOPATCH_STRICT="1")


# ----------------------------------------------------------------------------- 0.30: attention/indexer.py
INDEXER = "vllm_ascend.attention.indexer"


def build_indexer(root) -> types.ModuleType:
    """A ``vllm_ascend.attention.indexer`` holding the release's own ``AscendSFAIndexerBackend.forward``
    and ``forward_k``, whose ``DeviceOperator`` is the release's ``BaseDeviceAdaptor`` (device_op.py)."""
    torch_npu = sys.modules["torch_npu"]
    device_op = upstream.load_subset(
        root / "vllm_ascend/device/device_op.py",
        "vllm_ascend.device.device_op",
        {"BaseDeviceAdaptor": ("indexer_select_post_process",)},
        (),
        {"torch": torch, "torch_npu": torch_npu, "Any": object},
    )
    return upstream.load_subset(
        root / "vllm_ascend/attention/indexer.py",
        INDEXER,
        {"AscendSFAIndexerBackend": ("forward_k", "forward")},
        (),
        {
            "torch": torch,
            "torch_npu": torch_npu,
            "HAS_TRITON": False,
            "DeviceOperator": device_op.BaseDeviceAdaptor,
            "INDEXER_K_CACHE_SLOT": 0,  # the release's module constants
            "INDEXER_SCALE_CACHE_SLOT": 1,
        },
    )


@pytest.fixture
def indexer030(releases, npu) -> Iterator[types.ModuleType]:
    module = build_indexer(releases["0.30.0rc2"][0])
    with doubles.modules({INDEXER: module}):
        yield module


def run_backend(indexer) -> tuple[torch.Tensor, torch.Tensor]:
    """Run 0.30.0rc2's ``AscendSFAIndexerBackend.forward`` (k path, then top-k selection through
    ``DeviceOperator``); return (raw head weights, weights the lightning indexer received)."""
    backend = object.__new__(indexer.AscendSFAIndexerBackend)
    tokens = 3
    kw = torch.randn(tokens, HEAD_DIM + N_HEAD)
    backend.n_head, backend.head_dim, backend.qk_rope_head_dim = N_HEAD, HEAD_DIM, ROPE
    backend.is_rope_neox_style, backend.use_torch_npu_lightning_indexer = False, True
    backend.enable_sparse_li_c8 = backend.enable_sparse_li_c4 = False
    backend.wk_weights_proj = lambda x: (kw, None)
    backend.k_norm = lambda k: k
    backend.wq_b = lambda q_c: (torch.randn(tokens, N_HEAD * HEAD_DIM), None)
    backend.k_cache = types.SimpleNamespace(kv_cache=(torch.zeros(1), None))
    # TEST DOUBLES for the cache write (not what the patch touches).
    backend._gather_cache_inputs = lambda k, k_scale, metadata: (k, k_scale, None)
    backend.write_cache = lambda *args, **kwargs: None
    backend.enable_sparse_li_quant = False
    seq = torch.tensor([tokens])
    metadata = types.SimpleNamespace(
        cos=torch.ones(tokens, 1, 1, ROPE),
        sin=torch.ones(tokens, 1, 1, ROPE),
        actual_seq_lengths_query=seq,
        actual_seq_lengths_key=seq,
        block_table=torch.zeros(1, 1, dtype=torch.int32),
    )
    hidden = torch.randn(tokens, 16)
    doubles.EVENTS.clear()
    backend.forward(hidden, torch.randn(tokens, 8), hidden, metadata)
    (call,) = [details for name, details in doubles.EVENTS if name == "torch_npu.npu_lightning_indexer"]
    return kw[:, HEAD_DIM:], call["weights"]


def test_030_release_passes_unscaled_indexer_weights(indexer030):
    """The evidence the decision rests on, executed: 0.30.0rc2's standard (non-KPool) indexer hands
    the raw ``kw[:, head_dim:]`` columns to the lightning indexer."""
    raw, received = run_backend(indexer030)
    assert torch.equal(received, raw)


def test_030_kpool_backend_scales_but_standard_backend_does_not(releases):
    """The same release's GLM-Next KPool backend scales the weights (softmax_scale * n_head**-0.5);
    the standard backend feeding DeviceOperator does not: the patch's 0.30 rule says ``apply``."""
    from verl_npu_autopatch.authoring.fingerprints import ModuleSource

    root = releases["0.30.0rc2"][0]
    kpool = (root / "vllm_ascend/attention/indexer_kpool.py").read_text(encoding="utf-8")
    assert "weights = weights * (self.softmax_scale * self.n_head**-0.5)" in kpool
    source = ModuleSource((root / "vllm_ascend/attention/indexer.py").read_text(encoding="utf-8"))
    device_op = ModuleSource((root / "vllm_ascend/device/device_op.py").read_text(encoding="utf-8"))
    verdict = ascend_glm52.indexer_backend_rule(
        device_op.code("BaseDeviceAdaptor.indexer_select_post_process"),
        source.code("AscendSFAIndexerBackend.forward"),
        source.code("AscendSFAIndexerBackend.forward_k"),
    )
    assert verdict.action == "apply"


def test_030_patched_indexer_weights_are_scaled(indexer030):
    base = indexer030.DeviceOperator
    original = base.__dict__["indexer_select_post_process"]
    engine = upstream.run_engine(SCALE, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    record = engine.report()["ascend.sfa_indexer_scale"]
    assert record.state == "applied"
    assert record.target == f"{INDEXER}:DeviceOperator.indexer_select_post_process"
    assert isinstance(base.__dict__["indexer_select_post_process"], staticmethod)
    raw, received = run_backend(indexer030)
    torch.testing.assert_close(received, raw / (N_HEAD**0.5 * HEAD_DIM**0.5))
    assert engine.revert() == ["ascend.sfa_indexer_scale"]
    assert base.__dict__["indexer_select_post_process"] is original
    raw, received = run_backend(indexer030)
    assert torch.equal(received, raw)


def test_030_quantized_query_takes_heads_from_the_original_shape():
    """With LI C8/C4 the query is quantized; the wrapper reads n_head/head_dim from q_li_shape_ori."""
    seen = []

    class Device:
        @staticmethod
        def indexer_select_post_process(q_li, q_li_scale, q_li_shape_ori, weights, *rest):
            seen.append(weights)

    site = types.SimpleNamespace(
        target=types.SimpleNamespace(module=INDEXER),
        owner=Device,
        attribute="indexer_select_post_process",
        patch=SCALE[0],
    )
    undo = ascend_glm52._fix_indexer(site)
    weights = torch.ones(3, N_HEAD)
    Device.indexer_select_post_process(torch.zeros(3, 5), None, (3, N_HEAD, HEAD_DIM), weights, "kv")
    torch.testing.assert_close(seen[0], weights / (N_HEAD**0.5 * HEAD_DIM**0.5))
    undo()


# ----------------------------------------------------------------------------- 0.30: kv_b_proj in RL mode
def test_030_kv_b_proj_decided_from_the_live_rl_config(releases, npu):
    """0.30.0rc2 disposes kv_b_proj only outside RL weight-update mode; the check asks the release's
    own ``is_rl_weight_update_enabled`` with the current vLLM config."""
    from vllm.config import VllmConfig, set_current_vllm_config

    root = releases["0.30.0rc2"][0]
    module = upstream.load_subset(
        root / "vllm_ascend/attention/sfa_v1.py",
        NAME,
        {"AscendSFAImpl": ("process_weights_after_loading",)},
        (),
        {"torch": torch},
    )
    utils = upstream.load_subset(
        root / "vllm_ascend/utils.py",
        "vllm_ascend.utils",
        {},
        ("is_rl_weight_update_enabled", "dispose_layer", "dispose_tensor"),
        {"torch": torch, "Any": object, "VllmConfig": VllmConfig},
    )
    rl = types.SimpleNamespace(rl_config=types.SimpleNamespace(enabled=True))
    utils.get_ascend_config = lambda: rl  # TEST DOUBLE for vllm-ascend's config singleton
    module.dispose_layer, module.is_rl_weight_update_enabled = utils.dispose_layer, utils.is_rl_weight_update_enabled
    with doubles.modules({NAME: module}):
        with set_current_vllm_config(VllmConfig()):
            record = upstream.run_engine(KEEP, VERL_NPU_AUTOPATCH_ENABLE="glm52").report()[KEEP[0].name]
        assert record.state == "fixed-upstream"
        assert "rl_config.enabled" in record.reason and "which is on" in record.reason
        rl.rl_config.enabled = False
        with set_current_vllm_config(VllmConfig()):
            engine = upstream.run_engine(KEEP, VERL_NPU_AUTOPATCH_ENABLE="glm52")
        assert engine.report()[KEEP[0].name].state == "applied"
        engine.revert()


def test_kv_b_proj_fix_steps_aside_when_the_layer_keeps_it_itself(sfa):
    """A layer whose upstream flag says RL keeps kv_b_proj runs upstream's method untouched."""
    upstream.run_engine(KEEP, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    impl, other = make_impl(sfa), torch.nn.Linear(3, 3).requires_grad_(False)
    impl.rl_weight_update_enabled = True
    FORMAT_HOOK.append(lambda: sfa.dispose_layer(other))
    impl.process_weights_after_loading(torch.bfloat16)  # 0.23 has no such flag: it disposes
    assert impl.kv_b_proj.weight.numel() == 0


# ----------------------------------------------------------------------------- 0.24 - 0.27: indexer.py placeholder
PLACEHOLDER_RELEASES = ("0.24.0rc1", "0.25.1rc1", "0.26.0rc1", "0.27.1rc1")


@pytest.mark.parametrize("label", PLACEHOLDER_RELEASES)
def test_placeholder_indexer_module_is_not_taken_for_the_backend(releases, label):
    """0.24 - 0.27 ship an ``attention/indexer.py`` that is only a cache-layer backend; the static
    rule decides on sfa_v1's unscaled ``AscendSFAImpl.indexer_select_post_process`` there."""
    from verl_npu_autopatch.authoring.fingerprints import UpstreamTree

    script = upstream.matrix_script()
    root, vllm_root = releases[label]
    placeholder = (root / "vllm_ascend/attention/indexer.py").read_text(encoding="utf-8")
    assert "class AscendSFAIndexerBackend" in placeholder and "DeviceOperator" not in placeholder
    tree = UpstreamTree((root, vllm_root), {"vllm-ascend": label, "vllm": script.paired_vllm(label)})
    assert tree.module(INDEXER).code("AscendSFAIndexerBackend.forward") is None
    impl = tree.code(NAME, "AscendSFAImpl.indexer_select_post_process")
    assert impl.has("weights=kw[:,self.head_dim:]", "DeviceOperator.indexer_select_post_process(")
    state, reason = script.decide(SCALE[0], tree)
    assert state == "applies" and "placeholder" in reason


def test_placeholder_indexer_release_is_patched_on_sfa_v1(releases, npu):
    """0.24.0rc1 live: the placeholder ``vllm_ascend.attention.indexer`` (its own classes) is
    imported next to sfa_v1; the fix lands on sfa_v1's DeviceOperator and scales the weights."""
    root = releases["0.24.0rc1"][0]
    placeholder = upstream.load_subset(
        root / "vllm_ascend/attention/indexer.py",
        INDEXER,
        {"AscendSFAIndexerBackend": ("get_name",), "AscendSFAIndexerMetadataBuilder": ("build",)},
    )
    module = build_sfa(root)
    with doubles.modules({INDEXER: placeholder, NAME: module}):
        engine = upstream.run_engine(SCALE, VERL_NPU_AUTOPATCH_ENABLE="glm52")
        record = engine.report()["ascend.sfa_indexer_scale"]
        assert record.state == "applied", record.reason
        assert record.target == f"{NAME}:DeviceOperator.indexer_select_post_process"
        raw, received = run_indexer(module, use_sparse_c8_indexer=False)
        torch.testing.assert_close(received, raw / (N_HEAD**0.5 * HEAD_DIM**0.5))
        engine.revert()
        raw, received = run_indexer(module, use_sparse_c8_indexer=False)
        assert torch.equal(received, raw)
