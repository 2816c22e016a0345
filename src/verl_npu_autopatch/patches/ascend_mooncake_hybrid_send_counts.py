"""``ascend.mooncake_hybrid_send_counts``: vllm-ascend's Mooncake connector (decode side of
prefill/decode disaggregation) tells each prefill rank how many decode ranks pull a hybrid
model's request from it, so the first ``DONE_RECVING`` does not free blocks another rank still reads.

A decode rank pulls its share of a request's KV from some prefill ranks and sends each of them a
``DONE_RECVING``; a prefill rank frees the request's blocks when its count of those messages
reaches the number the message carries for its port (``remote_port_send_num``), or at the first
message when it carries none. ``MooncakeConnectorWorker.start_load_kv`` passes counts only under
context parallelism. For a hybrid model (``_is_hma_required``: Mamba/GDN state beside attention)
the decode ranks' pulls overlap when the prefill TP is larger: each decode rank takes its block of
prefill ranks' Mamba state and, per attention group, the replicas its request hash picks, which may
lie in another decode rank's block. A prefill rank pulled by two decode ranks then frees the blocks
at the first rank's message while the second still reads them: the second rank's KV (or state) is
whatever the blocks hold by then, silently. No release read (0.21.0rc1 to 0.30.0rc2) counts; the
recipe's ``pd_disaggregation/patch/vllm-ascend.patch`` does.

The fix wraps ``start_load_kv``: for each hybrid request pulled without context parallelism on
either side, it counts, for every prefill rank, the decode ranks (0 to ``tp_size - 1``) whose
pulls include it, by the release's own ``_get_hybrid_remote_rank_group_pulls`` run as that rank
(a shallow copy of the worker holding its ``tp_rank``), and the wrapped
``KVCacheRecvingThread.add_request`` (the secondary site) hands those counts on where the release
passed none. A prefill rank no decode rank pulls gets 0 and is freed by the release's
``_send_done_signal_to_free_remote_port``. Opt-in (group ``pd_disaggregation``). Decided from the
code: a ``start_load_kv`` that tests ``_is_hma_required`` itself is fixed upstream.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    RECIPE,
    Code,
    Reach,
    Site,
    Undo,
    Verdict,
    chain,
    decides,
    fixed_upstream,
    replace_method,
    rule_patch,
    unsupported,
)

MODULE = "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector"
WORKER = "MooncakeConnectorWorker"
PULLS = f"{WORKER}._get_hybrid_remote_rank_group_pulls"
ADD = "KVCacheRecvingThread.add_request"
#: What every release's ``start_load_kv`` does (whitespace-free): counts from the CP table, else none, by keyword.
CP_COUNTS = (
    "self.remote_port_send_num[meta.remote_engine_id]if",
    "elseNone",
    "remote_port_send_num=remote_port_send_num",
)
#: A ``start_load_kv`` that decides hybrid counts itself (the recipe's shape).
HYBRID = "self._is_hma_required"

#: Per request being loaded (remote request id → counts), set by ``start_load_kv`` for its calls only.
_COUNTS: ContextVar[dict[str, dict[int, dict[str, Any]]] | None] = ContextVar("hybrid_send_counts", default=None)


@decides(f"{MODULE}:{WORKER}.start_load_kv", ("self", "metadata"), reading=(f"{MODULE}:{PULLS}", f"{MODULE}:{ADD}"))
def send_counts_rule(load: Code, pulls: Code | None, add: Code | None) -> Verdict:
    """``start_load_kv`` read with the worker's hybrid pulls and the receiver's ``add_request``."""
    if pulls is None:
        return unsupported(f"{PULLS} (hybrid KV transfers)", "a connector without hybrid transfers")
    if load.has(HYBRID):
        return fixed_upstream("start_load_kv gives hybrid transfers their send counts itself")
    if not load.has(*CP_COUNTS):
        return unsupported(
            "start_load_kv passing send counts under context parallelism only, by keyword", "another body"
        )
    if add is None or not {"remote_request_id", "remote_port_send_num"} <= set(add.params or ()):
        return unsupported(f"{ADD} taking remote_request_id and remote_port_send_num", "another signature")
    return APPLY


def counted(worker: Any, meta: Any) -> bool:
    """Whether the release pulls ``meta`` as a hybrid request without context parallelism (and so
    passes no counts): ports ``remote_port + rank`` for the ranks the pulls name."""
    sizes = (meta.remote_pcp_size, meta.remote_dcp_size, getattr(worker, "pcp_size", 1), getattr(worker, "dcp_size", 1))
    return (
        bool(getattr(worker, "_is_hma_required", False))
        and sizes == (1, 1, 1, 1)
        and not getattr(meta, "do_virtual", False)
    )


def send_counts(worker: Any, meta: Any) -> dict[int, dict[str, Any]]:
    """Prefill port → ``{"num": decode ranks pulling from it, "host": its host}`` for ``meta``."""
    prefill_tp = meta.remote_ptp_size if getattr(meta, "remote_ptp_size", None) is not None else worker._prefill_tp_size
    counts: dict[int, dict[str, Any]] = {}
    for rank in range(prefill_tp * worker._prefill_pp_size):
        port = meta.remote_port + rank
        host, _ = worker._get_remote_host_info_by_port(
            meta.remote_port, port, meta.remote_host, meta.remote_engine_id, meta.remote_multi_nodes_meta_mapping
        )
        counts[port] = {"num": 0, "host": host}
    for decode_rank in range(worker.tp_size):
        peer = copy.copy(worker)  # the release's own choice of ranks, as decode rank ``decode_rank``
        peer.tp_rank = decode_rank
        ranks, _ = peer._get_hybrid_remote_rank_group_pulls(meta.remote_request_id, prefill_tp)
        for rank in ranks:
            counts[meta.remote_port + rank]["num"] += 1
    return counts


def _load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def start_load_kv(self: Any, metadata: Any) -> Any:
        counts = {m.remote_request_id: send_counts(self, m) for m in metadata.requests.values() if counted(self, m)}
        if not counts:
            return original(self, metadata)
        token = _COUNTS.set(counts)
        try:
            return original(self, metadata)
        finally:
            _COUNTS.reset(token)

    return start_load_kv


def _add(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("remote_port_send_num") is None:
            found = (_COUNTS.get() or {}).get(kwargs.get("remote_request_id", ""))
            if found is not None:
                kwargs["remote_port_send_num"] = found
        return original(self, *args, **kwargs)

    return add_request


def _fix(site: Site) -> Undo:
    name = site.patch.name
    return chain(
        replace_method(site.owner, site.attribute, _load, name),
        replace_method(site.module.KVCacheRecvingThread, "add_request", _add, name),
    )


PATCHES = [
    rule_patch(
        "ascend.mooncake_hybrid_send_counts",
        "vllm-ascend's Mooncake connector tells each prefill rank how many decode ranks pull a hybrid "
        "model's request from it, so one DONE_RECVING does not free blocks another rank still reads.",
        rule=send_counts_rule,
        fix=_fix,
        opt_in="pd_disaggregation",
        reach=Reach(secondary=send_counts_rule.reading[1:]),
        reference=RECIPE,
    ),
]
