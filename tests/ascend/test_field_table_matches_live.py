"""docs/compatibility.md is the live truth for the field's vllm-ascend patches: on every release of
the decision table, the live decision on the release's own file (the contract's first decision,
through the engine's pipeline) equals the static rule's cell on the same release's files."""

from __future__ import annotations

import types
from typing import Any

import pytest

from tests.ascend.test_ascend_310p_sampler_record_stream import RELEASES as SAMPLER_310P
from tests.ascend.test_ascend_310p_sampler_record_stream import sampler_310p  # noqa: F401  (fixture)
from tests.ascend.test_ascend_attention_buffers_keep_mapped import RELEASES as BUFFERS
from tests.ascend.test_ascend_attention_buffers_keep_mapped import camem_buffers  # noqa: F401  (fixture)
from tests.ascend.test_ascend_dsv4_dummy_tid2eid import RELEASES as DUMMY_TID2EID
from tests.ascend.test_ascend_dsv4_dummy_tid2eid import dsv4_moe  # noqa: F401  (fixture)
from tests.ascend.test_ascend_dsv4_dummy_wo_a import RELEASES as DUMMY_WO_A
from tests.ascend.test_ascend_dsv4_dummy_wo_a import loading  # noqa: F401  (fixture)
from tests.ascend.test_ascend_dsv4_rope_plain_swa import RELEASES as ROPE
from tests.ascend.test_ascend_dsv4_rope_plain_swa import rope  # noqa: F401  (fixture)
from tests.ascend.test_ascend_gate_fp32_in_place import linear  # noqa: F401  (fixture)
from tests.ascend.test_ascend_mooncake_aborted_receive import ALL as ALL_MOONCAKE
from tests.ascend.test_ascend_mooncake_aborted_receive import connector  # noqa: F401  (fixture)
from tests.ascend.test_ascend_mooncake_hybrid_send_counts import RELEASES as HYBRID
from tests.ascend.test_ascend_mooncake_hybrid_send_counts import hybrid  # noqa: F401  (fixture)
from tests.ascend.test_ascend_mooncake_sleep_reregister import RELEASES as SLEEPING
from tests.ascend.test_ascend_mooncake_sleep_reregister import sleeping  # noqa: F401  (fixture)
from tests.ascend.test_ascend_mooncake_truncate_rehash import RELEASES as TRUNCATING
from tests.ascend.test_ascend_mooncake_truncate_rehash import truncating  # noqa: F401  (fixture)
from tests.ascend.test_ascend_mxfp8_reload_in_place import RELEASES as MXFP8
from tests.ascend.test_ascend_mxfp8_reload_in_place import mxfp8  # noqa: F401  (fixture)
from tests.ascend.test_ascend_sampler_record_stream import sampler  # noqa: F401  (fixture)
from tests.ascend.test_ascend_wake_expert_layout import RELEASES as WAKING
from tests.ascend.test_ascend_wake_expert_layout import waking  # noqa: F401  (fixture)
from tests.support import contract, upstream
from verl_npu_autopatch.authoring.fingerprints import UpstreamTree
from verl_npu_autopatch.authoring.spec import Patch
from verl_npu_autopatch.patches import (
    ascend_310p_sampler_record_stream,
    ascend_attention_buffers_keep_mapped,
    ascend_dsv4_dummy_tid2eid,
    ascend_dsv4_dummy_wo_a,
    ascend_dsv4_rope_plain_swa,
    ascend_gate_fp32_in_place,
    ascend_mooncake_aborted_receive,
    ascend_mooncake_hybrid_send_counts,
    ascend_mooncake_sleep_reregister,
    ascend_mooncake_truncate_rehash,
    ascend_mxfp8_reload_in_place,
    ascend_sampler_record_stream,
    ascend_wake_expert_layout,
)

STATES = {"apply": "applied", "fixed-upstream": "fixed-upstream", "unsupported": "unsupported"}
#: The releases whose files hold each target (older ones: ``unsupported`` in the table, no file to load).
SAMPLER = ("0.21.0rc1", "0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1", "0.26.0rc1", "0.27.1rc1", "0.30.0rc2")
MOONCAKE = ("0.18.0", "0.21.0rc1", *ALL_MOONCAKE)
GATE = ("0.23.0", "0.24.0rc1", "0.25.1rc1", "0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc2")


def cell(patch: Patch, label: str, releases: dict) -> str:
    """The patch's state in the decision table's column ``label``."""
    script = upstream.matrix_script()
    (release,) = [r for r in script.RELEASES if r.label == label]
    tree = UpstreamTree(releases[label], {"vllm-ascend": release.ascend.version, "vllm": release.vllm.version})
    assert patch.static is not None
    return STATES[patch.static.decide(tree).action]


