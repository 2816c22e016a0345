"""The patch catalog: built-in patch families plus third-party specs from entry points.

The engine reads the built-in patches as :class:`Declared` ones from the generated index
(``patches/_index.py``, checked by ``tests/unit/test_catalog_index.py``), so an activation imports no
family; a family is imported when one of its targets is (:meth:`Declared.load`). To regenerate:

    PYTHONPATH=src python3 -m verl_npu_autopatch.engine.catalog > src/verl_npu_autopatch/patches/_index.py
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any, Generic, TypeVar

from verl_npu_autopatch.authoring.spec import Patch, Target
from verl_npu_autopatch.engine import environment, text

__all__ = [
    "ENTRY_POINT_GROUP",
    "FAMILIES",
    "PACKAGE",
    "Catalog",
    "Declared",
    "builtin",
    "declared",
    "families",
    "load",
    "load_declared",
    "names_and_groups",
    "plugins",
    "render_index",
]

#: The package holding the built-in patch families.
PACKAGE = "verl_npu_autopatch.patches"
#: The built-in families (the public modules of :data:`PACKAGE`) in catalog order: the order the engine
#: applies one target module's patches in and ``docs/patches.md`` lists them in (tests/unit/test_discovery.py
#: fails for a family module missing here).
FAMILIES: tuple[str, ...] = (
    "vllm_moe",
    "vllm_rotary_flash_attn_guard",
    "vllm_routed_experts_padding_slots",
    "transformers_npu",
    "transformers_deepstack",
    "liger_arbitration",
    "ascend_glm52",
    "ascend_camem_sleep_sync",
    "ascend_routed_experts_capture",
    "ascend_routed_experts_dp_padding_trim",
    "ascend_sampler_record_stream",
    "ascend_310p_sampler_record_stream",
    "ascend_gate_fp32_in_place",
    "ascend_dsv4_rope_plain_swa",
    "ascend_fused_moe_copies",
    "ascend_mooncake_aborted_receive",
    "ascend_mooncake_truncate_rehash",
    "ascend_mooncake_hybrid_send_counts",
    "ascend_mooncake_sleep_reregister",
    "ascend_dispatcher_expert_ids_sleep",
    "ascend_wake_expert_layout",
    "ascend_mxfp8_reload_in_place",
    "ascend_dsv4_dummy_tid2eid",
    "ascend_dsv4_dummy_wo_a",
    "ascend_attention_buffers_keep_mapped",
    "vllm_engine_partial_wake_up",
    "verl_defer_duplicates",
    "verl_3d_position_ids",
    "tensordict_npu_sync",
    "torch_npu_nested_tensor_intercept",
    "megatron_mtp_postprocess",
    "megatron_expert_bias_fp32",
    "megatron_layer_offset",
    "megatron_async_save_format",
    "megatron_bridge_mindspeed_te",
    "verl_distillation_log_prob_floor",
    "verl_npu_version_probe",
    "verl_checkpoint_send_reoffload",
    "verl_hccl_broadcast_thread",
)
#: Entry-point group for third-party patch specs: each names a ``Patch``, an iterable of them, or a
#: zero-argument callable returning either.
ENTRY_POINT_GROUP = "verl_npu_autopatch.patches"


def families(package: str = PACKAGE) -> list[ModuleType]:
    """The built-in patch families (each exposes ``PATCHES``): every public module of ``package``,
    found on disk, in :data:`FAMILIES` order; one the list misses comes last, by name."""
    root = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.iter_modules(root.__path__) if not m.name.startswith("_"))
    modules = {name: importlib.import_module(f"{package}.{name}") for name in names}
    order = {name: i for i, name in enumerate(FAMILIES)}
    return [modules[name] for name in sorted(names, key=lambda name: order.get(name, len(order)))]


def builtin(package: str = PACKAGE) -> list[Patch]:
    """The built-in patches, in catalog order."""
    return [patch for family in families(package) for patch in family.PATCHES]


class Declared:
    """A built-in patch as the index declares it: what the engine reads before its target is imported;
    :meth:`load` gives the patch."""

    __slots__ = ("default", "device", "family", "groups", "hooks", "name", "requires")

    def __init__(
        self,
        family: str,
        name: str,
        groups: tuple[str, ...],
        default: bool,
        device: str,
        requires: tuple[str, ...],
        hooks: tuple[Target, ...],
    ) -> None:
        self.family, self.name, self.groups, self.default = family, name, groups, default
        self.device, self.requires, self.hooks = device, requires, hooks

    def load(self) -> Patch:
        """The patch itself, from its family module (imported now if need be)."""
        module = importlib.import_module(f"{PACKAGE}.{self.family}")
        for patch in module.PATCHES:
            if patch.name == self.name:
                return patch
        raise LookupError(f"family {self.family} has no patch {self.name}: regenerate patches/_index.py")


def declared() -> list[Declared]:
    """The built-in patches as the index declares them, in catalog order; no family is imported."""
    from verl_npu_autopatch.patches._index import INDEX

    return [
        Declared(family, name, groups, default, device, requires, tuple(Target(*hook) for hook in hooks))
        for family, entries in INDEX
        for name, groups, default, device, requires, hooks in entries
    ]


def render_index() -> str:
    """The text of ``patches/_index.py``."""
    lines = [
        '"""Generated by `PYTHONPATH=src python3 -m verl_npu_autopatch.engine.catalog`: what the engine needs of each',
        'built-in patch before its target is imported (see ``catalog.Declared``). Do not edit."""',
        "",
        "INDEX = (",
    ]
    for module in families():
        lines.append(f"    ({module.__name__.rpartition('.')[2]!r}, (")
        for p in module.PATCHES:
            hooks = tuple((t.module, t.qualname, t.requires) for t in p.hooks)
            lines.append(f"        {(p.name, p.groups, p.default, p.device, p.requires, hooks)!r},")
        lines.append("    )),")
    return "\n".join([*lines, ")", ""])


