"""``ascend.dispatcher_expert_ids_sleep``: the All2AllV token dispatcher's ``expert_ids_per_ep_rank``
survives a level-2 sleep (opt-in, group ``sleep_level2``).

``TokenDispatcherWithAll2AllV.__init__`` (EP with more than one local expert) makes
``expert_ids_per_ep_rank``, the local expert index of every global expert, as a plain attribute: an
NPU tensor allocated while the model loads, so in CaMem's ``weights`` pool. A level-2 sleep
(``NPUWorker.sleep(2)``: ``CaMemAllocator.sleep(offload_tags=())``) discards that pool, and
``CaMemAllocator.wake_up`` maps new memory at the same addresses, its contents undefined. The worker
saves and restores the model's ``named_buffers()`` around it, the weights are loaded again, but
nothing restores this tensor: ``_preprocess`` then maps the tokens each rank receives to the wrong
local experts ("fluent but incorrect generations", verl PR #7086).

The fix wraps ``TokenDispatcherWithAll2AllV.__init__`` to keep a CPU copy of the tensor it made, and
``CaMemAllocator.wake_up`` (a secondary site) to copy it back in place (the address captured graphs
read stays) into every live dispatcher once the ``weights`` pool woke (``tags`` None or naming
``weights``). After a level-1 sleep the copy writes the values CaMem restored already. The
dispatchers are only read, never replaced, and the ``NPUWorker`` methods other patches wrap are left
alone. Decided from the code: a release whose fused-MoE runner registers the tensor as a buffer
(``register_buffer("expert_ids_per_ep_rank", ...)``, so the level-2 buffer save/restore covers it)
is fixed upstream.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    ModuleSource,
    Reach,
    Site,
    Target,
    Undo,
    UpstreamTree,
    Verdict,
    chain,
    decides,
    fixed_upstream,
    replace_method,
    rule_patch,
    unsupported,
)
from verl_npu_autopatch.patches._installed_source import installed_source

DISPATCHER = "vllm_ascend.ops.fused_moe.token_dispatcher"
CAMEM = "vllm_ascend.device_allocator.camem"
FUSED_MOE = "vllm_ascend.ops.fused_moe.fused_moe"
ATTRIBUTE = "expert_ids_per_ep_rank"
#: What the rule looks for (whitespace-free).
MAKES = f"self.{ATTRIBUTE}=torch.tensor("
MAPS = "create_and_map(handle)"
REGISTERS = f'register_buffer("{ATTRIBUTE}"'

#: Live dispatcher → the CPU copy of the ``expert_ids_per_ep_rank`` its ``__init__`` made.
_SAVED: WeakKeyDictionary[Any, Any] = WeakKeyDictionary()


@decides(f"{DISPATCHER}:TokenDispatcherWithAll2AllV.__init__", ("self", "kwargs"))
def expert_ids_rule(init: Code, wake_up: Code | None = None, fused_moe: str | None = None) -> Verdict:
    """The dispatcher's ``__init__`` read with ``CaMemAllocator.wake_up`` and the whitespace-free
    text of ``fused_moe.py`` (``None`` where absent)."""
    if fused_moe is not None and REGISTERS in fused_moe:
        return fixed_upstream(
            f'fused_moe.py registers {ATTRIBUTE} as a non-persistent buffer (register_buffer("{ATTRIBUTE}", ...)): '
            "the level-2 named_buffers() save/restore covers it"
        )
    if not init.has(MAKES):
        return unsupported(f"__init__ making {MAKES.replace('=', ' = ')}...)", "another __init__")
    if wake_up is None or wake_up.params != ("self", "tags") or not wake_up.has(MAPS):
        return unsupported("CaMemAllocator.wake_up(self, tags) mapping each allocation again", "another wake_up")
    return APPLY


def _normalized(source: ModuleSource | None) -> str | None:
    return None if source is None else "".join(source.text.split())


def check(site: Site) -> Verdict:
    """The rule on the live ``__init__``, ``CaMemAllocator.wake_up`` as installed and ``fused_moe.py``
    read from its file (importing it here would run it while it imports this module)."""
    camem = installed_source(CAMEM)
    wake_up = None if camem is None else camem.code("CaMemAllocator.wake_up")
    return expert_ids_rule.decide(Code.live(site.value), wake_up, _normalized(installed_source(FUSED_MOE)))


def static(tree: UpstreamTree) -> Verdict:
    """The rule on a release's files."""
    return tree.judge(
        DISPATCHER,
        "TokenDispatcherWithAll2AllV.__init__",
        lambda init: expert_ids_rule.decide(
            init, tree.code(CAMEM, "CaMemAllocator.wake_up"), _normalized(tree.module(FUSED_MOE))
        ),
    )


def restore(tags: list[str] | None = None) -> int:
    """Copy each live dispatcher's saved ``expert_ids_per_ep_rank`` back in place once the
    ``weights`` pool woke; returns how many were restored."""
    if tags is not None and "weights" not in tags:
        return 0
    restored = 0
    for dispatcher, saved in list(_SAVED.items()):
        tensor = getattr(dispatcher, ATTRIBUTE, None)
        if tensor is not None and tensor.shape == saved.shape:
            tensor.copy_(saved)
            restored += 1
    return restored


def _init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, **kwargs: Any) -> None:
        original(self, **kwargs)
        tensor = getattr(self, ATTRIBUTE, None)
        if tensor is not None:
            _SAVED[self] = tensor.detach().to("cpu", copy=True)

    return __init__


def _wake_up(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wake_up(self: Any, tags: list[str] | None = None) -> Any:
        result = original(self, tags)
        restore(tags)
        return result

    return wake_up


def _fix(site: Site) -> Undo:
    name = site.patch.name
    return chain(
        replace_method(site.owner, site.attribute, _init, name),
        replace_method(importlib.import_module(CAMEM).CaMemAllocator, "wake_up", _wake_up, name),
    )


PATCHES = [
    dataclasses.replace(
        rule_patch(
            "ascend.dispatcher_expert_ids_sleep",
            "The All2AllV token dispatcher's expert_ids_per_ep_rank is restored after a level-2 sleep "
            "(tokens reach the right local experts with EP > 1).",
            rule=expert_ids_rule,
            fix=_fix,
            opt_in="sleep_level2",
            static=static,
            reads=tuple(f"{m.replace('.', '/')}.py" for m in (DISPATCHER, CAMEM, FUSED_MOE)),
            reach=Reach(secondary=(Target.parse(f"{CAMEM}:CaMemAllocator.wake_up"),)),
            reference="https://github.com/verl-project/verl/pull/7086",
        ),
        check=check,
    ),
]
