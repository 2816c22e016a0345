"""Who else owns a transformers kernel target: Liger-Kernel, verl's in-tree ``npu_patch``, or
another of our own family patches on a class two families share. Each detector takes the live
``Site`` and returns the owner's name or ``None`` (``Patch.yields_to``)."""

from __future__ import annotations

from typing import Any

from verl_npu_autopatch.authoring import Site, describe, marked_by, underlying
from verl_npu_autopatch.patches._verl import from_verl
from verl_npu_autopatch.patches.transformers_npu.models import GROUP


def _module_of(obj: Any) -> str:
    return getattr(underlying(obj), "__module__", None) or ""


def _value_and_holder(value: Any, holder: Any) -> list[Any]:
    """The live value and, when it is a class, what holds it (another owner may rebind either)."""
    return [value, *([holder] if isinstance(holder, type) else [])]


def from_package(package: str, value: Any, holder: Any) -> bool:
    """Whether ``value``, or the class ``holder`` holding it (rebound by another owner), comes from
    top-level package ``package``."""
    return any(_module_of(obj).split(".")[0] == package for obj in _value_and_holder(value, holder))


def _package_owner(site: Site, package: str, label: str) -> str | None:
    """``"<label> (<function>)"`` when the live value, or the class holding it, comes from
    top-level package ``package``, else ``None``."""
    return f"{label} ({describe(site.value)})" if from_package(package, site.value, site.owner) else None


def liger_owner(site: Site) -> str | None:
    """Liger-Kernel replaced the target (or rebound the class holding it)."""
    return _package_owner(site, "liger_kernel", "liger-kernel")


def verl_owner(site: Site) -> str | None:
    """verl's in-tree ``npu_patch`` replaced the target (or rebound the class holding it, as for
    Qwen3-VL-MoE's block): the same torch_npu kernels, so either may run; the record names who does."""
    owned = any(from_verl(obj) for obj in _value_and_holder(site.value, site.owner))
    return f"verl ({describe(site.value)})" if owned else None


def shared_owner(site: Site) -> str | None:
    """The name of another of our patches already installed on the live target, or ``None``.
    Some releases share one class between families (transformers 4.57 ``modeling_qwen2_5_vl``
    imports ``Qwen2RMSNorm``): the family that patched it first owns it, and the undo order stays
    right."""
    owner = marked_by(site.value)
    if owner and owner != site.patch.name and owner.startswith(f"{GROUP}."):
        cls = site.owner if isinstance(site.owner, type) else None
        where = f" (shared class {cls.__module__}.{cls.__qualname__})" if cls else ""
        return f"{owner}{where}"
    return None
