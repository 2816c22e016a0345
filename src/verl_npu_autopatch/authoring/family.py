"""The shape most families share, written once: a patch deciding with one pure rule over the target's
code (live for ``check``, a release's source for the decision table) and fixing by wrapping the
target method; a family writes only its rule (:func:`decides`), its wrapper (:func:`around`), its words."""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl_npu_autopatch.authoring.fingerprints import Code, UpstreamTree, takes
from verl_npu_autopatch.authoring.patching import chain, replace_method
from verl_npu_autopatch.authoring.spec import Patch, Site, StaticRule, Target, Undo, Verdict, unsupported

__all__ = [
    "RECIPE",
    "TargetRule",
    "around",
    "code_check",
    "copied_into",
    "copies_only",
    "decides",
    "module_file",
    "rule_patch",
    "wrapping_fix",
    "wrapping_patch",
]

#: The reference of the fixes carried from verl-ascend-recipe's patch collection.
RECIPE = "https://github.com/verl-project/verl-ascend-recipe"
#: Makes the replacement of the target method from the site and upstream's plain function.
Wrap = Callable[[Site, Callable[..., Any]], Callable[..., Any]]


@dataclass(frozen=True)
class TargetRule:
    """A rule bound to the target it decides on (:func:`decides`) and the code it reads beside it
    (``reading``: each passed after the target's code, ``None`` where absent); called like the rule."""

    target: Target
    decide: Callable[..., Verdict]
    reading: tuple[Target, ...] = ()

    def __call__(self, code: Code, *others: Code | None) -> Verdict:
        return self.decide(code, *others)

    def live(self, value: Any) -> Verdict:
        """The rule on the live target ``value`` and the live code it reads beside it."""
        return self.decide(Code.live(value), *map(_live_code, self.reading))

    def judge(self, tree: UpstreamTree) -> Verdict:
        """The rule on a release's source of the target and of the code it reads beside it."""
        others = [tree.code(t.module, t.qualname) for t in self.reading]
        return tree.judge(self.target.module, self.target.qualname, lambda code: self.decide(code, *others))


def _live_code(target: Target) -> Code | None:
    """``Code`` of ``target`` as it is live (its module imported if it is not yet), or ``None``."""
    try:
        value: Any = importlib.import_module(target.module)
    except ImportError:  # a release without the module: the rule says what its absence means
        return None
    for part in target.qualname.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return Code.live(value)


def decides(
    target: str, params: tuple[str, ...] | None = None, reading: tuple[str, ...] = ()
) -> Callable[[Callable[..., Verdict]], TargetRule]:
    """Binds the decorated rule to ``target`` (``module:Class.method``) and the code it reads beside
    it (``reading``, the same form); with ``params`` (``()`` too), code taking other parameters is
    ``unsupported`` naming both signatures (:func:`~.fingerprints.takes`)."""
    parsed, others = Target.parse(target), tuple(map(Target.parse, reading))

    def bind(rule: Callable[..., Verdict]) -> TargetRule:
        checked = rule if params is None else takes(parsed.qualname.rpartition(".")[2], params)(rule)
        return TargetRule(parsed, checked, others)

    return bind


def around(advice: Callable[..., Any]) -> Wrap:
    """The ``wrap`` of a replacement calling ``advice(original, *args, **kwargs)``, with the original's
    metadata (``functools.wraps``); an ``async`` advice makes an ``async`` replacement."""

    def wrap(site: Site, original: Callable[..., Any]) -> Callable[..., Any]:
        async def waited(*args: Any, **kwargs: Any) -> Any:
            return await advice(original, *args, **kwargs)

        def called(*args: Any, **kwargs: Any) -> Any:
            return advice(original, *args, **kwargs)

        return functools.wraps(original)(waited if inspect.iscoroutinefunction(advice) else called)

    return wrap


def code_check(rule: Callable[[Code], Verdict], needs: str | None = None) -> Callable[[Site], Verdict]:
    """``check``: ``rule`` on the live target's code; where it applies and the fix uses the target
    module's global ``needs``, a module without it is ``unsupported``."""

    def check(site: Site) -> Verdict:
        verdict = rule.live(site.value) if isinstance(rule, TargetRule) else rule(Code.live(site.value))
        if needs and verdict.action == "apply" and getattr(site.module, needs, None) is None:
            return unsupported(f"{site.target.module}.{needs}", "none")
        return verdict

    return check


def wrapping_fix(wrap: Wrap) -> Callable[[Site], Undo]:
    """``fix``: replace the target method by ``wrap(site, original)``, marked, with its undo."""
    return lambda site: replace_method(site.owner, site.attribute, lambda f: wrap(site, f), site.patch.name)


def wrapping_patch(name: str, summary: str, *, rule: TargetRule, wrap: Wrap, **spec: Any) -> Patch:
    """A :func:`rule_patch` whose fix replaces the target method by ``wrap(site, original)``."""
    return rule_patch(name, summary, rule=rule, fix=wrapping_fix(wrap), **spec)


def rule_patch(
    name: str,
    summary: str,
    *,
    rule: TargetRule,
    fix: Callable[[Site], Undo],
    opt_in: str | None = None,
    needs: str | None = None,
    reads: tuple[str, ...] | None = None,
    copying_modules: tuple[str, ...] = (),
    static: Callable[[UpstreamTree], Verdict] | None = None,
    note: Callable[[UpstreamTree], str | None] | None = None,
    **spec: Any,
) -> Patch:
    """A :class:`Patch` on the target ``rule`` decides on: checked by it on the live code, fixed by
    ``fix``, decided on a release's files by ``static`` (default: ``rule``); ``opt_in``, ``needs``,
    ``reads``, ``copying_modules`` and ``note``: docs/writing-a-patch.md; ``spec``: the other fields."""
    target = rule.target
    modules = (target.module, *(t.module for t in rule.reading), *copying_modules)
    family = name.partition(".")[0]
    spec.setdefault("groups", (opt_in, family) if opt_in else (family,))

    def judged(tree: UpstreamTree) -> Verdict:  # the check's decision on a release's source
        verdict, source = rule.judge(tree), tree.module(target.module)
        if needs and verdict.action == "apply" and (source is None or not source.binds(needs)):
            return unsupported(f"{target.module}.{needs}", "none")
        return verdict

    def copied(tree: UpstreamTree) -> str | None:
        found = copied_into(tree, copying_modules, target)
        return f"copied by `from ... import` into {', '.join(found)}" if found else None

    return Patch(
        name=name,
        summary=summary,
        targets=(target,),
        check=code_check(rule, needs),
        fix=fix,
        default=opt_in is None,
        static=StaticRule(
            static or judged,
            reads=reads or tuple(dict.fromkeys(map(module_file, modules))),
            note=note or (copied if copying_modules else None),
        ),
        **spec,
    )


def module_file(module: str) -> str:
    """Where a release holds ``module`` (a plain module, not a package): ``a/b/c.py``."""
    return f"{module.replace('.', '/')}.py"


def copied_into(tree: UpstreamTree, copying_modules: tuple[str, ...], target: Target) -> list[str]:
    """Which of ``copying_modules`` take ``target`` (module-level) by ``from ... import`` in a release."""
    found = ((name, tree.module(name)) for name in copying_modules)
    return [name for name, source in found if source and source.imports_from(target.module, target.qualname)]


def copies_only(site: Site) -> Undo:
    """``fix`` of a patch whose whole change is the engine's rebinding of the copies another owner
    left stale (``Reach.stale_values``, which undoes itself): nothing else to change or undo."""
    return chain()
