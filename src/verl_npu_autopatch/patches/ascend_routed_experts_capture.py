"""``ascend.routed_experts_capture``: load vllm-ascend's own DP/SP-aware
``RoutedExpertsCapturer.capture`` (module ``patch.worker.patch_routed_experts_capture``) where the
release ships it but does not import it (opt-in, group ``glm52``).

vllm-ascend 0.21 to 0.24 import that module only when the installed vLLM is *not* the paired
release ("main2main"), so with the paired vLLM router replay under DP > 1 captures the wrong
tokens. From 0.25.1rc1 the import is unconditional (``fixed-upstream``). Releases without the
module (before 0.21.0rc1) are ``unsupported`` (there is nothing to load); of those, 0.18 imports
its own, differently named ``patch.worker.patch_routed_experts_capturer`` unconditionally, which
replaces ``RoutedExpertsCapturer.init_buffer`` (buffers and shared memory per DP rank) and leaves
``capture`` as vLLM ships it (the matrix says so: the static rule's ``note``).

Decided from the code only, never from vllm-ascend's version string: Ascend images often report
a stale or development version (0.19.1rc2.dev1265 on 0.25-era code).

The target is vLLM's ``RoutedExpertsCapturer.capture``, replaced by vllm-ascend's function (marked
as ours). The trigger is the ``__file__`` of ``vllm_ascend.patch.worker``: the hook fires right
after vllm-ascend applied its own worker patches (``NPUWorker.__init__`` → ``adapt_patch()``), the
very place it would have imported the module itself, and the check reads that file's source.

With ``ascend.routed_experts_dp_padding_trim`` enabled too (and its rule applying to vllm-ascend's
capture), the capture installed here is already wrapped by that trim (``_capture_trim``): one
owner of the attribute and one undo; the trim's record says ``yielded`` to this patch.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    ModuleSource,
    Patch,
    Reach,
    Site,
    StaticRule,
    Undo,
    UpstreamTree,
    Verdict,
    fixed_upstream,
    imports_module_unconditionally,
    own_value,
    params_mismatch,
    set_marked,
    unsupported,
)
from verl_npu_autopatch.patches._capture_trim import (
    CAPTURE,
    CAPTURE_PARAMS,
    CAPTURER,
    TARGET,
    TRIGGER,
    TRIM,
    WORKER,
    WORKER_READS,
    trim_rule,
    trimmed,
)

#: 0.18's own capturer patch (note the trailing "r"): replaces init_buffer, not capture.
OWN_CAPTURER = f"{WORKER}.patch_routed_experts_capturer"
#: The applied reason when the capture installed here carries the trim.
CARRYING = f"vllm-ascend's capture installed with the DP-padding trim of {TRIM}"


def capture_rule(capture: Code | None, worker_init: str | None, already_imported: bool = False) -> Verdict:
    """Decide from vllm-ascend's ``capture`` function (``None`` when the release lacks the module),
    the source of ``vllm_ascend/patch/worker/__init__.py`` and whether it is already imported."""
    if capture is None:
        return unsupported(f"module {CAPTURE}", "no such module")
    mismatch = params_mismatch(capture, CAPTURE_PARAMS, "capture", f"{CAPTURE}.capture")
    if mismatch:
        return mismatch
    if already_imported:
        return fixed_upstream(f"{CAPTURE} is already imported in this process and its capture is in effect")
    if worker_init is not None and imports_module_unconditionally(worker_init, CAPTURE):
        return fixed_upstream(f"{WORKER} imports {CAPTURE} unconditionally")
    return APPLY


def _read(path: str | None) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8") if path else None
    except OSError:  # no readable source (gone since import, or inside an archive): the rule sees none
        return None


def _source() -> tuple[bool, ModuleSource | None]:
    """Whether vllm-ascend's capture module is there, and its parsed source (``None`` without one)."""
    spec = importlib.util.find_spec(CAPTURE)  # the parent package is imported: nothing executes
    text = _read(getattr(spec, "origin", None)) if spec is not None else None
    return spec is not None, ModuleSource(text) if text is not None else None