def _as_patches(obj: object) -> list[Patch]:
    if isinstance(obj, Patch):
        return [obj]
    if callable(obj) and not isinstance(obj, Iterable):
        return _as_patches(obj())
    if isinstance(obj, Iterable):
        items = list(obj)
        if all(isinstance(item, Patch) for item in items):
            return items
    got = text.safe_str(type(obj).__name__, 100)  # the object's own repr may raise or run to megabytes
    raise TypeError(f"expected a Patch, an iterable of Patch or a callable returning them, got a {got}")


P = TypeVar("P", bound="Patch | Declared")


class Catalog(Generic[P]):
    """What :func:`load` found: the patches (or also :class:`Declared` ones), ``(entry point, error,
    exception)`` per entry point that failed, those skipped by DISABLE, and every entry point's name."""

    __slots__ = ("entry_points", "errors", "patches", "skipped")

    def __init__(
        self,
        patches: list[P],
        errors: list[tuple[str, str, BaseException]] | None = None,
        skipped: list[str] | None = None,
        entry_points: list[str] | None = None,
    ) -> None:
        self.patches = patches
        self.errors = errors or []
        self.skipped = skipped or []
        self.entry_points = entry_points or []

    def names(self) -> set[str]:
        """Every name ENABLE/DISABLE may use: patches, groups and entry points."""
        return names_and_groups(self.patches) | set(self.entry_points) | {f"entry-point:{n}" for n in self.entry_points}

    def unique(self) -> tuple[dict[str, P], list[str]]:
        """``({name: patch}, warnings)`` in order; a second patch of a name is ignored, with a warning."""
        unique: dict[str, P] = {}
        warnings = []
        for patch in self.patches:
            if patch.name in unique:
                warnings.append(f"duplicate patch name {patch.name!r}: the second one is ignored")
            else:
                unique[patch.name] = patch
        return unique, warnings


def plugins(disable: Iterable[str] = (), timeout: float | None = None) -> Catalog[Patch]:
    """Patches from the entry points (trust model: docs/writing-a-patch.md); one named in ``disable``
    (``NAME`` or ``entry-point:NAME``, in any case) is never imported. Each distribution's metadata
    and each entry point's load has its own guard: a failure, even ``SystemExit``, is an error of its
    own, never the end of the catalog; so is a load that outlasts ``timeout`` (``status``)."""
    off = {name.casefold() for name in disable}  # names match in any case (VERL_NPU_AUTOPATCH_DISABLE)
    found: Catalog[Patch] = Catalog([])
    for dist, points in _entry_points(found):
        for point in points:
            label = f"entry-point:{point.name}"
            found.entry_points.append(point.name)
            if point.name.casefold() in off or label.casefold() in off:
                found.skipped.append(label)
                continue
            try:
                found.patches += _load(point, timeout)
            except (Exception, SystemExit) as exc:  # a plugin's bug (or argparse at import) is its record
                error = f"loading {text.safe_str(point.value)} (distribution {dist}) raised {text.describe(exc)}"
                found.errors.append((label, error, exc))
    return found


