"""``ascend.mooncake_sleep_reregister``: vllm-ascend's NPU worker takes the KV cache it registered
with Mooncake out of the transfer engine before sleep mode frees it, and registers it again once
the KV cache is awake.

A prefill/decode connector registers the KV cache's device memory with Mooncake's transfer engine
once (``GlobalTE.register_buffer``: the process's one ``global_te``; a second call returns at once,
``is_register_buffer`` being set). Sleep mode (``NPUWorker.sleep``, any level) then has
``CaMemAllocator`` unmap and release the KV cache's physical memory, and ``wake_up`` maps new
memory at the same addresses. The releases tell Mooncake nothing: the registration still names
the memory released at sleep, and the KV cache woken up is never registered, so the transfers of
the next rollout's remote prefill go through a registration of memory the KV cache no longer
holds. The recipe's ``pd_disaggregation/patch/vllm-ascend.patch`` keeps the registered buffers in
``GlobalTE`` and unregisters / re-registers them from the worker.

The fix wraps three methods: ``GlobalTE.register_buffer`` (a secondary site, in
``mooncake_transfer_engine``) records the buffers it registered; ``NPUWorker.sleep`` unregisters
them (Mooncake's ``TransferEngine.unregister_memory``) before the release's sleep, and
``NPUWorker.wake_up`` (the other secondary site) registers them again after the release's wake-up
when the KV cache woke (``tags`` None or naming ``kv_cache``). Either switch is all or none: a
call Mooncake refuses puts back the buffers already switched and raises ``RuntimeError``, as the
release's own registration does. A process whose connector registered nothing is left alone.
Opt-in (group ``pd_disaggregation``). Decided from the code: a ``sleep`` that unregisters anything
itself is fixed upstream.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

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

WORKER = "vllm_ascend.worker.worker"
ENGINE = "vllm_ascend.distributed.kv_transfer.utils.mooncake_transfer_engine"
REGISTER = "GlobalTE.register_buffer"
#: What every release's methods do (whitespace-free).
SLEEPS = "allocator.sleep("
WAKES = "allocator.wake_up(tags=tags)"
REGISTERS = ("self.transfer_engine.register_memory(ptr,size)", "self.is_register_buffer=True")

#: ``GlobalTE`` instance → the ``(ptr, size)`` buffers its ``register_buffer`` registered.
_BUFFERS: WeakKeyDictionary[Any, list[tuple[int, int]]] = WeakKeyDictionary()


@decides(
    f"{WORKER}:NPUWorker.sleep", ("self", "level"), reading=(f"{WORKER}:NPUWorker.wake_up", f"{ENGINE}:{REGISTER}")
)
def reregister_rule(sleep: Code, wake_up: Code | None, register: Code | None) -> Verdict:
    """``NPUWorker.sleep`` read with ``NPUWorker.wake_up`` and ``GlobalTE.register_buffer``."""
    if sleep.has("unregister"):
        return fixed_upstream("NPUWorker.sleep unregisters the Mooncake buffers itself")
    if not sleep.has(SLEEPS):
        return unsupported("NPUWorker.sleep putting CaMemAllocator to sleep", "another body")
    if wake_up is None or wake_up.params != ("self", "tags") or not wake_up.has(WAKES):
        return unsupported("NPUWorker.wake_up(self, tags) waking CaMemAllocator with its tags", "another wake_up")
    if register is None:
        return unsupported(f"{ENGINE}:{REGISTER}", "none there")
    if register.params != ("self", "ptrs", "sizes") or not register.has(*REGISTERS):
        return unsupported(f"{REGISTER}(self, ptrs, sizes) registering each buffer once", "another register_buffer")
    return APPLY


def switch(engine: Any, register: bool) -> None:
    """Register again (``register``) or unregister every buffer recorded for ``engine`` (a
    ``GlobalTE``), all or none; nothing when none are recorded or they already are so."""
    buffers = _BUFFERS.get(engine)
    if not buffers:
        return
    with engine.register_buffer_lock:
        if engine.is_register_buffer == register:
            return
        mooncake = engine.transfer_engine
        done: list[tuple[int, int]] = []
        for ptr, size in buffers:
            ret = mooncake.register_memory(ptr, size) if register else mooncake.unregister_memory(ptr)
            if ret != 0:
                for back, back_size in reversed(done):  # all or none: back to the state before
                    if register:
                        mooncake.unregister_memory(back)
                    else:
                        mooncake.register_memory(back, back_size)
                verb = "registration" if register else "unregistration"
                raise RuntimeError(f"Mooncake memory {verb} failed for ptr={ptr:#x}, ret_value={ret}")
            done.append((ptr, size))
        engine.is_register_buffer = register


def _global_te() -> Any:
    """The process's ``global_te``, when a connector imported the transfer-engine module."""
    return getattr(sys.modules.get(ENGINE), "global_te", None)


def _register(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def register_buffer(self: Any, ptrs: Any, sizes: Any) -> Any:
        ptrs, sizes = list(ptrs), list(sizes)
        fresh = not self.is_register_buffer
        result = original(self, ptrs, sizes)
        if fresh and self.is_register_buffer:
            _BUFFERS[self] = list(zip(ptrs, sizes, strict=False))
        return result

    return register_buffer


def _sleep(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def sleep(self: Any, level: int = 1) -> Any:
        engine = _global_te()
        if engine is not None:
            switch(engine, register=False)
        return original(self, level)

    return sleep


def _wake_up(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wake_up(self: Any, tags: list[str] | None = None) -> Any:
        result = original(self, tags)
        engine = _global_te()
        if engine is not None and (tags is None or "kv_cache" in tags):
            switch(engine, register=True)
        return result

    return wake_up


def _fix(site: Site) -> Undo:
    name = site.patch.name
    return chain(
        replace_method(importlib.import_module(ENGINE).GlobalTE, "register_buffer", _register, name),
        replace_method(site.owner, site.attribute, _sleep, name),
        replace_method(site.owner, "wake_up", _wake_up, name),
    )


PATCHES = [
    rule_patch(
        "ascend.mooncake_sleep_reregister",
        "vllm-ascend's NPU worker unregisters the KV cache it registered with Mooncake before sleep "
        "and registers it again once the KV cache is awake.",
        rule=reregister_rule,
        fix=_fix,
        opt_in="pd_disaggregation",
        reach=Reach(secondary=reregister_rule.reading),
        reference=RECIPE,
    ),
]
