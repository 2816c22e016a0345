"""The per-patch decision pipeline, as one function of its inputs: resolve a variant, gate on the
device, yield to another owner, recognise our own fix, check, fix. It keeps no state and needs no
wrapt; the engine records its :class:`Outcome` (see ``_installed.Installations.apply``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_npu_autopatch import _copies, _environment, ownership
from verl_npu_autopatch._resolution import resolve
from verl_npu_autopatch.patching import describe, marked_by

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Mapping
    from types import ModuleType

    from verl_npu_autopatch._config import Config
    from verl_npu_autopatch.handover import HandOver
    from verl_npu_autopatch.records import RecordState
    from verl_npu_autopatch.spec import Patch, Site, Target, Undo

__all__ = ["Outcome", "run"]


@dataclass
class Outcome:
    """What one pass of the pipeline decided.

    ``state`` is the record's new state, or ``pending`` (nothing decided: a variant's module is
    still to come). ``target`` is the last variant resolved (``None``: none was). ``site`` is
    where an ``applied`` fix sits and ``undo`` the undo the fix returned (``None`` when our fix
    was already in place). ``rejected``: variants passed over, with their checks' reasons.
    ``stage`` and ``error``: the step that raised, for ``failed``.
    """

    state: RecordState
    reason: str = ""
    target: Target | None = None
    site: Site | None = None
    undo: Undo | None = None
    rejected: dict[Target, str] = field(default_factory=dict)
    stage: str = ""
    error: Exception | None = None


def run(
    patch: Patch,
    variants: tuple[Target, ...],
    versions: Mapping[str, str | None],
    module: ModuleType | None,
    config: Config,
    *,
    absent: Collection[str] = (),
    engine: HandOver | None = None,
    npu_visible: Callable[[], bool] = _environment.npu_device_visible,
) -> Outcome:
    """Decide and, when it applies, install ``patch`` on the first live variant of ``variants``
    (``module``: the module just imported, or ``None`` to conclude from ``sys.modules`` and
    ``absent``). A variant whose check says unsupported hands over to the next one present.
    Never raises: an exception in a step is a ``failed`` outcome naming the step."""
    stage, target = "resolve", None
    rejected: dict[Target, str] = {}
    try:
        while True:
            stage = "resolve"
            site, missing = resolve(patch, variants, versions, module, rejected, absent, engine)
            if site is None:
                if missing is None:
                    return Outcome("pending", target=target, rejected=rejected)
                return Outcome("unsupported", missing, target, rejected=rejected)
            target = site.target
            stage = "gate"
            if patch.device == "npu-device" and config.device != "npu" and not npu_visible():
                return Outcome("gated", "needs a visible NPU device", target, rejected=rejected)
            owner = ownership.detect(patch, site)
            yielded = f"target owned by {owner}" if owner else ownership.enclosing_owner(patch, site)
            if yielded:
                return Outcome("yielded", yielded, target, rejected=rejected)
            if marked_by(site.value) == patch.name or ownership.fixed_through_trigger(patch):
                return Outcome("applied", f"already in place ({describe(site.value)})", target, site, None, rejected)
            if _copies.in_place(patch):
                reason = f"already in place: no copy in {', '.join(patch.copies)} holds a replaced value"
                return Outcome("applied", reason, target, site, None, rejected)
            stage = "check"
            verdict = patch.check(site) if patch.check is not None else None
            if verdict is not None and verdict.action == "unsupported":
                rejected[target] = verdict.reason
                continue
            if verdict is not None and verdict.action != "apply":
                return Outcome(verdict.action, verdict.reason, target, rejected=rejected)
            stage = "fix"
            undo = _copies.rebind(site, patch.fix(site))
            applied = _installed_reason(variants, target, rejected)
            if verdict is not None and verdict.reason:  # e.g. which other owner's callable the fix replaces
                applied = f"{applied}; {verdict.reason}"
            return Outcome("applied", applied, target, site, undo, rejected)
    except Exception as exc:
        reason = f"{stage} raised {type(exc).__name__}: {exc}"
        return Outcome("failed", reason, target, rejected=rejected, stage=stage, error=exc)


def _installed_reason(variants: tuple[Target, ...], target: Target, rejected: Mapping[Target, str]) -> str:
    """``fix installed``; after a passed-over variant, also which variant and why the others were
    passed over (the record's ``target`` always names the variant applied)."""
    if not rejected:
        return "fix installed"
    position = f"variant {variants.index(target) + 1} of {len(variants)}"
    return f"fix installed on {position} ({target}); passed over: " + " | ".join(rejected.values())
