"""Living next to verl's own in-tree copies of our vLLM / vllm-ascend fixes.

verl (``verl/utils/vllm/npu_vllm_patch.py``, 0.9.x) installs its own versions of several of our
fixes from ``apply_npu_vllm_patches()``. Each verl function guards itself with an attribute marker
on the callable it finds in place (or, for the rotary ``__init__``, with nothing). The rules here:

- every fix of ours that duplicates a verl function sets verl's marker on what it installs
  (:func:`claim`), so verl, running after us, finds its fix "already applied" and does nothing;
- a verl callable is recognised by where its code was written (its globals' ``__name__`` is in
  the ``verl`` package), not by ``__module__``/``__qualname__``, which verl's ``functools.wraps``
  copies from the upstream function (:func:`verl_owned`);
- where verl's version is equivalent to ours, a live verl callable makes our patch ``yielded``
  (:func:`yield_to_verl`); where ours is strictly better, our fix replaces verl's callable and
  wraps the upstream function verl wrapped (:func:`peel`), never verl's wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import Site, Verdict, marked_by, origin, underlying

#: The verl module holding its vLLM / vllm-ascend NPU patches.
PATCH_MODULE = "verl.utils.vllm.npu_vllm_patch"
#: verl's idempotency markers (attribute names set to ``True`` on what verl installs).
GLM52_MARKER = "_verl_vllm_ascend_glm52_patched"
WEIGHT_LOADER_MARKER = "_verl_npu_weight_loader_patched"
CAMEM_MARKER = "_verl_camem_sleep_patched"


def _written_in(value: Any) -> str | None:
    """The module a function's code was written in (its globals' ``__name__``, which
    ``functools.wraps`` does not copy), or ``None`` for anything without Python globals."""
    namespace = getattr(underlying(value), "__globals__", None)
    return str(namespace.get("__name__", "")) if isinstance(namespace, dict) else None


def _is_verl(module: str | None) -> bool:
    return bool(module) and (module == "verl" or str(module).startswith("verl."))


def from_verl(value: Any) -> bool:
    """Whether ``value`` comes from the ``verl`` package: a function by where its code was written,
    anything else (a class verl rebinds) by its ``__module__``. Our own code lives in
    ``verl_npu_autopatch``, which is not ``verl``. The one test of "is this verl's" every family uses."""
    written = _written_in(value)
    return _is_verl(written if written is not None else getattr(underlying(value), "__module__", None))


def verl_owned(value: Any) -> str | None:
    """``module.qualname`` of ``value`` when it is a function written in the ``verl`` package
    (:func:`from_verl`), else ``None``."""
    return origin(value) if _is_verl(_written_in(value)) else None


def claim(func: Any, *markers: str) -> Any:
    """Set verl's ``markers`` on ``func`` (a function we install), so verl skips its duplicate."""
    for marker in markers:
        setattr(underlying(func), marker, True)
    return func


def peel(func: Any) -> Any:
    """The upstream function under verl's ``functools.wraps`` wrappers of ``func`` and under ours
    they may wrap in turn (verl <= 0.8 wraps whatever is in place); ``func`` itself when it is
    neither: what our fix wraps when it takes a target over from verl."""
    for _ in range(8):  # verl wraps once; a few layers at most
        inner = getattr(func, "__wrapped__", None)
        if inner is None or (verl_owned(func) is None and marked_by(func) is None):
            break
        func = inner
    return func


def yield_to_verl(*others: Callable[[Site], Any]) -> Callable[[Site], str | None]:
    """A ``yields_to`` detector: ``"verl (<module.qualname>)"`` when the target's live value (or
    the value ``other(site)`` returns, for fixes spanning several attributes) is verl's."""

    def detect(site: Site) -> str | None:
        for value in (site.value, *(get(site) for get in others)):
            owner = verl_owned(value) if value is not None else None
            if owner:
                return f"verl ({owner})"
        return None

    detect.__name__ = detect.__qualname__ = "yield_to_verl"
    return detect


def over_verl(verdict: Verdict, value: Any, why: str) -> Verdict:
    """``verdict`` for a fix of ours that is strictly better than verl's: when it says ``apply``
    and the live value is verl's, the reason names the verl callable being replaced and ``why``."""
    owner = verl_owned(value)
    if verdict.action != "apply" or owner is None:
        return verdict
    return Verdict("apply", f"replaces verl's {owner}: {why}")
