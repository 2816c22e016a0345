"""The patch catalogue: built-in patch families plus third-party specs from entry points."""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from verl_npu_autopatch.spec import Patch

#: Built-in patch families, in catalogue order; each module exposes ``PATCHES``.
FAMILIES: tuple[str, ...] = (
    "vllm_moe",
    "vllm_rotary",
    "transformers_npu",
    "liger",
    "ascend_glm52",
    "ascend_camem",
    "ascend_capture",
    "vllm_engine",
    "tensordict_sync",
    "torch_npu_nested",
    "megatron_mtp",
)

#: Entry-point group for third-party patch specs. An entry point may name a ``Patch``, an
#: iterable of them, or a zero-argument callable returning either.
ENTRY_POINT_GROUP = "verl_npu_autopatch.patches"


def builtin() -> list[Patch]:
    """The built-in patches, in catalogue order."""
    patches: list[Patch] = []
    for family in FAMILIES:
        patches += importlib.import_module(f"verl_npu_autopatch.patches.{family}").PATCHES
    return patches


def _as_patches(obj: object) -> list[Patch]:
    if isinstance(obj, Patch):
        return [obj]
    if callable(obj) and not isinstance(obj, Iterable):
        return _as_patches(obj())
    if isinstance(obj, Iterable):
        items = list(obj)
        if all(isinstance(item, Patch) for item in items):
            return items
    raise TypeError(f"expected a Patch, an iterable of Patch or a callable returning them, got {obj!r}")


def plugins() -> tuple[list[Patch], list[tuple[str, str]]]:
    """Patches from the ``verl_npu_autopatch.patches`` entry points, and ``(name, error)`` for
    each entry point that failed to load."""
    from importlib.metadata import entry_points

    patches: list[Patch] = []
    errors: list[tuple[str, str]] = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            patches += _as_patches(point.load())
        except Exception as exc:
            errors.append((f"entry-point:{point.name}", f"loading {point.value} raised {type(exc).__name__}: {exc}"))
    return patches, errors


def load() -> tuple[list[Patch], list[tuple[str, str]]]:
    """Built-in then plugin patches, and plugin load errors."""
    extra, errors = plugins()
    return builtin() + extra, errors


def names_and_groups(patches: Iterable[Patch]) -> set[str]:
    """Every name ENABLE/DISABLE may use: patch names and group names."""
    known: set[str] = set()
    for patch in patches:
        known.add(patch.name)
        known.update(patch.groups)
    return known
