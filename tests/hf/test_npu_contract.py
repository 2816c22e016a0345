"""The torch_npu test double follows the real op contract: the schemas of the real torch_npu 2.6.0.post5
and 2.14.0 wheels, and the documented device rules, each of which fails when broken. Our grouped
matmul makes its calls the way the contract and verl's hardware-run ``NPUGmmFunction`` make them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.hf import npu_contract, npu_emulation
from verl_npu_autopatch.patches.transformers_npu import kernels as npu_kernels

RELEASES = list(npu_contract.WHEELS)


@pytest.mark.parametrize("release", RELEASES)
def test_schemas_read_from_the_real_wheels(release: str) -> None:
    schemas = npu_contract.schemas(release)
    assert set(schemas) == set(npu_contract.OPS)
    gmm = {a.name: a for a in schemas["npu_grouped_matmul"].arguments}
    assert [a.name for a in schemas["npu_grouped_matmul"].arguments if not a.keyword_only] == ["x", "weight"]
    assert (gmm["group_list"].type, gmm["group_type"].default, gmm["split_item"].default) == ("Tensor?", "None", "0")
    assert schemas["npu_rms_norm"].returns == "(Tensor, Tensor)"
    assert schemas["npu_grouped_matmul"].returns == "Tensor[]"
    rotary = [a.name for a in schemas["npu_rotary_mul"].arguments]
    assert rotary == ["self", "r1", "r2", "rotary_mode", *(["rotate"] if release == npu_contract.NEWEST else [])]


def _gmm_args() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    return [torch.randn(6, 4)], [torch.randn(3, 4, 5)], torch.tensor([2, 0, 4])


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda n: n.npu_swiglu(torch.randn(2, 8), dim=-1, alpha=1.0), id="unknown-keyword"),
        pytest.param(lambda n: n.npu_grouped_matmul(*_gmm_args()), id="keyword-only-by-position"),
        pytest.param(lambda n: n.npu_rms_norm(torch.randn(2, 8)), id="missing-argument"),
        pytest.param(lambda n: n.npu_swiglu(torch.randn(2, 8), dim=True), id="bool-for-int"),
        pytest.param(lambda n: n.npu_rms_norm(torch.randn(2, 8), [1.0] * 8), id="list-for-tensor"),
        pytest.param(
            lambda n: n.npu_grouped_matmul(*_gmm_args()[:2], group_list=[2, 0, 4], split_item=2, group_type=0),
            id="list-group_list-(the List overload is not the one called)",
        ),
        pytest.param(lambda n: n.npu_rms_norm(torch.randn(2, 8), torch.randn(8), 1e-6, 1), id="too-many-positional"),
    ],
)
@pytest.mark.parametrize("release", RELEASES)
def test_calls_the_op_parser_refuses_raise_type_error(npu: Any, release: str, call: Callable[[Any], Any]) -> None:
    npu.use_release(release)
    with pytest.raises(TypeError):
        call(npu)


def _k_split(x: torch.Tensor, **change: Any) -> Any:
    counts = torch.tensor([2, 0, 4])
    kwargs = {"group_list": counts, "split_item": 3, "group_type": 2, "group_list_type": 1, **change}
    return npu_emulation.npu_grouped_matmul([x], [torch.randn(6, 5)], **kwargs)


def _gmm_call(**change: Any) -> Callable[[], Any]:
    """A valid M-split grouped matmul call with ``change`` applied (``"-"``: leave the keyword out)."""
    (x,), (w,), counts = _gmm_args()
    x_list, w_list = change.pop("x", [x]), change.pop("weight", [w])
    kwargs = {"group_list": counts, "split_item": 2, "group_type": 0, "group_list_type": 1, **change}
    return lambda: npu_emulation.npu_grouped_matmul(x_list, w_list, **{k: v for k, v in kwargs.items() if v != "-"})


def _compiling(monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    npu_emulation.use_release(npu_contract.OLDEST)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    return lambda: _k_split(torch.randn(6, 4).t())


r, n = torch.randn, npu_emulation
#: One call per rule that breaks that rule alone (``monkeypatch`` given to those that need it).
BREAKERS: dict[str, Callable[..., Any]] = {
    "float_dtype": lambda: n.npu_swiglu(r(2, 8, dtype=torch.float64), dim=-1),
    "rms_norm.gamma_dtype": lambda: n.npu_rms_norm(r(2, 8), r(8, dtype=torch.bfloat16), epsilon=1e-6),
    "rms_norm.rank": lambda: n.npu_rms_norm(r(8), r(8), epsilon=1e-6),
    "rotary.rank": lambda: n.npu_rotary_mul(r(2, 3, 8), r(1, 3, 8), r(1, 3, 8)),
    "rotary.dtype": lambda: n.npu_rotary_mul(r(1, 2, 3, 8), r(1, 1, 3, 8).bfloat16(), r(1, 1, 3, 8).bfloat16()),
    "rotary.layout": lambda: n.npu_rotary_mul(r(1, 2, 3, 8), r(1, 1, 3, 4), r(1, 1, 3, 4)),
    "rotary.mode": lambda: n.npu_rotary_mul(r(1, 2, 3, 8), r(1, 1, 3, 8), r(1, 1, 3, 8), rotary_mode="quarter"),
    "swiglu.split": lambda: n.npu_swiglu(r(2, 7), dim=-1),
    "permute.shape": lambda: n.npu_moe_token_permute(r(4, 8), torch.zeros(3, 2, dtype=torch.int32)),
    "permute.indices_dtype": lambda: n.npu_moe_token_permute(r(4, 8), torch.zeros(4, 2)),
    "permute.padded": lambda: n.npu_moe_token_permute(r(4, 8), torch.zeros(4, 2, dtype=torch.int32), padded_mode=True),
    "unpermute.shape": lambda: n.npu_moe_token_unpermute(r(8, 8), torch.arange(8, dtype=torch.int32), probs=r(4, 3)),
    "unpermute.dtype": lambda: n.npu_moe_token_unpermute(
        r(8, 8), torch.arange(8, dtype=torch.int32), probs=r(4, 2, dtype=torch.bfloat16)
    ),
    "gmm.unsupported_argument": _gmm_call(bias=[r(5)]),
    "gmm.group_list": _gmm_call(group_list=torch.tensor([2, 0, 4], dtype=torch.int32)),
    "gmm.group_list_type": _gmm_call(group_list_type=2),
    "gmm.group_type": _gmm_call(group_type="-"),  # the schema default None
    "gmm.split_item": _gmm_call(split_item=0),
    "gmm.single": _gmm_call(x=[r(6, 4), r(6, 4)]),
    "gmm.dtype": _gmm_call(weight=[r(3, 4, 5, dtype=torch.bfloat16)]),
    "gmm.m_split_layout": _gmm_call(x=[r(4, 6).t()]),
    "gmm.weight_layout": _gmm_call(weight=[r(3, 4, 10)[..., ::2]]),  # every other column: neither layout
    "gmm.k_split_layout": lambda: _k_split(r(6, 4).t().contiguous()),  # our old dW call: a copy of x^T
    "gmm.group_sizes": _gmm_call(group_list=torch.tensor([2, 0, 3])),
    "gmm.meta_group_type_2": _compiling,
}


def test_every_rule_has_a_breaking_call() -> None:
    assert set(BREAKERS) == set(npu_emulation.RULES)


def test_the_contract_page_names_the_rule_count_and_both_releases() -> None:
    page = (npu_contract.ROOT / "docs" / "device-contract.md").read_text(encoding="utf-8")
    assert f"{len(npu_emulation.RULES)} of them" in page
    assert all(f"**{release}**" in page for release in npu_contract.WHEELS)


@pytest.mark.parametrize("rule", sorted(BREAKERS))
def test_each_rule_fails_when_broken(npu: Any, monkeypatch: pytest.MonkeyPatch, rule: str) -> None:
    breaker = BREAKERS[rule]
    call = breaker(monkeypatch) if breaker is _compiling else breaker
    with pytest.raises(npu_emulation.ContractError) as raised:
        call()
    assert raised.value.rule == rule
    assert isinstance(raised.value, RuntimeError)


def test_the_valid_forms_pass(npu: Any) -> None:
    """The unbroken twins of the breakers: the rules refuse only what they name."""
    assert _gmm_call()()[0].shape == (6, 5)
    assert _gmm_call(weight=[r(3, 5, 4).transpose(1, 2)])()[0].shape == (6, 5)  # transposed weight: allowed
    gate, _up = r(3, 10, 4).chunk(2, dim=1)  # a transposed half of a fused [E, 2I, H] weight, as verl passes it
    assert _gmm_call(weight=[gate.transpose(1, 2)])()[0].shape == (6, 5)
    assert _k_split(r(6, 4).t())[0].shape == (3, 4, 5)
    out, rstd = n.npu_rms_norm(r(2, 8), r(8), epsilon=1e-6)
    assert out.shape == (2, 8) and rstd.shape == (2, 1)
    permuted, sorted_indices = n.npu_moe_token_permute(r(4, 8), torch.zeros(4, 2, dtype=torch.int64))
    assert permuted.shape == (8, 8) and sorted_indices.dtype == torch.int32


def test_a_double_returning_the_wrong_arity_is_caught() -> None:
    schema = npu_contract.schemas(npu_contract.NEWEST)["npu_rms_norm"]
    with pytest.raises(AssertionError):
        schema.check_result(torch.zeros(1))  # one tensor where the op returns two
    assert schema.check_result((torch.zeros(1), torch.zeros(1)))


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_forward_and_backward_keep_the_contract(npu: Any, release: str, dtype: torch.dtype) -> None:
    npu.use_release(release)
    counts = torch.tensor([3, 0, 4, 2])
    x = torch.randn(9, 6, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 6, 5, dtype=dtype, requires_grad=True)
    npu_kernels.grouped_matmul(x, w, counts).float().sin().sum().backward()
    calls = [(op, dict(args)) for op, args in npu.trace]
    assert [args["group_type"] for _, args in calls] == [0, 0, 2]
    _, dx, dw = (args for _, args in calls)
    # dx: the weight's transposed view (no copy); dW: x^T as a transposed view of x, as verl passes them.
    weight_view = dx["weight"][0]
    assert weight_view[1:] == ((4, 5, 6), str(dtype).removeprefix("torch."), (30, 1, 5))
    assert dw["x"][0][1:] == ((6, 9), str(dtype).removeprefix("torch."), (1, 6))
    assert w.grad is not None and torch.count_nonzero(w.grad[1]) == 0  # the empty expert


def test_k_split_under_compile_refused_by_torch_npu_2_6_only(npu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_npu 2.6.0.post5's meta function refuses group_type=2: the MoE backward does not compile
    there (eager runs). 2.14.0's accepts it. Recorded in docs/patches.md."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(3, 4, 5, requires_grad=True)
    counts = torch.tensor([2, 0, 4])
    npu.use_release(npu_contract.NEWEST)
    npu_kernels.grouped_matmul(x, w, counts).sum().backward()
    npu.use_release(npu_contract.OLDEST)
    with pytest.raises(npu_emulation.ContractError, match="meta_group_type_2"):
        npu_kernels.grouped_matmul(x, w, counts).sum().backward()
