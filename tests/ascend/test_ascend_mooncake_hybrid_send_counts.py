"""``ascend.mooncake_hybrid_send_counts`` on the releases' real ``mooncake_connector.py``.

The module holds the release's own ``MooncakeConnectorWorker.start_load_kv`` and the methods that
choose a hybrid request's prefill ranks (``_get_hybrid_remote_rank_group_pulls`` and the
attention-group helpers, ``_get_remote_ranks_for_req``, ``string_to_int64_hash``), and its own
``KVCacheRecvingThread.add_request`` (``upstream.load_subset``: the file's name and line numbers).
The model is hybrid: one attention group with 2 KV heads and one Mamba group; prefill TP 8, decode
TP 4, no context parallelism.
TEST DOUBLES: the worker and the receiving thread are the release's classes made without their
``__init__`` (a vLLM config, a Mooncake engine, sockets), holding the fields those methods read;
``GroupPull`` is a namespace (the subset drops the dataclass decorator); ``_get_kv_split_metadata``
is the release's non-CP branch in short (one shard: ``remote_port`` plus each rank
``_get_hybrid_remote_rank_group_pulls`` names; its block-id work is left out),
``_get_group_pulls_metadata`` and ``_get_sfa_replicate_k_block_ids`` return empty pulls. What the
thread's queue holds is what the worker pulls and the count each prefill port receives with its
``DONE_RECVING``; with none, the prefill rank frees the request's blocks at the first message.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import random
import struct
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.ascend.test_ascend_mooncake_aborted_receive import PATH, installed
from tests.support import release_loaders, upstream
from verl_npu_autopatch.patches import ascend_mooncake_hybrid_send_counts as family

STATE = "ascend.mooncake_hybrid_send_counts"
#: Every release read with hybrid transfers (0.21.0rc1 to 0.30.0rc2).
RELEASES = (
    "0.21.0rc1",
    "0.23.0",
    "0.23.0.post1",
    "0.24.0rc1",
    "0.25.1rc1",
    "0.26.0rc1",
    "0.27.1rc1",
    "0.28.0rc1",
    "0.29.0rc1",
    "0.30.0rc2",
)
METHODS = (
    "start_load_kv",
    "_get_hybrid_remote_rank_group_pulls",
    "_get_attention_group_num_need_pulls",
    "_get_attention_group_num_need_pulls_for_decode_tp",
    "_get_attention_group_num_key_value_heads",
    "_get_attention_group_remote_rank",
    "_group_use_mla_rank_routing",
    "_is_m3_index_cache_group",
    "_get_remote_rank",
    "_get_remote_ranks_for_req",
    "_get_remote_tp_ranks",
    "_get_remote_host_info_by_port",
    "_get_tp_num_need_pulls",
)
BASE = 30000
PREFILL_TP, DECODE_TP = 8, 4
GROUPS = {
    0: ({"kv_cache_spec_type": "FullAttentionSpec", "kv_cache_spec": {"num_kv_heads": 2}}, [3, 7]),
    1: ({"kv_cache_spec_type": "MambaSpec", "kv_cache_spec": {}}, [0, 1, 2, 4, 5, 6]),
}


def load_connector(root) -> types.ModuleType:
    namespace = {
        "Any": Any,
        "BlockIds": tuple,
        "GroupPull": types.SimpleNamespace,
        "MooncakeConnectorMetadata": object,
        "ReqMeta": object,
        "RemotePortInfo": dict,
        "OrderedDict": collections.OrderedDict,
        "hashlib": hashlib,
        "logger": logging.getLogger("tests.mooncake"),
        "logging": logging,
        "np": np,
        "random": random,
        "struct": struct,
    }
    classes = {"MooncakeConnectorWorker": METHODS, "KVCacheRecvingThread": ("add_request",)}
    return upstream.load_subset(root / PATH, family.MODULE, classes, ("string_to_int64_hash",), namespace)


@release_loaders.loads(
    family,
    "vllm-ascend",
    ("0.18.0", *RELEASES),
    sites={
        label: {f"{family.MODULE}:{family.WORKER}.start_load_kv", f"{family.MODULE}:KVCacheRecvingThread.add_request"}
        for label in ("0.21.0rc1", "0.30.0rc2")
    },
    param=True,
)
@pytest.fixture
def hybrid(request, releases, npu) -> Iterator[types.ModuleType]:
    module = load_connector(releases[request.param][0])
    with installed(module):
        yield module


def worker(module: types.ModuleType, tp_rank: int) -> Any:
    """Decode rank ``tp_rank`` of a hybrid model, its receiving thread the release's class."""
    made = object.__new__(module.MooncakeConnectorWorker)
    model = types.SimpleNamespace(is_deepseek_mla=False, get_total_num_kv_heads=lambda: 2)
    made.__dict__.update(
        tp_rank=tp_rank,
        tp_size=DECODE_TP,
        _decode_tp_size=DECODE_TP,
        _prefill_tp_size=PREFILL_TP,
        _prefill_pp_size=1,
        _is_hma_required=True,
        pcp_size=1,
        dcp_size=1,
        use_mla=False,
        use_sparse=False,
        num_key_value_heads=2,
        tp_num_need_pulls=1,  # what __init__ computes for 2 KV heads, prefill TP 8, decode TP 4
        kv_group2layeridx=GROUPS,
        remote_port_send_num={},
        kv_send_thread=None,
        vllm_config=types.SimpleNamespace(model_config=model, kv_transfer_config=types.SimpleNamespace(kv_port=BASE)),
    )
    thread = object.__new__(module.KVCacheRecvingThread)
    thread.request_queue = queue.Queue()
    thread.task_tracker = types.SimpleNamespace(add_req_to_process=lambda request_id: None)
    made.kv_recv_thread = thread

    def split(req_id: str, meta: Any) -> tuple[list[list[int]], list[tuple], list[tuple]]:
        ranks, _ = made._get_hybrid_remote_rank_group_pulls(req_id, PREFILL_TP)
        return [[meta.remote_port + rank for rank in ranks]], [((), ())], [((), ())]

    made._get_kv_split_metadata = split
    made._get_group_pulls_metadata = lambda req_id, ports, *rest: [[[] for _ in shard] for shard in ports]
    made._get_sfa_replicate_k_block_ids = lambda meta: ((), ())
    return made


