"""``ascend.mooncake_aborted_receive`` on the releases' real ``mooncake_connector.py``.

The module holds the release's own ``MooncakeConnectorScheduler.request_finished``
(``upstream.load_subset``: the file's name and line numbers) with vLLM's real ``RequestStatus``.
TEST DOUBLES: the scheduler is the release's class made without its ``__init__`` (which needs a
vLLM config and a Mooncake engine), holding the two fields the method reads (``_reqs_need_recv``,
``kv_cache_groups``: two groups); a request is a namespace with the fields vLLM's ``Request`` gives
the method. What ``_reqs_need_recv`` holds is what the next ``build_connector_meta`` hands the
worker: no entry means no receive and no ``DONE_RECVING`` to the prefill node; an entry with
block ids means the worker pulls the remote KV into those blocks.
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from tests.ascend import doubles
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_mooncake_aborted_receive as family

NAME = family.MODULE
STATE = "ascend.mooncake_aborted_receive"
PATH = "vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_connector.py"
#: Releases that queue nothing for a request aborted before allocation; then those that do.
NO_EMPTY_RECEIVE = ("0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1")
EMPTY_RECEIVE = ("0.26.0rc1", "0.27.1rc1", "0.30.0rc2")
ALL = NO_EMPTY_RECEIVE + EMPTY_RECEIVE
#: Every release with the connector: before 0.23.0 too.
RELEASES = ("0.18.0", "0.21.0rc1", *ALL)
PARENTS = (
    "vllm_ascend.distributed",
    "vllm_ascend.distributed.kv_transfer",
    "vllm_ascend.distributed.kv_transfer.kv_p2p",
)
EMPTY = ([], [])


def load_connector(root) -> types.ModuleType:
    namespace = {
        "Any": Any,
        "BlockIds": tuple,
        "RequestStatus": RequestStatus,
        "logger": logging.getLogger("tests.mooncake"),
        "math": math,
    }
    return upstream.load_subset(root / PATH, NAME, {"MooncakeConnectorScheduler": ("request_finished",)}, (), namespace)


def installed(module: types.ModuleType) -> ContextManager[None]:
    """``module`` in ``sys.modules`` as the connector, its parent packages TEST DOUBLES."""
    stubs: dict[str, types.ModuleType] = {}
    for name in PARENTS:
        stubs[name] = doubles.stub_module(name, "TEST DOUBLE: a package holding the connector only")
        stubs[name].__path__ = []  # type: ignore[attr-defined]
    return doubles.modules({**stubs, NAME: module})


@release_loaders.loads(
    family,
    "vllm-ascend",
    RELEASES,
    sites={label: {f"{NAME}:MooncakeConnectorScheduler.request_finished"} for label in ("0.23.0", "0.30.0rc2")},
    param=True,
)
@pytest.fixture
def connector(request, releases, npu) -> Iterator[types.ModuleType]:
    module = load_connector(releases[request.param][0])
    with installed(module):
        yield module


def scheduler(module: types.ModuleType) -> Any:
    made = object.__new__(module.MooncakeConnectorScheduler)
    made._reqs_need_recv = {}
    made.kv_cache_groups = ["attention", "mamba"]
    return made


def remote_prefill(flag: bool) -> Any:
    """An aborted decode-side request that pulls its prompt's KV from a prefill node."""
    params = {
        "do_remote_prefill": flag,
        "do_remote_decode": False,
        "remote_block_ids": ([1, 2, 3], [4]),
        "remote_engine_id": "prefill-0",
        "remote_request_id": "remote-r1",
        "remote_host": "10.0.0.1",
        "remote_port": 5000,
    }
    return types.SimpleNamespace(
        request_id="r1", kv_transfer_params=params, status=RequestStatus.FINISHED_ABORTED, prompt_token_ids=[7] * 40
    )


def aborted_before_alloc(module: types.ModuleType) -> tuple[Any, Any, tuple]:
    """``(scheduler, request, request_finished's answer)``: aborted while still waiting."""
    made, request = scheduler(module), remote_prefill(True)
    answer = made.request_finished(request, ([], []))
    return made, request, answer


def aborted_after_alloc(module: types.ModuleType) -> tuple[Any, Any, tuple]:
    """Aborted after ``update_state_after_alloc`` queued the receive into blocks 5, 6 and 9 (and
    cleared the flag), before the next ``build_connector_meta``."""
    made, request = scheduler(module), remote_prefill(False)
    made._reqs_need_recv["r1"] = (request, ([5, 6], [9]), ([5, 6], [9]), 48)
    answer = made.request_finished(request, ([5, 6], [9]))
    return made, request, answer


@pytest.mark.parametrize("connector", NO_EMPTY_RECEIVE, indirect=True)
def test_release_sends_no_done_recving_for_a_request_aborted_while_waiting(connector: types.ModuleType) -> None:
    made, _, answer = aborted_before_alloc(connector)
    assert answer == (False, None)
    assert made._reqs_need_recv == {}, "nothing queued: the prefill node keeps the blocks until its timeout"


@pytest.mark.parametrize("connector", EMPTY_RECEIVE, indirect=True)
def test_release_queues_an_empty_receive_for_a_request_aborted_while_waiting(connector: types.ModuleType) -> None:
    made, request, _ = aborted_before_alloc(connector)
    assert made._reqs_need_recv == {"r1": (request, EMPTY, EMPTY, 0)}


@pytest.mark.parametrize("connector", ALL, indirect=True)
def test_release_keeps_the_freed_blocks_of_a_request_aborted_after_allocation(connector: types.ModuleType) -> None:
    made, request, answer = aborted_after_alloc(connector)
    assert answer == (False, None), "the blocks are freed now"
    assert made._reqs_need_recv["r1"] == (request, ([5, 6], [9]), ([5, 6], [9]), 48), "and still pulled into"


@pytest.mark.parametrize("connector", ALL, indirect=True)
def test_with_the_patch_every_aborted_receive_is_empty_and_still_signalled(connector: types.ModuleType) -> None:
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="pd_disaggregation")
    record = engine.report()[STATE]
    assert (record.state, record.reason) == ("applied", "fix installed")

    for case in (aborted_before_alloc, aborted_after_alloc):
        made, request, answer = case(connector)
        assert answer == (False, None), case.__name__
        assert made._reqs_need_recv == {"r1": (request, EMPTY, EMPTY, 0)}, case.__name__
        assert request.kv_transfer_params["do_remote_prefill"] is False

    assert engine.revert() == [STATE]
    made, request, _ = aborted_after_alloc(connector)
    assert made._reqs_need_recv["r1"][1] == ([5, 6], [9])


@pytest.mark.parametrize("connector", ["0.23.0", "0.30.0rc2"], indirect=True)
def test_the_patch_leaves_other_requests_to_the_release(connector: types.ModuleType) -> None:
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="pd_disaggregation")
    made = scheduler(connector)
    plain = types.SimpleNamespace(request_id="r2", kv_transfer_params=None, status=RequestStatus.FINISHED_ABORTED)
    decode = remote_prefill(False)
    decode.kv_transfer_params.update(do_remote_prefill=False, do_remote_decode=True)
    assert made.request_finished(plain, ([], [])) == (False, None)
    assert made.request_finished(decode, ([], [])) == (False, None), "not length-capped: freed now"
    assert made._reqs_need_recv == {}
    engine.revert()


@pytest.mark.parametrize("connector", ["0.23.0"], indirect=True)
def test_off_unless_the_group_is_enabled(connector: types.ModuleType) -> None:
    assert upstream.run_engine(family.PATCHES).report()[STATE].state == "disabled"
