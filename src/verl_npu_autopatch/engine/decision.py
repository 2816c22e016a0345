"""One patch's decision, as functions of their inputs (no state, no wrapt). Before any target is
imported, its :class:`Plan` (:func:`plan`), from the configuration and installed metadata only
(shared by the engine and ``status``). When a target is imported, one pass (:func:`run`): resolve a
live variant, gate on the device, yield to another owner, recognise our own fix, check, fix."""

from __future__ import annotations

import sys

from verl_npu_autopatch.authoring.patching import describe, marked_by
from verl_npu_autopatch.authoring.spec import Site
from verl_npu_autopatch.engine import environment, ownership, text

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Mapping
    from types import ModuleType

    from verl_npu_autopatch.authoring.handover import HandOver
    from verl_npu_autopatch.authoring.spec import Patch, Target, Undo
    from verl_npu_autopatch.engine.catalog import Declared
    from verl_npu_autopatch.engine.config import Config
    from verl_npu_autopatch.engine.records import RecordState

__all__ = ["Outcome", "Plan", "first_failure", "initializing", "plan", "run"]


class Plan:
    """A patch's state before its target is imported (disabled, gated or pending), and the variants still in play."""

    def __init__(
        self, state: RecordState, reason: str, versions: dict[str, str | None], variants: tuple[Target, ...]
    ) -> None:
        self.state, self.reason, self.versions, self.variants = state, reason, versions, variants


def first_failure(
    requirements: tuple[str, ...],
    versions: dict[str, str | None],
    version_of: Callable[[str], str | None] | None = None,
) -> str:
    """Why the first unmet requirement fails ("" when all hold), filling ``versions`` with what was seen."""
    for requirement in requirements:
        holds, dist, version = environment.check_requirement(requirement, version_of)
        versions[dist] = version
        if not holds:
            if version is None:
                return f"needs {requirement}; {dist} is not installed"
            return f"needs {requirement}; found {dist} {version}"
    return ""


def plan(patch: Patch | Declared, config: Config, found: dict[str, bool] | None = None) -> Plan:
    """``patch``'s plan from configuration and installed metadata only; ``found`` caches which packages
    are findable across one activation (each look-up asks every finder)."""
    versions: dict[str, str | None] = {}
    found = {} if found is None else found
    disabled, enabled = config.named((patch.name, *patch.groups))
    if disabled:
        return Plan("disabled", "turned off by VERL_NPU_AUTOPATCH_DISABLE", versions, ())
    if not patch.default and not enabled:
        group = (*patch.groups, patch.name)[0]  # an opt-in patch's first group turns it on (else its name)
        return Plan("disabled", f"opt-in: enable with VERL_NPU_AUTOPATCH_ENABLE={group}", versions, ())
    failure = first_failure(patch.requires, versions)
    if failure:
        return Plan("gated", failure, versions, ())
    if patch.device == "npu-stack" and config.device != "npu" and not environment.npu_stack_installed():
        return Plan("gated", "needs the NPU stack (torch_npu)", versions, ())
    variants, failures = [], {}
    for target in patch.hooks:
        package = target.module.partition(".")[0]
        if package not in found:
            found[package] = environment.findable(package)
        failure = "" if found[package] else f"package {package} is not installed"
        failure = failure or first_failure(target.requires, versions)
        if failure:
            failures[str(target)] = failure
        else:
            variants.append(target)
    if not variants:
        distinct = set(failures.values())
        reason = distinct.pop() if len(distinct) == 1 else "; ".join(f"{t}: {f}" for t, f in failures.items())
        return Plan("gated", reason, versions, ())
    modules = " or ".join(dict.fromkeys(t.module for t in variants))
    return Plan("pending", f"waiting for {modules}", versions, tuple(variants))


class Outcome:
    """What one pass decided: ``state``, or ``pending`` (a variant's module is still to come);
    ``target``, the last variant resolved; ``site``, where an ``applied`` fix sits, and ``undo``, the
    fix's (``None`` when ours was already in place); ``rejected``: variants passed over, with their
    checks' reasons; ``stage`` and ``error``: the step that raised, for ``failed``."""

    def __init__(
        self,
        state: RecordState,
        reason: str = "",
        target: Target | None = None,
        site: Site | None = None,
        undo: Undo | None = None,
        rejected: dict[Target, str] | None = None,
        stage: str = "",
        error: Exception | None = None,
    ) -> None:
        self.state, self.reason, self.target, self.site, self.undo = state, reason, target, site, undo
        self.rejected: dict[Target, str] = {} if rejected is None else rejected
        self.stage, self.error = stage, error