def metadata(remote_request_id: str) -> Any:
    meta = types.SimpleNamespace(
        remote_request_id=remote_request_id,
        remote_engine_id="prefill-0",
        remote_host="10.0.0.1",
        remote_port=BASE,
        remote_pcp_size=1,
        remote_dcp_size=1,
        remote_ptp_size=PREFILL_TP,
        remote_multi_nodes_meta_mapping={},
        remote_block_size=16,
        local_block_ids=((), ()),
        remote_block_ids=((), ()),
        num_computed_tokens=0,
        do_virtual=False,
    )
    return types.SimpleNamespace(reqs_in_batch={"r1"}, requests={"r1": meta}, requests_to_send={})


def pulled(module: types.ModuleType, remote_request_id: str) -> list[list[dict]]:
    """What each decode rank's ``start_load_kv`` queued (one entry per prefill port it pulls)."""
    queued = []
    for tp_rank in range(DECODE_TP):
        made = worker(module, tp_rank)
        made.start_load_kv(metadata(remote_request_id))
        queued.append(list(made.kv_recv_thread.request_queue.queue))
    return queued


def shared_request(module: types.ModuleType) -> str:
    """A request id whose hash makes two decode ranks pull from one prefill rank (the release's
    own rank choice; 41 of the first 64 ids do on 0.23.0)."""
    for candidate in (f"remote-{n}" for n in range(64)):
        ports = collections.Counter(e["remote_handshake_port"] for rank in pulled(module, candidate) for e in rank)
        if max(ports.values()) > 1:
            return candidate
    raise AssertionError("no request id among 64 shares a prefill rank")


@pytest.mark.parametrize("hybrid", RELEASES, indirect=True)
def test_release_sends_no_counts_for_a_prefill_rank_two_decode_ranks_pull(hybrid: types.ModuleType) -> None:
    queued = pulled(hybrid, shared_request(hybrid))
    assert all(e["remote_port_send_num"] == {} for rank in queued for e in rank), "none: freed at the first DONE"


@pytest.mark.parametrize("hybrid", RELEASES, indirect=True)
def test_with_the_patch_every_port_learns_how_many_decode_ranks_pull_from_it(hybrid: types.ModuleType) -> None:
    request_id = shared_request(hybrid)
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="pd_disaggregation")
    record = engine.report()[STATE]
    assert (record.state, record.reason) == ("applied", "fix installed")

    queued = pulled(hybrid, request_id)
    pulls = collections.Counter(e["remote_handshake_port"] for rank in queued for e in rank)
    expected = {BASE + rank: {"num": pulls[BASE + rank], "host": "10.0.0.1"} for rank in range(PREFILL_TP)}
    assert 2 in {count["num"] for count in expected.values()}
    for rank in queued:
        assert rank and all(e["remote_port_send_num"] == expected for e in rank)

    assert engine.revert() == [STATE]
    assert all(e["remote_port_send_num"] == {} for rank in pulled(hybrid, request_id) for e in rank)


@pytest.mark.parametrize("hybrid", ["0.23.0", "0.30.0rc2"], indirect=True)
def test_the_patch_leaves_non_hybrid_and_context_parallel_requests_to_the_release(hybrid: types.ModuleType) -> None:
    engine = upstream.run_engine(family.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="pd_disaggregation")
    made = worker(hybrid, 0)
    made._is_hma_required = False
    made.start_load_kv(metadata("remote-1"))
    queued = list(made.kv_recv_thread.request_queue.queue)
    assert queued and all(e["remote_port_send_num"] == {} for e in queued)

    made = worker(hybrid, 0)
    cp_counts = {BASE: {"num": 3, "host": "10.0.0.1"}}
    made.remote_port_send_num = {"prefill-0": cp_counts}
    context_parallel = metadata("remote-1")
    context_parallel.requests["r1"].remote_dcp_size = 2
    made.start_load_kv(context_parallel)
    assert all(e["remote_port_send_num"] is cp_counts for e in made.kv_recv_thread.request_queue.queue)
    engine.revert()
