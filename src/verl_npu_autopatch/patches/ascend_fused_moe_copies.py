"""``ascend.fused_moe_copies``: vLLM's MoE model modules imported before vllm-ascend's platform patch
build their layers with vllm-ascend's ``FusedMoE``, as those imported after do.

vllm-ascend's ``patch/platform/patch_fused_moe.py`` replaces vLLM's ``FusedMoE`` factory (keeping
it as ``_original_FusedMoE``) in ``vllm.model_executor.layers.fused_moe`` and its ``layer`` module
only. A model module (``qwen3_moe``, ``deepseek_v2``, ...) imported earlier took the name with
``from vllm.model_executor.layers.fused_moe import FusedMoE`` and keeps vLLM's own factory: the
model is built without vllm-ascend's MoE runner and the service fails to start (vllm-ascend issue
#15815; verl imports such model modules early). 0.24.0rc1 replaces
``fused_moe_make_expert_params_mapping`` the same way (kept as
``_original_fused_moe_make_expert_params_mapping``), copied by the same modules.

The fix is the engine's rebinding of copies (``Reach.copies_in``, ``Reach.stale_values``): right after
vllm-ascend's module ran (the trigger), every global of ``vllm.model_executor.models`` still
holding vLLM's original of a replaced name is rebound to the package's live value, vllm-ascend's
function; revert puts vLLM's original back in each. Decided from the code of vllm-ascend's module:
from 0.27.1rc1 it rebinds the copies in ``vllm.model_executor.models`` itself (``fixed-upstream``);
0.23.0 and 0.23.0.post1 rebind only when vLLM is not 0.23.0, so under their paired vLLM nothing is
replaced (``unsupported``: nothing stale); releases before 0.23.0 have no such module. On by
default: any MoE model module imported early is concerned.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    ModuleSource,
    Patch,
    Reach,
    Site,
    StaticRule,
    Target,
    UpstreamTree,
    Verdict,
    copies_only,
    fixed_upstream,
    unsupported,
)

PATCH_MODULE = "vllm_ascend.patch.platform.patch_fused_moe"
PACKAGE = "vllm.model_executor.layers.fused_moe"
MODELS = "vllm.model_executor.models"
#: The names vllm-ascend replaces in :data:`PACKAGE`; it keeps vLLM's original of each as ``_original_<name>``.
NAMES = ("FusedMoE", "fused_moe_make_expert_params_mapping")
TARGETS = tuple(Target(PACKAGE, name) for name in NAMES)
#: Whitespace-free: vllm-ascend's module rebinding the model modules' copies itself (0.27.1rc1 on).
REBINDS_COPIES = ("sys.modules.items()", f'startswith("{MODELS}")')
#: Whitespace-free: the assignment replacing ``FusedMoE`` and the kept original.
REPLACES, KEEPS = ".FusedMoE=", "_original_FusedMoE="
#: The model modules whose copies the decision table notes (and the tests load).
MODEL_FILES = ("qwen3_moe", "deepseek_v2")


def copies_rule(text: str | None, replaced: bool = True) -> Verdict:
    """Decide from the source of vllm-ascend's ``patch_fused_moe`` module (``None``: the release has
    none) and whether its replacement of ``FusedMoE`` ran (``False``: skipped under this vLLM)."""
    if text is None:
        return unsupported(f"module {PATCH_MODULE}", "no such module")
    flat = "".join(text.split())
    if all(needle in flat for needle in REBINDS_COPIES):
        return fixed_upstream(f"{PATCH_MODULE} rebinds the copies in {MODELS} itself")
    if REPLACES not in flat or KEEPS not in flat:
        expected = f"{PATCH_MODULE} replacing FusedMoE and keeping vLLM's as _original_FusedMoE"
        return unsupported(expected, "another body")
    if not replaced:
        return unsupported(f"{PATCH_MODULE} having replaced FusedMoE", "vLLM's own: not replaced under this vLLM")
    return APPLY


def earlier() -> dict[Target, Any]:
    """vLLM's original of each name vllm-ascend's module replaced, as it keeps them (``Reach.stale_values``)."""
    module = sys.modules.get(PATCH_MODULE)
    found = {}
    for target in TARGETS:
        kept = getattr(module, f"_original_{target.qualname}", None)
        if getattr(kept, "__name__", None) == target.qualname:  # 0.27.1rc1 on keeps FusedMoEFactory
            found[target] = kept
    return found


def _replaced_now() -> bool:
    """Whether vllm-ascend's module replaced ``FusedMoE`` in vLLM's package in this process."""
    package = sys.modules.get(PACKAGE)
    kept = earlier().get(TARGETS[0])
    return package is not None and kept is not None and getattr(package, NAMES[0], None) is not kept


def _check(site: Site) -> Verdict:
    try:
        text = Path(site.value).read_text(encoding="utf-8")
    except (OSError, TypeError):  # no readable source (a .pyc-only install): the rule sees none, unsupported
        text = None
    return copies_rule(text, _replaced_now())


def skipped_under(source: ModuleSource, vllm: str | None) -> bool:
    """Whether the module's replacement of ``FusedMoE`` sits under ``if not vllm_version_is(V)``
    with ``V`` the vLLM release ``vllm`` (0.23.x under vLLM 0.23.0)."""
    for node in source.tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.Call):
            call = test.operand
            named = ast.unparse(call.func).rpartition(".")[2] == "vllm_version_is"
            if named and [ast.literal_eval(a) for a in call.args if isinstance(a, ast.Constant)] == [vllm]:
                return REPLACES in "".join(ast.unparse(node).split())
    return False


def _static(tree: UpstreamTree) -> Verdict:
    source = tree.module(PATCH_MODULE)
    replaced = source is None or not skipped_under(source, tree.versions.get("vllm"))
    return copies_rule(source.text if source else None, replaced)


def _note(tree: UpstreamTree) -> str | None:
    """Which of the model modules read copy a name the release's module replaces, by ``from ... import``
    (and, where the replacement is skipped under the paired vLLM, that another vLLM runs it)."""
    source = tree.module(PATCH_MODULE)
    flat = "".join(source.text.split()) if source else ""
    copied = []
    for name in (n for n in NAMES if f".{n}=" in flat):
        models = {m: tree.module(f"{MODELS}.{m}") for m in MODEL_FILES}
        found = [m for m, model in models.items() if model is not None and model.imports_from(PACKAGE, name)]
        if found:
            copied.append(f"`{name}` into {', '.join(found)}")
    note = "copied by `from ... import`: " + "; ".join(copied) if copied else ""
    vllm = tree.versions.get("vllm")
    if source is not None and skipped_under(source, vllm):  # the live check decides from what ran
        note += ("; " if note else "") + f"it replaces FusedMoE only under a vLLM other than {vllm} (there: applies)"
    return note or None


PATCHES = [
    Patch(
        name="ascend.fused_moe_copies",
        summary="vLLM model modules imported before vllm-ascend's FusedMoE patch get vllm-ascend's FusedMoE too.",
        reference="https://github.com/vllm-project/vllm-ascend/issues/15815",
        groups=("ascend",),
        targets=TARGETS,
        reach=Reach(triggers=(Target.parse(f"{PATCH_MODULE}:__file__"),), copies_in=(MODELS,), stale_values=earlier),
        check=_check,
        fix=copies_only,
        static=StaticRule(
            _static,
            reads=(
                "vllm_ascend/patch/platform/patch_fused_moe.py",
                *(f"vllm/model_executor/models/{name}.py" for name in MODEL_FILES),
            ),
            note=_note,
        ),
    ),
]