def _check(site: Site) -> Verdict:
    present, source = _source()
    capture = source.code("capture") if source is not None else None
    if present and source is None:  # no source (.pyc only): trust presence
        capture = Code(None, CAPTURE_PARAMS)
    verdict = capture_rule(capture, _read(site.value), _in_effect())
    return Verdict("apply", CARRYING) if verdict.action == "apply" and _carries_trim(site, lambda: source) else verdict


def _carries_trim(site: Site, source: Callable[[], ModuleSource | None]) -> bool:
    """Whether the capture installed here carries the trim: its patch is enabled in this engine
    (still pending: it runs after this one on the same trigger; or yielded to this one, when this
    one is applied again) and its rule applies to vllm-ascend's capture (``source()``, read only then)."""
    record = site.handover.record(TRIM) if site.handover is not None else None
    if record is None or not (record.state == "pending" or _yielded_here(record.state, record.reason, site)):
        return False
    read = source()
    return read is not None and trim_rule(read.function_node("capture"), f"{CAPTURE}.capture").action == "apply"


def _yielded_here(state: str, reason: str, site: Site) -> bool:
    return state == "yielded" and site.patch.name in reason


def _in_effect() -> bool:
    """vllm-ascend's capture module was imported and its capture is the one vLLM's class holds
    (not after our undo left the module imported, nor under another owner's)."""
    module, capturer = sys.modules.get(CAPTURE), sys.modules.get(CAPTURER)
    held = own_value(getattr(capturer, "RoutedExpertsCapturer", None), "capture") if capturer else None
    return module is not None and held is getattr(module, "capture", object())


def _fix(site: Site) -> Undo:
    capturer = importlib.import_module(CAPTURER).RoutedExpertsCapturer
    original = own_value(capturer, "capture")
    # Importing the module assigns its capture (once: re-applied after an undo, it is cached).
    installed = importlib.import_module(CAPTURE).capture
    if _carries_trim(site, lambda: _source()[1]):
        installed = trimmed(installed)
    return set_marked(capturer, "capture", installed, site.patch.name, original)


def _static(tree: UpstreamTree) -> Verdict:
    module = tree.module(CAPTURE)
    worker = tree.module(WORKER)
    return capture_rule(module.code("capture") if module else None, worker.text if worker else None)


def _note(tree: UpstreamTree) -> str | None:
    """What a release without our target does instead (0.18: its own capturer patch)."""
    worker = tree.module(WORKER)
    if tree.module(CAPTURE) is not None or worker is None:
        return None
    if not imports_module_unconditionally(worker.text, OWN_CAPTURER):
        return None
    own = tree.module(OWN_CAPTURER)
    replaced = sorted(
        node.targets[0].attr
        for node in (own.tree.body if own else [])
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Attribute)
        and isinstance(node.targets[0].value, ast.Name)
        and node.targets[0].value.id == "RoutedExpertsCapturer"
    )
    what = f"RoutedExpertsCapturer.{', '.join(replaced)}" if replaced else "RoutedExpertsCapturer"
    return (
        f"this release ships no {CAPTURE}; its {WORKER} imports its own {OWN_CAPTURER} unconditionally, "
        f"which replaces {what} (capture stays vLLM's)"
    )


PATCHES = [
    Patch(
        name="ascend.routed_experts_capture",
        summary="Load vllm-ascend's DP/SP-aware RoutedExpertsCapturer.capture where the release does not import it.",
        reference="https://github.com/verl-project/verl/pull/7779",
        groups=("glm52", "ascend"),
        targets=(TARGET,),
        reach=Reach(triggers=(TRIGGER,)),
        default=False,
        check=_check,
        fix=_fix,
        static=StaticRule(
            _static, reads=(*WORKER_READS, "vllm_ascend/patch/worker/patch_routed_experts_capturer.py"), note=_note
        ),
    ),
]
