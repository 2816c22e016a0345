"""``megatron.async_save_format``: megatron-core's asynchronous checkpoint writer hands torch's
``_write_item`` the ``serialization_format`` it requires since torch 2.8.

``FileSystemWriterAsync.write_preloaded_data`` (``megatron.core.dist_checkpointing.strategies.
filesystem_async``) writes each bucket of an asynchronous distributed-checkpoint save by calling
torch's private ``torch.distributed.checkpoint.filesystem._write_item``, a name the module copies
with ``from ... import``. torch 2.8 added a required ``serialization_format`` parameter to it;
megatron-core 0.12.1 calls it without one, so every write raises ``TypeError``, the writer
reports the error as its result and the save fails. megatron-core 0.13.1 passes the argument when
torch's function takes it. verl carries the same fix as ``apply_patch_megatron_v012_with_torch_v28_v29``
(``verl/models/mcore/patch.py``; verl #5471, #6322), a copy of the whole method applied on
``import verl.models.mcore`` and gated on the version strings torch 2.8 / 2.9 and core 0.12.1:
torch 2.10 and later, or a dev version string, keep the bug there.

Decided from the code, both sides: the writer's own method (a call naming
``serialization_format`` is fixed upstream; the 0.12.1 call without it applies) and torch's
function (one that takes no ``serialization_format``, or gives it a default, needs nothing): one
rule over its parameters, fed the live function's signature by ``check`` and a torch release's
``def`` by the decision table's torch section.
The fix replaces the module's copy of ``_write_item`` (the one name the writer calls) by a
wrapper that adds ``serialization_format=SerializationFormat.TORCH_SAVE`` (torch's own default
for its synchronous writer, and what 0.13.1 passes) when the caller gave none; every argument a
caller does give goes through unchanged, so verl's copy of the method, should it replace the
method later, still runs as it was written. The writer's worker processes are forked, so they
inherit the rebinding (a spawned one patches itself at import).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Patch,
    Site,
    StaticRule,
    Target,
    UpstreamTree,
    Verdict,
    definition_defaults,
    fixed_upstream,
    parameter_defaults,
    unsupported,
    wrapping_fix,
)

MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
TORCH_MODULE = "torch.distributed.checkpoint.filesystem"
WRITER = "FileSystemWriterAsync.write_preloaded_data"
ARGUMENT = "serialization_format"
#: How megatron-core 0.12.1 calls ``_write_item`` (the tensor call; the bytes call reads the same).
CALL = "_write_item(*transform_list,stream,tensor,write_item,storage_key)"


def writer_rule(code: Code) -> Verdict:
    """Decide on ``FileSystemWriterAsync.write_preloaded_data``: does it pass the argument?"""
    if code.has(ARGUMENT):
        return fixed_upstream("write_preloaded_data passes serialization_format to _write_item")
    if not code.has(CALL):
        return unsupported(f"write_preloaded_data calling {CALL}", "another call")
    return APPLY


def torch_rule(parameters: dict[str, bool] | None) -> Verdict:
    """Decide on torch's ``_write_item`` from its parameters (name → may a caller leave it out):
    does it require the argument?"""
    if parameters is None:
        return unsupported("torch's _write_item with a readable signature", "none")
    if ARGUMENT not in parameters:
        return fixed_upstream("torch's _write_item takes no serialization_format")
    if parameters[ARGUMENT]:
        return fixed_upstream("torch's _write_item gives serialization_format a default")
    return APPLY


def check(site: Site) -> Verdict:
    """Both sides: the writer's call (the module's code), then torch's live function."""
    owner = getattr(site.module, "FileSystemWriterAsync", None)
    writer = None if owner is None else inspect.getattr_static(owner, "write_preloaded_data", None)
    if writer is None:
        return unsupported(f"{MODULE}:{WRITER}", "no such method")
    verdict = writer_rule(Code.live(writer))
    return verdict if verdict is not APPLY else torch_rule(parameter_defaults(site.value))


def static(tree: UpstreamTree) -> Verdict:
    """A megatron-core release's writer, read (torch's side: :func:`torch_static`)."""
    return tree.judge(MODULE, WRITER, writer_rule)


def note(tree: UpstreamTree) -> str | None:
    """Where the megatron-core cell says *applies*: only with a torch whose function requires it."""
    if static(tree).action != "apply":
        return None
    return (
        "applies only with a torch whose _write_item requires serialization_format (torch >= 2.8: see torch's section)"
    )


def torch_static(tree: UpstreamTree) -> Verdict:
    """A torch release's ``_write_item``, read: the same rule over its ``def``."""
    source = tree.module(TORCH_MODULE)
    node = None if source is None else source.function_node("_write_item")
    if node is None:
        found = "no such module" if source is None else f"{TORCH_MODULE} without it"
        return unsupported(f"{TORCH_MODULE}:_write_item", found)
    return torch_rule(definition_defaults(node))


def torch_note(tree: UpstreamTree) -> str | None:
    """Where the torch cell says *applies*: only with megatron-core's writer that omits it."""
    if torch_static(tree).action != "apply":
        return None
    return (
        "applies only with a megatron-core writer calling _write_item without it (0.12.1: see megatron-core's section)"
    )


def with_format(site: Site, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` taking ``serialization_format=TORCH_SAVE`` when its caller passes none."""
    position = list(inspect.signature(original).parameters).index(ARGUMENT)
    default = importlib.import_module(original.__module__).SerializationFormat.TORCH_SAVE

    @functools.wraps(original)
    def _write_item(*args: Any, **kwargs: Any) -> Any:
        if len(args) <= position and ARGUMENT not in kwargs:
            kwargs[ARGUMENT] = default
        return original(*args, **kwargs)

    return _write_item


PATCHES = [
    Patch(
        name="megatron.async_save_format",
        summary="megatron-core 0.12.1's asynchronous checkpoint writer passes torch >= 2.8's serialization_format.",
        targets=(Target.parse(f"{MODULE}:_write_item"),),
        check=check,
        fix=wrapping_fix(with_format),
        static=StaticRule(
            static,
            reads=("megatron/core/dist_checkpointing/strategies/filesystem_async.py",),
            note=note,
            also=(StaticRule(torch_static, reads=("torch/distributed/checkpoint/filesystem.py",), note=torch_note),),
        ),
        reference="https://github.com/verl-project/verl/issues/5471",
        groups=("megatron",),
    ),
]
