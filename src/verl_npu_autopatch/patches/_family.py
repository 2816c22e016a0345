"""The shape most families share, written once: a patch that decides with one pure rule over the
target's code (the live callable for ``check``, a release's source for the decision table) and
fixes by wrapping the target method.

A family then writes only what is its own: the rule (``Code`` -> ``Verdict``), the wrapper
(``wrap(site, original)`` -> the replacement) and the spec's words. A patch whose only change is
the engine's rebinding of stale copies (``Patch.stale``) takes :func:`copies_only` as its fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.patches._fingerprints import Code, UpstreamTree
from verl_npu_autopatch.patching import replace_method
from verl_npu_autopatch.spec import Patch, Site, StaticRule, Target, Undo, Verdict

__all__ = ["Rule", "Wrap", "code_check", "copies_only", "judged", "wrapping_fix", "wrapping_patch"]

#: A family's decision on the target's code.
Rule = Callable[[Code], Verdict]
#: Makes the replacement of the target method from the site and upstream's plain function.
Wrap = Callable[[Site, Callable[..., Any]], Callable[..., Any]]


def code_check(rule: Rule) -> Callable[[Site], Verdict]:
    """``check``: ``rule`` on the live target's code."""

    def check(site: Site) -> Verdict:
        return rule(Code.live(site.value))

    return check


def wrapping_fix(wrap: Wrap) -> Callable[[Site], Undo]:
    """``fix``: replace the target method by ``wrap(site, original)``, marked, with its undo."""

    def fix(site: Site) -> Undo:
        return replace_method(site.owner, site.attribute, lambda original: wrap(site, original), site.patch.name)

    return fix


def judged(target: Target, rule: Rule) -> Callable[[UpstreamTree], Verdict]:
    """The static rule: ``rule`` on ``target`` as a release's source defines it."""

    def static(tree: UpstreamTree) -> Verdict:
        return tree.judge(target.module, target.qualname, rule)

    return static


def wrapping_patch(
    name: str,
    summary: str,
    *,
    target: str,
    rule: Rule,
    wrap: Wrap,
    reads: tuple[str, ...],
    static: Callable[[UpstreamTree], Verdict] | None = None,
    **spec: Any,
) -> Patch:
    """A :class:`Patch` of the common shape on ``target`` (``module:Class.method``): checked by
    ``rule`` on the live code, fixed by ``wrap``, decided on a release's files ``reads`` by
    ``static`` (default: ``rule`` on the target's source); ``spec`` holds the other fields."""
    parsed = Target.parse(target)
    return Patch(
        name=name,
        summary=summary,
        targets=(parsed,),
        check=code_check(rule),
        fix=wrapping_fix(wrap),
        static=StaticRule(static or judged(parsed, rule), reads=reads),
        **spec,
    )


def copies_only(site: Site) -> Undo:
    """``fix`` of a patch whose whole change is the engine's rebinding of the copies another owner
    left stale (``Patch.stale``): nothing else to change, nothing else to undo."""
    return _nothing


def _nothing() -> None:
    """The undo of :func:`copies_only` (the engine's rebinding carries its own)."""
