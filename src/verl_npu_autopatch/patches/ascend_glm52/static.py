"""The static rules of the GLM-5.2 vllm-ascend patches (``ascend_glm52``): each decides on a
release's source (an :class:`~.fingerprints.UpstreamTree`, read with :mod:`ast`, never run) with
the same rule ``check`` applies to the live code (``rules``), for ``scripts/compat-matrix``."""

from __future__ import annotations

import ast
from collections.abc import Callable

from verl_npu_autopatch.authoring import Code, ModuleSource, UpstreamTree, Verdict, unsupported
from verl_npu_autopatch.patches.ascend_glm52.rules import (
    DEVICE_OP,
    INDEXER,
    LAYERNORM,
    SFA,
    indexer_backend_rule,
    indexer_rule,
    kv_b_proj_rule,
    rms_norm_rule,
)

PLACEHOLDER_NOTE = (
    "attention/indexer.py here is a cache-layer placeholder (no AscendSFAIndexerBackend.forward); "
    "the unscaled weights are AscendSFAImpl.indexer_select_post_process's, in sfa_v1"
)


def static_rms_norm(tree: UpstreamTree) -> Verdict:
    """``ascend.rms_norm_residual`` on a release: its ``AscendRMSNorm.forward_oot``."""
    code = tree.code(LAYERNORM, "AscendRMSNorm.forward_oot")
    if code is None:
        return unsupported(f"{LAYERNORM}:AscendRMSNorm.forward_oot", _absent(tree, LAYERNORM))
    return rms_norm_rule(code)


def static_kv_b_proj(tree: UpstreamTree) -> Verdict:
    """``ascend.sfa_keep_kv_b_proj`` on a release: sfa_v1's ``process_weights_after_loading`` and
    ``dispose_layer`` (the RL weight-update switch is a run-time setting: not known here)."""
    module = tree.module(SFA)
    code = module.code("AscendSFAImpl.process_weights_after_loading") if module else None
    if module is None or code is None:
        return unsupported(f"{SFA}:AscendSFAImpl.process_weights_after_loading", _absent(tree, SFA))
    return kv_b_proj_rule(code, module.binds("dispose_layer"))


def static_indexer(tree: UpstreamTree) -> Verdict:
    """``ascend.sfa_indexer_scale`` on a release, in the engine's variant order: a variant counts
    only where its module holds the unscaled code the fix is for, and one whose rule says
    unsupported hands over to the next, as ``decision.run`` does. vllm-ascend 0.24 - 0.27 ship an
    ``attention/indexer.py`` that is only a cache-layer placeholder (no ``DeviceOperator``, no
    ``AscendSFAIndexerBackend.forward``): there the unscaled code is still
    ``AscendSFAImpl.indexer_select_post_process`` in sfa_v1."""
    passed: list[str] = []
    notes: list[str] = []
    for variant in (_backend_variant, _sfa_variant):
        verdict = variant(tree)
        if verdict is None:
            if variant is _backend_variant and tree.has_module(INDEXER):
                notes.append(PLACEHOLDER_NOTE)
            continue
        if verdict.action != "unsupported":
            return Verdict(verdict.action, "; ".join(r for r in (verdict.reason, *notes) if r))
        passed.append(verdict.reason)
    if not passed:
        return unsupported(
            f"{INDEXER}:AscendSFAIndexerBackend.forward or {SFA}:AscendSFAImpl.indexer_select_post_process",
            "neither",
        )
    return Verdict("unsupported", " | ".join(passed))


def _backend_variant(tree: UpstreamTree) -> Verdict | None:
    """0.28+: ``attention/indexer.py`` with the standard backend's forward (``None``: the module is
    absent or a placeholder without it)."""
    indexer = tree.module(INDEXER)
    forward = indexer.code("AscendSFAIndexerBackend.forward") if indexer else None
    if indexer is None or forward is None or not indexer.imports_from(DEVICE_OP, "DeviceOperator"):
        return None
    forward_k = indexer.code("AscendSFAIndexerBackend.forward_k")
    return _device_classes(
        tree,
        indexer,
        f"{INDEXER}:DeviceOperator.indexer_select_post_process",
        lambda code: indexer_backend_rule(code, forward, forward_k),
    )


def _sfa_variant(tree: UpstreamTree) -> Verdict | None:
    """0.21 - 0.27: ``AscendSFAImpl.indexer_select_post_process`` in sfa_v1 (``None``: no sfa_v1,
    or it no longer defines that method)."""
    sfa = tree.module(SFA)
    impl = sfa.code("AscendSFAImpl.indexer_select_post_process") if sfa else None
    if sfa is None or impl is None:
        return None
    target = f"{SFA}:DeviceOperator.indexer_select_post_process"
    return _device_classes(tree, sfa, target, lambda code: indexer_rule(code, impl))


def _device_classes(tree: UpstreamTree, module: ModuleSource, target: str, rule: Callable[[Code], Verdict]) -> Verdict:
    """``rule`` on every device class ``DeviceOperator`` can resolve to, combined."""
    device_op = tree.module(DEVICE_OP)
    if not module.imports_from(DEVICE_OP, "DeviceOperator") or device_op is None:
        return unsupported(target, f"{target.partition(':')[0]} has no DeviceOperator from {DEVICE_OP}")
    verdicts: dict[str, Verdict] = {}
    for cls in device_op.returned_names("get_device_adaptor") or _adaptor_classes(device_op) or ["BaseDeviceAdaptor"]:
        code = device_op.code(f"{cls}.indexer_select_post_process")
        verdicts[cls] = (
            unsupported(target, f"{DEVICE_OP}.{cls} has no indexer_select_post_process") if code is None else rule(code)
        )
    return _combine(verdicts)


def _adaptor_classes(device_op: ModuleSource) -> list[str]:
    """The device classes of a ``get_device_adaptor`` that looks them up in a dict (0.30)."""
    node = device_op._top("get_device_adaptor")
    if node is None:
        return []
    return [
        value.id
        for sub in ast.walk(node)
        if isinstance(sub, ast.Dict)
        for value in sub.values
        if isinstance(value, ast.Name)
    ]


def _absent(tree: UpstreamTree, module: str) -> str:
    return f"{module} is missing" if not tree.has_module(module) else f"{module} without it"


def _combine(verdicts: dict[str, Verdict]) -> Verdict:
    """One verdict for several device classes: theirs when they agree, else the first that is not
    ``apply`` with the class named."""
    distinct = {(v.action, v.reason) for v in verdicts.values()}
    if len(distinct) == 1:
        return next(iter(verdicts.values()))
    cls, worst = next((c, v) for c, v in verdicts.items() if v.action != "apply")
    return Verdict(worst.action, f"{cls}: {worst.reason}")