def _entry_points(found: Catalog[Patch]) -> list[tuple[str, list[Any]]]:
    """``(distribution, its entry points in our group)`` for the first distribution of each name on
    the path (as ``importlib.metadata`` picks them); one whose entry points cannot be read is an error
    in ``found``."""
    seen: set[str] = set()
    listed = []
    for named, dist in _distributions():
        name = named or "?"
        try:
            # in an archive: the name from the path, as entry_points() reads it, else METADATA's
            name = named or getattr(dist, "_normalized_name", None) or dist.metadata["Name"] or "?"
            if name in seen or dist is None:  # a later copy of a name, or no entry point of ours
                seen.add(name)
                continue
            seen.add(name)
            if named is None and ENTRY_POINT_GROUP not in (dist.read_text("entry_points.txt") or ""):
                continue
            points = [point for point in dist.entry_points if point.group == ENTRY_POINT_GROUP]
        except Exception as exc:  # broken metadata of one distribution: its record, the others still load
            error = f"reading the entry points of distribution {text.safe_str(name)} raised {text.describe(exc)}"
            found.errors.append((f"distribution:{name}", error, exc))
            continue
        if points:
            listed.append((name, points))
    return listed


def _distributions() -> Iterable[tuple[str | None, Any]]:
    """``(normalized name, distribution)`` on ``sys.path``: a folder's distribution is ``None`` unless
    its ``entry_points.txt`` names our group (only those are parsed); then ``(None, distribution)``
    for those in archives, left to ``importlib.metadata``."""
    from importlib.metadata import PathDistribution, distributions
    from pathlib import Path

    group = ENTRY_POINT_GROUP.encode()
    folders, archives = environment.metadata_folders()
    for name, folder in folders.items():
        try:
            with open(os.path.join(folder, "entry_points.txt"), "rb") as file:
                ours = group in file.read()
        except OSError:  # no entry_points.txt (most distributions), or one importlib could not read
            ours = False
        yield name, (PathDistribution(Path(folder)) if ours else None)
    for entry in archives:
        yield from ((None, dist) for dist in distributions(path=[entry]))


def _load(point: Any, timeout: float | None) -> list[Patch]:
    """The patches of entry point ``point``; with ``timeout``, loaded in a daemon thread waited for
    that long (a plugin that hangs is left behind, and is an error)."""
    if timeout is None:
        return _as_patches(point.load())
    import threading

    result: list[Any] = []

    def load() -> None:
        try:
            result.append(_as_patches(point.load()))
        except BaseException as exc:  # handed to the waiting thread, which raises it there
            result.append(exc)

    worker = threading.Thread(target=load, name=f"load {point.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if not result:
        raise TimeoutError(f"its load did not finish within {timeout:g} s")
    if isinstance(result[0], BaseException):
        raise result[0]
    return list(result[0])


def load(disable: Iterable[str] = (), timeout: float | None = None) -> Catalog[Patch]:
    """Built-in then plugin patches (``disable``, ``timeout``: see :func:`plugins`)."""
    found = plugins(disable, timeout)
    found.patches = builtin() + found.patches
    return found


def load_declared(disable: Iterable[str] = ()) -> Catalog[Patch | Declared]:
    """As :func:`load`, the built-in patches as the index declares them (no family imported)."""
    found = plugins(disable)
    patches: list[Patch | Declared] = [*declared(), *found.patches]
    return Catalog(patches, found.errors, found.skipped, found.entry_points)


def names_and_groups(patches: Iterable[Patch | Declared]) -> set[str]:
    """Every name ENABLE/DISABLE may use: patch names and group names."""
    return {name for patch in patches for name in (patch.name, *patch.groups)}


if __name__ == "__main__":
    sys.stdout.write(render_index())
