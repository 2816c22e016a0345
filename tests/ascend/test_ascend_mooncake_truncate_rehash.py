"""``ascend.mooncake_truncate_rehash`` on the releases' real ``mooncake_connector.py``, with vLLM's
real ``Request`` and its real block hasher (block size 4, sha256).

The module holds the release's own ``MooncakeConnectorScheduler._truncate_request_for_prefill``
(``upstream.load_subset``: the file's name and line numbers). TEST DOUBLE: the scheduler is the
release's class made without its ``__init__`` (it needs a vLLM config and a Mooncake engine); the
method reads nothing of it. The prompt fills two blocks exactly, so the truncation empties the
second block's last slot: its hash must go.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from tests.ascend.test_ascend_mooncake_aborted_receive import PATH, installed
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_mooncake_truncate_rehash as family

NAME = family.MODULE
STATE = "ascend.mooncake_truncate_rehash"
#: Every release read that has the method (0.23.0 to 0.30.0rc2).
RELEASES = ("0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1", "0.26.0rc1", "0.27.1rc1", "0.30.0rc2")
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def load_connector(root) -> types.ModuleType:
    classes = {"MooncakeConnectorScheduler": ("_truncate_request_for_prefill",)}
    return upstream.load_subset(root / PATH, NAME, classes, (), {"Any": Any})


@release_loaders.loads(
    family,
    "vllm-ascend",
    RELEASES,
    sites={
        label: {f"{NAME}:MooncakeConnectorScheduler._truncate_request_for_prefill"} for label in ("0.23.0", "0.30.0rc2")
    },
    param=True,
)
@pytest.fixture
def truncating(request, releases, npu) -> Iterator[types.ModuleType]:
    module = load_connector(releases[request.param][0])
    with installed(module):
        yield module


def prefill_request(tokens: list[int]) -> Request:
    """A prefill-side request of vLLM's, its block hashes computed as vLLM computes them."""
    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(4, sha256)
    made = Request("r1", list(tokens), SamplingParams(max_tokens=32), None, block_hasher=hasher)
    made.kv_transfer_params = {"do_remote_decode": True}
    return made


def truncated(module: types.ModuleType) -> Request:
    """The request after the release's truncation (called twice, as a reschedule does)."""
    scheduler = object.__new__(module.MooncakeConnectorScheduler)
    made = prefill_request(PROMPT)
    scheduler._truncate_request_for_prefill(made)
    scheduler._truncate_request_for_prefill(made)
    return made


def hashes(tokens: list[int]) -> list:
    return list(prefill_request(tokens).block_hashes)


@pytest.mark.parametrize("truncating", RELEASES, indirect=True)
def test_release_keeps_the_hash_of_the_block_it_shortened(truncating: types.ModuleType) -> None:
    made = truncated(truncating)
    assert (made.prompt_token_ids, made.num_prompt_tokens, made.max_tokens) == (PROMPT[:-1], 7, 1)
    assert list(made.block_hashes) == hashes(PROMPT), "two full-block hashes for 7 tokens"


@pytest.mark.parametrize("truncating", RELEASES, indirect=True)
def test_with_the_patch_the_hashes_are_those_of_the_shortened_prompt(truncating: types.ModuleType) -> None:
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="pd_disaggregation")
    record = engine.report()[STATE]
    assert (record.state, record.reason) == ("applied", "fix installed")

    made = truncated(truncating)
    assert made.prompt_token_ids == PROMPT[:-1]
    assert list(made.block_hashes) == hashes(PROMPT[:-1]) == hashes(PROMPT)[:1]

    untouched = prefill_request(PROMPT[:1])  # one token: nothing to truncate, nothing to rehash
    object.__new__(truncating.MooncakeConnectorScheduler)._truncate_request_for_prefill(untouched)
    assert untouched.prompt_token_ids == PROMPT[:1] and "_p_side_truncated" not in untouched.kv_transfer_params

    assert engine.revert() == [STATE]
    assert list(truncated(truncating).block_hashes) == hashes(PROMPT)


@pytest.mark.parametrize("truncating", ["0.23.0"], indirect=True)
def test_off_unless_the_group_is_enabled(truncating: types.ModuleType) -> None:
    assert upstream.run_engine(family.PATCHES).report()[STATE].state == "disabled"
