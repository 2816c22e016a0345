"""The torch_npu doubles of tests/ascend are bound to the real op schemas (``tests/hf/npu_contract.py``
reads them from the torch_npu wheels): calls torch_npu refuses raise ``TypeError`` here too, and
the real vllm-ascend code the tests drive keeps the contract of the oldest and the newest release
(the whole suite runs against the newest; this file runs the release code under both)."""

from __future__ import annotations

import types

import pytest
import torch

from tests.ascend import doubles
from tests.ascend.test_rms_norm import HIDDEN, PATCH, make_layer
from tests.ascend.test_sfa import INDEXER, NAME, build_indexer, build_sfa, make_impl, run_backend, run_indexer
from tests.hf import npu_contract
from tests.support import upstream

RELEASES = (npu_contract.OLDEST, npu_contract.NEWEST)


@pytest.fixture(params=RELEASES)
def contract(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The torch_npu release whose schemas the doubles enforce, for one test."""
    monkeypatch.setitem(doubles.CONTRACT, "release", request.param)
    return request.param


def test_every_doubled_op_has_a_schema_in_both_releases() -> None:
    for release in RELEASES:
        found = npu_contract.schemas(release, doubles.OPS)
        assert set(found) == set(doubles.OPS)
        assert found["npu_lightning_indexer"].bind((torch.zeros(1),) * 3, {})["layout_query"] == "BSND"


@pytest.mark.usefixtures("contract")
@pytest.mark.parametrize(
    ("op", "args", "kwargs", "message"),
    [
        ("npu_rms_norm", 2, {"eps": 1e-6}, "npu_rms_norm() got an unexpected keyword argument 'eps'"),
        ("npu_add_rms_norm", 5, {}, "npu_add_rms_norm() takes 4 positional arguments but 5 were given"),
        ("npu_add_rms_norm", 2, {}, "npu_add_rms_norm() missing required argument 'gamma'"),
        ("npu_lightning_indexer", 4, {}, "npu_lightning_indexer() takes 3 positional arguments but 4 were given"),
        ("npu_rotary_mul", 3, {"mode": "half"}, "npu_rotary_mul() got an unexpected keyword argument 'mode'"),
    ],
)
def test_a_call_torch_npu_refuses_raises(op: str, args: int, kwargs: dict, message: str) -> None:
    doubles.EVENTS.clear()
    with pytest.raises(TypeError) as raised:
        getattr(doubles, op)(*[torch.ones(2, 4)] * args, **kwargs)
    assert str(raised.value) == message
    assert doubles.EVENTS == []  # refused before the double ran


def test_a_value_of_the_wrong_type_raises(contract: str) -> None:
    with pytest.raises(TypeError, match=r"npu_format_cast\(\): argument 'acl_format' must be int, not float"):
        doubles.npu_format_cast(torch.ones(2), 29.0)
    with pytest.raises(TypeError, match=r"npu_rms_norm\(\): argument 'epsilon' must be float, not str"):
        doubles.npu_rms_norm(torch.ones(2, 4), torch.ones(4), "1e-6")


def test_layernorm_paths_keep_the_contract(contract: str, layernorm: types.ModuleType) -> None:
    """The release's fused path, its plain path (no residual) and the fix's path."""
    layer = make_layer(layernorm, torch.bfloat16)
    x, residual = torch.randn(3, HIDDEN, dtype=torch.bfloat16), torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    layernorm.AscendRMSNorm.forward_oot(layer, x, residual)
    layer.forward_oot(x)
    upstream.run_engine(PATCH, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    out, _ = layer.forward_oot(x, residual)
    assert out.shape == x.shape
    assert doubles.names().count("torch_npu.npu_rms_norm") == 2
    assert doubles.names().count("torch_npu.npu_add_rms_norm") == 1


def test_sfa_indexer_paths_keep_the_contract(contract: str, releases: dict, npu: None) -> None:
    """0.23.0's ``AscendSFAImpl.indexer_select_post_process`` and 0.30.0rc2's indexer backend, each
    calling ``npu_rotary_mul`` and ``npu_lightning_indexer`` with every keyword vllm-ascend passes."""
    sfa, backend = build_sfa(releases["0.23.0"][0]), build_indexer(releases["0.30.0rc2"][0])
    for name, module, run in ((NAME, sfa, run_indexer), (INDEXER, backend, run_backend)):
        with doubles.modules({name: module}):
            raw, received = run(module)  # exactly one bound npu_lightning_indexer call
        assert torch.equal(received, raw)
        assert "torch_npu.npu_rotary_mul" in doubles.names()


def test_sfa_weight_loading_keeps_the_contract(contract: str, releases: dict, npu: None) -> None:
    """0.23.0's ``AscendSFAImpl.process_weights_after_loading``: its ``npu_format_cast`` calls."""
    sfa = build_sfa(releases["0.23.0"][0])
    with doubles.modules({NAME: sfa}):
        make_impl(sfa).process_weights_after_loading(torch.bfloat16)
    assert "torch_npu.npu_format_cast" in doubles.names()