def live(patch: Patch) -> str:
    (found,) = contract.live_patches([patch])
    return contract.check_contract(found).state


@pytest.mark.parametrize("sampler", SAMPLER, indirect=True)
def test_sampler_record_stream(sampler: types.ModuleType, releases: dict, request: pytest.FixtureRequest) -> None:  # noqa: F811
    (patch,) = ascend_sampler_record_stream.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["sampler"], releases)


@pytest.mark.parametrize("sampler_310p", SAMPLER_310P, indirect=True)
def test_310p_sampler_record_stream(sampler_310p: types.ModuleType, releases: dict, request: Any) -> None:  # noqa: F811
    (patch,) = ascend_310p_sampler_record_stream.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["sampler_310p"], releases)


@pytest.mark.parametrize("linear", GATE, indirect=True)
def test_gate_fp32_in_place(linear: types.ModuleType, releases: dict, request: pytest.FixtureRequest) -> None:  # noqa: F811
    (patch,) = ascend_gate_fp32_in_place.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["linear"], releases)


@pytest.mark.parametrize("rope", ROPE, indirect=True)
def test_dsv4_rope_plain_swa(rope: types.ModuleType, releases: dict, request: pytest.FixtureRequest) -> None:  # noqa: F811
    (patch,) = ascend_dsv4_rope_plain_swa.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["rope"], releases)


@pytest.mark.parametrize("connector", MOONCAKE, indirect=True)
def test_mooncake_aborted_receive(connector: types.ModuleType, releases: dict, request: pytest.FixtureRequest) -> None:  # noqa: F811
    (patch,) = ascend_mooncake_aborted_receive.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["connector"], releases)


@pytest.mark.parametrize("truncating", TRUNCATING, indirect=True)
def test_mooncake_truncate_rehash(truncating: types.ModuleType, releases: dict, request: pytest.FixtureRequest) -> None:  # noqa: F811
    (patch,) = ascend_mooncake_truncate_rehash.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["truncating"], releases)


@pytest.mark.parametrize("hybrid", ("0.18.0", *HYBRID), indirect=True)
def test_mooncake_hybrid_send_counts(hybrid: types.ModuleType, releases: dict, request: pytest.FixtureRequest) -> None:  # noqa: F811
    (patch,) = ascend_mooncake_hybrid_send_counts.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["hybrid"], releases)


@pytest.mark.parametrize("sleeping", SLEEPING, indirect=True)
def test_mooncake_sleep_reregister(
    sleeping: types.SimpleNamespace,  # noqa: F811  (the fixture)
    releases: dict,
    request: pytest.FixtureRequest,
) -> None:
    (patch,) = ascend_mooncake_sleep_reregister.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["sleeping"], releases)


@pytest.mark.parametrize("waking", WAKING, indirect=True)
def test_wake_expert_layout(waking: types.SimpleNamespace, releases: dict, request: pytest.FixtureRequest) -> None:  # noqa: F811
    (patch,) = ascend_wake_expert_layout.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["waking"], releases)


@pytest.mark.parametrize("mxfp8", MXFP8, indirect=True)
def test_mxfp8_reload_in_place(mxfp8: types.SimpleNamespace, releases: dict, request: pytest.FixtureRequest) -> None:  # noqa: F811
    (patch,) = ascend_mxfp8_reload_in_place.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["mxfp8"], releases)


@pytest.mark.parametrize("camem_buffers", BUFFERS, indirect=True)
def test_attention_buffers_keep_mapped(camem_buffers: types.SimpleNamespace, releases: dict, request: Any) -> None:  # noqa: F811
    (patch,) = ascend_attention_buffers_keep_mapped.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["camem_buffers"], releases)


@pytest.mark.parametrize("loading", DUMMY_WO_A, indirect=True)
def test_dsv4_dummy_wo_a(loading: types.SimpleNamespace, releases: dict, request: pytest.FixtureRequest) -> None:  # noqa: F811
    (patch,) = ascend_dsv4_dummy_wo_a.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["loading"], releases)


@pytest.mark.parametrize("dsv4_moe", list(DUMMY_TID2EID), indirect=True)
def test_dsv4_dummy_tid2eid(dsv4_moe: types.ModuleType, releases: dict, request: pytest.FixtureRequest) -> None:  # noqa: F811
    (patch,) = ascend_dsv4_dummy_tid2eid.PATCHES
    assert live(patch) == cell(patch, request.node.callspec.params["dsv4_moe"], releases)
