"""torch_npu fused kernels for the transformers Qwen families (verl's ``npu_patch``, made lazy).

One patch per (family, kernel) — ``transformers.qwen3.rms_norm``, ``transformers.qwen3.mlp``,
``transformers.qwen3.rotary``, ``transformers.qwen3_moe.experts`` … — generated from the table
``MODELS`` (family -> kinds and their targets) and the one kernel table ``KERNELS`` (kind ->
summary, probe, builder, Liger switch). Per-kernel names keep the report readable, let
``VERL_NPU_AUTOPATCH_DISABLE`` turn off one kernel, and let the Liger-Kernel arbitration
(``patches/liger_arbitration.py``) hand over exactly the targets Liger takes (Liger has no gated
RMSNorm, so ours stays). Each family is also a group (``transformers.qwen3``).

Each patch applies when its modeling module is imported; a family that is never imported costs
nothing beyond its hook. Nothing is guessed from versions: every check probes the live code
(signature, source fingerprint, attribute names, weight layout) and records ``unsupported``
with what it expected and found.

This module is the family; its modules are its helpers, each with one job:

- ``models``: the family table ``MODELS`` and the names derived from it;
- ``owners``: who else owns a target (Liger-Kernel, verl, a class two families share);
- ``probes``: the structural checks of the live code;
- ``builders``: what installs a kernel;
- ``table``: the kernel table ``KERNELS`` and the patches of one family;
- ``kernels``: the torch_npu kernels (imported at fix time only, and torch with them);
- ``experts_interface``: our kernel in transformers 5.x's experts registry (at fix time only);
- ``verify_cases``: the tiny inputs ``doctor --verify`` runs each applied kernel on.

Within the package its modules import each other by their full name, never through this module.
"""

from __future__ import annotations

from verl_npu_autopatch.authoring import Patch
from verl_npu_autopatch.patches.transformers_npu.models import GROUP, MODELS, REFERENCE, kinds, module_name, patch_name
from verl_npu_autopatch.patches.transformers_npu.owners import from_package, liger_owner, shared_owner, verl_owner
from verl_npu_autopatch.patches.transformers_npu.probes import (
    Unfit,
    default_hook_owner,
    dispatcher_interface,
    hub_function,
)
from verl_npu_autopatch.patches.transformers_npu.table import KERNELS, Kernel, family_patches, probe

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