def run(
    patch: Patch,
    variants: tuple[Target, ...],
    versions: Mapping[str, str | None],
    module: ModuleType | None,
    config: Config,
    *,
    absent: Collection[str] = (),
    handover: HandOver | None = None,
    npu_visible: Callable[[], bool] = environment.npu_device_visible,
) -> Outcome:
    """Decide and, when it applies, install ``patch`` on the first live variant of ``variants``
    (``module``: the module just imported, or ``None`` to conclude from ``sys.modules`` and
    ``absent``); a variant whose check says unsupported hands over to the next one. Never raises:
    an exception in a step is a ``failed`` outcome naming the step."""
    stage, target = "resolve", None
    rejected: dict[Target, str] = {}
    try:
        while True:
            stage = "resolve"
            site, missing = resolve(patch, variants, versions, module, rejected, absent, handover)
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
            placed = patch.reach.in_place is not None and patch.reach.in_place(site)
            if placed or marked_by(site.value) == patch.name or ownership.fixed_through_trigger(patch):
                return Outcome("applied", f"already in place ({describe(site.value)})", target, site, None, rejected)
            if ownership.in_place(patch):
                reason = f"already in place: no copy in {', '.join(patch.reach.copies_in)} holds a replaced value"
                return Outcome("applied", reason, target, site, None, rejected)
            stage = "check"
            verdict = patch.check(site) if patch.check is not None else None
            if verdict is not None and verdict.action == "unsupported":
                rejected[target] = verdict.reason
                continue
            if verdict is not None and verdict.action != "apply":
                return Outcome(verdict.action, verdict.reason, target, rejected=rejected)
            stage = "fix"
            undo = ownership.rebind(site, patch.fix(site))
            applied = "fix installed"
            if rejected:  # say which variant, and why the others were passed over
                position = f"variant {variants.index(target) + 1} of {len(variants)}"
                applied = f"fix installed on {position} ({target}); passed over: " + " | ".join(rejected.values())
            if verdict is not None and verdict.reason:  # e.g. which other owner's callable the fix replaces
                applied = f"{applied}; {verdict.reason}"
            return Outcome("applied", applied, target, site, undo, rejected)
    except Exception as exc:
        reason = f"{stage} raised {text.describe(exc)}"
        return Outcome("failed", reason, target, rejected=rejected, stage=stage, error=exc)


def resolve(
    patch: Patch,
    variants: tuple[Target, ...],
    versions: Mapping[str, str | None],
    module: ModuleType | None,
    rejected: Mapping[Target, str],
    absent: Collection[str] = (),
    handover: HandOver | None = None,
) -> tuple[Site | None, str | None]:
    """The site of the first variant in the live modules (``module`` standing for its own name) not
    ``rejected``; or ``(None, why-unsupported)`` once every variant was imported without it (or is
    ``absent``, or cannot exist) or was rejected; or ``(None, None)`` while some are still to come."""
    missing, waiting = [], False
    for target in variants:
        if target in rejected:
            continue
        live = sys.modules.get(target.module)
        if module is not None and target.module == module.__name__:
            live = module
        if live is None:
            if target.module in absent or known_absent(target.module):
                missing.append(f"{target} (module {target.module} does not exist)")
            else:
                waiting = True
            continue
        found = ownership.walk(live, target.qualname)
        if isinstance(found, str):
            missing.append(f"{target} ({found})")
            continue
        owner, value = found
        attribute = target.qualname.rpartition(".")[2]
        return Site(patch, target, live, owner, attribute, value, dict(versions), handover), None
    if waiting:
        return None, None
    if not missing:  # every variant present was rejected: their checks say why
        return None, " | ".join(rejected.values())
    why = "expected " + " or ".join(str(t) for t in variants) + "; found " + "; ".join(missing)
    return None, " | ".join([*rejected.values(), why])


def initializing(module: ModuleType | None) -> bool:
    """Whether ``module`` is in ``sys.modules`` but still executing."""
    try:
        return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))
    except Exception:  # another's object in sys.modules whose attributes raise (a lazy proxy): not executing
        return False


def known_absent(module: str) -> bool:
    """Whether submodule ``module`` cannot exist: its parent finished importing without it, or cannot exist."""
    parent = module.rpartition(".")[0]
    package = sys.modules.get(parent) if parent else None
    if package is None:
        return bool(parent) and known_absent(parent)
    if initializing(package):
        return False
    try:
        import importlib.util

        return importlib.util.find_spec(module) is None
    except KeyboardInterrupt:
        raise
    except BaseException:  # a finder that raises (pytest.fail's is a BaseException): the module may exist
        return False
