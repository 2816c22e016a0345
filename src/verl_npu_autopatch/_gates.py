"""Decisions made before any target is imported: for each patch, is it disabled, gated, or
pending on which target variants. Shared by the engine and ``status``; whether the engine is
active here at all is ``_environment.device_decision``."""

from __future__ import annotations

from verl_npu_autopatch import _environment

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from verl_npu_autopatch._config import Config
    from verl_npu_autopatch.records import RecordState
    from verl_npu_autopatch.spec import Patch, Target


class Plan:
    """A patch's state before its target is imported, and the variants still in play."""

    __slots__ = ("reason", "state", "variants", "versions")

    def __init__(self, state: RecordState, reason: str, versions: dict[str, str | None], variants: tuple[Target, ...]):
        self.state = state
        self.reason = reason
        self.versions = versions
        self.variants = variants


def _gate_reason(requirement: str, dist: str, version: str | None) -> str:
    if version is None:
        return f"needs {requirement}; {dist} is not installed"
    return f"needs {requirement}; found {dist} {version}"


def first_failure(
    requirements: tuple[str, ...],
    versions: dict[str, str | None],
    version_of: Callable[[str], str | None] | None = None,
) -> str:
    """Why the first unmet requirement fails ("" when all hold); fills ``versions`` with what
    was seen. ``version_of`` replaces the installed metadata (see ``_environment.check_requirement``)."""
    for requirement in requirements:
        holds, dist, version = _environment.check_requirement(requirement, version_of)
        versions[dist] = version
        if not holds:
            return _gate_reason(requirement, dist, version)
    return ""


def plan(patch: Patch, config: Config) -> Plan:
    """Decide ``disabled`` / ``gated`` / ``pending`` for ``patch`` from configuration and
    installed metadata only."""
    versions: dict[str, str | None] = {}
    keys = {patch.name, *patch.groups}
    if keys & config.disable:
        return Plan("disabled", "turned off by VERL_NPU_AUTOPATCH_DISABLE", versions, ())
    if not patch.default and not keys & config.enable:
        return Plan("disabled", "opt-in: enable with VERL_NPU_AUTOPATCH_ENABLE", versions, ())
    failure = first_failure(patch.requires, versions)
    if failure:
        return Plan("gated", failure, versions, ())
    if patch.device == "npu-stack" and config.device != "npu" and not _environment.npu_stack_installed():
        return Plan("gated", "needs the NPU stack (torch_npu)", versions, ())
    variants, failures = [], {}
    for target in patch.hooks:
        package = target.module.partition(".")[0]
        failure = "" if _environment.findable(package) else f"package {package} is not installed"
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
