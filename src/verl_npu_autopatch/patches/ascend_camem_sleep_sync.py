"""``ascend.camem_sleep_sync``: ``CaMemAllocator.sleep`` synchronizes the NPU before it releases
memory (opt-in, group ``glm52``).

Graph replays and kernel launches are asynchronous: work still queued on the device may touch
the virtual mappings that ``sleep`` unmaps. vllm-ascend's own ``torch.npu.empty_cache()`` comes
after the unmap loop, too late. 0.30.0rc2 added the same synchronization upstream.

verl 0.9's ``patch_camem_sleep`` is the same fix: ours carries verl's ``_verl_camem_sleep_patched``
marker (verl then skips its own), and a live verl ``sleep`` makes ours ``yielded``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Site,
    Verdict,
    decides,
    fixed_upstream,
    unsupported,
    wrapping_patch,
)
from verl_npu_autopatch.patches._verl import CAMEM_MARKER, claim, yield_to_verl

CAMEM = "vllm_ascend.device_allocator.camem"
SLEEP_PARAMS = ("self", "offload_tags")
SYNC = "torch.npu.synchronize()"
UNMAP = "unmap_and_release("


@decides(f"{CAMEM}:CaMemAllocator.sleep", SLEEP_PARAMS)
def camem_rule(sleep: Code) -> Verdict:
    if not sleep.has(UNMAP):
        return unsupported("sleep releasing memory through unmap_and_release", "sleep without it")
    source = sleep.source or ""
    if SYNC in source and source.index(SYNC) < source.index(UNMAP):
        return fixed_upstream("sleep already calls torch.npu.synchronize() before unmap_and_release")
    return APPLY


def _sleep(site: Site, original: Callable[..., Any]) -> Callable[..., Any]:
    module = site.module

    @functools.wraps(original)
    def sleep(self: Any, *args: Any, **kwargs: Any) -> Any:
        module.torch.npu.synchronize()  # the camem module's own torch, as its sleep uses it
        return original(self, *args, **kwargs)

    return claim(sleep, CAMEM_MARKER)


PATCHES = [
    wrapping_patch(
        "ascend.camem_sleep_sync",
        "CaMemAllocator.sleep synchronizes the NPU before unmapping and releasing memory.",
        rule=camem_rule,
        wrap=_sleep,
        opt_in="glm52",
        reference="https://github.com/verl-project/verl/pull/7779",
        yields_to=(yield_to_verl(),),
    ),
]
