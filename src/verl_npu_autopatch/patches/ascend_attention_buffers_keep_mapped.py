"""``ascend.attention_buffers_keep_mapped``: the attention buffers vllm-ascend 0.27.1rc1 makes inside
the KV-cache memory pool stay mapped across sleep, so the staged wake-up can restore them
(opt-in, group ``dsv4``).

``vllm_ascend.attention.utils:get_or_register_attention_buffer`` makes a buffer with a plain
``factory()`` and registers it on the attention modules; DeepSeek-V4's DSA metadata builders make
their Hadamard matrices (``_dsa_hadamard``, ``_dsa_cp_hadamard``) through it, from ``__init__``,
inside ``initialize_kv_cache``. On 0.27.1rc1 ``NPUWorker.initialize_from_config`` runs that whole
call under ``CaMemAllocator.use_memory_pool(tag="kv_cache")``, so the matrices are carved from
the KV-cache pool, which every sleep releases. ``NPUWorker.sleep`` saves them (by name at level 1,
with every buffer at level 2) and ``wake_up`` copies them back right after ``allocator.wake_up(tags)``:
verl's staged wake-up (``["weights"]`` first) then writes into KV-cache memory not mapped yet, and
the copy fails with ACL error 507899 (verl-ascend-recipe ``vllm-ascend_A5.patch``).

The fix wraps ``get_or_register_attention_buffer``: the CaMem allocation holding the buffer it
returns gets the release's ``CaMemAllocator.sleep_persistent_tag``, which ``sleep`` and ``wake_up``
leave alone, so the buffer keeps its memory and values and the restore copies into mapped memory.
The whole allocation is tagged, not the buffer: the caching allocator carves a small tensor from a
segment other small KV-pool tensors share (tagging the new allocation alone, as
``use_allocation_tag`` does, misses a buffer placed in a segment opened before it); an allocation
larger than :data:`LIMIT` (a KV-cache tensor's) is left alone. From 0.28.0rc1
``initialize_from_config`` enters the pool around the KV-cache tensors only
(``kv_cache_allocation_context``): the buffers live outside it, ``fixed-upstream``. The worker's and
the allocator's code is read from their installed files (the worker imports this module before it
defines ``NPUWorker``).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Reach,
    Site,
    Verdict,
    around,
    decides,
    fixed_upstream,
    module_file,
    unsupported,
    wrapping_patch,
)
from verl_npu_autopatch.patches._installed_source import installed_code

UTILS = "vllm_ascend.attention.utils"
FUNCTION = "get_or_register_attention_buffer"
PARAMS = ("vllm_config", "layer_names", "name", "factory")
WORKER = "vllm_ascend.worker.worker"
CAMEM = "vllm_ascend.device_allocator.camem"
#: The modules that copy the function by ``from ... import`` (DSA, and DSA with context parallelism).
COPIERS = ("vllm_ascend.attention.dsa_v1", "vllm_ascend.attention.context_parallel.dsa_cp")
#: What the rule looks for (whitespace-free).
PLAIN = "buffer=factory()"
WHOLE_IN_POOL = ('use_memory_pool(tag="kv_cache")', "self.model_runner.initialize_kv_cache(kv_cache_config)")
TENSORS_IN_POOL = "kv_cache_allocation_context="
PERSISTENT = "CaMemAllocator.sleep_persistent_tag"
#: The largest CaMem allocation kept mapped for a buffer: the caching allocator's 20 MiB segment
#: for requests under 10 MiB. A buffer inside a larger one (a KV-cache tensor's) is left as it is.
LIMIT = 20 << 20

_LOG = logging.getLogger(__name__)


@decides(
    f"{UTILS}:{FUNCTION}",
    PARAMS,
    reading=(f"{WORKER}:NPUWorker.initialize_from_config", f"{CAMEM}:CaMemAllocator.sleep"),
)
def buffers_rule(register: Code, initialize: Code | None, sleep: Code | None) -> Verdict:
    """``get_or_register_attention_buffer`` read with the worker's ``initialize_from_config`` and
    ``CaMemAllocator.sleep``."""
    if register.has("use_allocation_tag(") or register.has("sleep_persistent_tag"):
        return fixed_upstream(f"{FUNCTION} allocates its buffers under a sleep-persistent tag itself")
    if not register.has(PLAIN):
        return unsupported(f"{FUNCTION} making a missing buffer with factory()", "another body")
    if initialize is not None and initialize.has(TENSORS_IN_POOL):
        return fixed_upstream(
            "NPUWorker.initialize_from_config enters the kv_cache pool around the KV-cache tensors only "
            "(kv_cache_allocation_context): the attention buffers live outside it"
        )
    if initialize is None or not initialize.has(*WHOLE_IN_POOL):
        return unsupported(
            "NPUWorker.initialize_from_config running initialize_kv_cache in the kv_cache pool", "another"
        )
    if sleep is None or not sleep.has(PERSISTENT):
        return unsupported("CaMemAllocator.sleep leaving sleep_persistent_tag allocations mapped", "none")
    return APPLY


def _check(site: Site) -> Verdict:
    """The rule on the live function and the worker's and the allocator's installed files."""
    return buffers_rule(Code.live(site.value), *(installed_code(t.module, t.qualname) for t in buffers_rule.reading))


def keep_mapped(buffer: Any) -> bool:
    """Tag the CaMem allocation holding ``buffer`` sleep-persistent; whether it did."""
    allocator_class = getattr(sys.modules.get(CAMEM), "CaMemAllocator", None)
    allocator = getattr(allocator_class, "instance", None)  # None: no pool made, sleep mode is off
    tag = getattr(allocator_class, "sleep_persistent_tag", None)
    if allocator is None or tag is None or not hasattr(buffer, "data_ptr"):
        return False
    address = buffer.data_ptr()
    for start, data in allocator.pointer_to_data.items():
        size = data.handle[1]
        if start <= address < start + size:
            if data.tag == tag:
                return True
            if size > LIMIT:
                _LOG.warning(
                    "attention buffer at %#x sits in a %d-byte %s allocation: left as it is", address, size, data.tag
                )
                return False
            data.tag = tag
            return True
    return False


def register_kept_mapped(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The release's function; the allocation holding the buffer it returns then stays mapped."""
    buffer = original(*args, **kwargs)
    keep_mapped(buffer)
    return buffer


PATCHES = [
    dataclasses.replace(
        wrapping_patch(
            "ascend.attention_buffers_keep_mapped",
            "DeepSeek-V4's DSA attention buffers stay mapped across sleep, so the staged wake-up can restore them.",
            rule=buffers_rule,
            wrap=around(register_kept_mapped),
            opt_in="dsv4",
            reads=tuple(map(module_file, (UTILS, WORKER, CAMEM, *COPIERS))),
            copying_modules=COPIERS,
            reach=Reach(copies_in=("vllm_ascend.attention",)),
            reference="https://github.com/verl-project/verl-ascend-recipe",
        ),
        check=_check,
    ),
]
