"""torch_npu fused kernels for the transformers Qwen families (verl's ``npu_patch``, made lazy).

One patch per (family, kernel) — ``transformers.qwen3.rms_norm``, ``transformers.qwen3.mlp``,
``transformers.qwen3.rotary``, ``transformers.qwen3_moe.experts`` … — generated from the table
``MODELS`` (family -> kinds and their targets) and the one kernel table ``KERNELS`` (kind ->
summary, probe, builder, Liger switch). Per-kernel names keep the report readable, let
``VERL_NPU_AUTOPATCH_DISABLE`` turn off one kernel, and let the Liger-Kernel arbitration
(``patches/liger.py``) hand over exactly the targets Liger takes (Liger has no gated RMSNorm, so
ours stays). Each family is also a group (``transformers.qwen3``).

Each patch applies when its modeling module is imported; a family that is never imported costs
nothing beyond its hook. Nothing is guessed from versions: every check probes the live code
(signature, source fingerprint, attribute names, weight layout) and records ``unsupported``
with what it expected and found. Kernels live in ``_npu_kernels`` (imported at fix time only).

This module is the family; its parts are helpers, each with one job:

- ``_transformers_models``: the family table ``MODELS`` and the names derived from it;
- ``_transformers_owners``: who else owns a target (Liger-Kernel, verl, a class two families share);
- ``_transformers_probes``: the structural checks of the live code;
- ``_transformers_builders``: what installs a kernel;
- ``_transformers_table``: the kernel table ``KERNELS`` and the patches of one family.
"""

from __future__ import annotations

from verl_npu_autopatch.patches._transformers_models import GROUP, MODELS, REFERENCE, kinds, module_name, patch_name
from verl_npu_autopatch.patches._transformers_owners import from_package, liger_owner, shared_owner, verl_owner
from verl_npu_autopatch.patches._transformers_probes import (
    Unfit,
    default_hook_owner,
    dispatcher_interface,
    hub_function,
)
from verl_npu_autopatch.patches._transformers_table import KERNELS, Kernel, family_patches, probe
from verl_npu_autopatch.spec import Patch

__all__ = [
    "GROUP",
    "KERNELS",
    "MODELS",
    "PATCHES",
    "REFERENCE",
    "Kernel",
    "Unfit",
    "default_hook_owner",
    "dispatcher_interface",
    "family_patches",
    "from_package",
    "hub_function",
    "kinds",
    "liger_owner",
    "module_name",
    "patch_name",
    "probe",
    "shared_owner",
    "verl_owner",
]


PATCHES: list[Patch] = [patch for family in MODELS for patch in family_patches(family)]
