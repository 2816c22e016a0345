"""The declarative patch spec: everything a patch touches, when it may run, how it checks and fixes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    from verl_npu_autopatch.authoring.handover import HandOver

__all__ = [
    "APPLY",
    "ComputedSites",
    "Device",
    "Patch",
    "Reach",
    "Site",
    "StaticRule",
    "Target",
    "Undo",
    "Verdict",
    "fixed_upstream",
    "unsupported",
]

#: Undoes a fix. Returned by every ``fix``.
Undo = Callable[[], None]

#: Device requirement of a patch.
#: ``npu-stack``: torch_npu is installed; ``npu-device``: an NPU is visible (checked lazily, at
#: the target's import); ``any``: no requirement. ``VERL_NPU_AUTOPATCH_DEVICE=npu`` passes all.
Device = Literal["npu-stack", "npu-device", "any"]


class Target(NamedTuple):
    """One place a patch applies to: ``module:qualname``, optionally only for some versions.

    ``requires`` holds distribution specifiers (``"vllm>=0.24"``) that must hold for this variant
    to be considered; a patch with several variants uses the first one found in the live module.
    """

    module: str
    qualname: str
    requires: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str, *requires: str) -> Target:
        """``Target.parse("pkg.mod:Cls.meth", "vllm>=0.24")``."""
        module, sep, qualname = text.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"target must look like 'package.module:Qualified.name', got {text!r}")
        return cls(module, qualname, tuple(requires))

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"


class Verdict(NamedTuple):
    """What a patch's ``check`` decided about the live target."""

    action: Literal["apply", "fixed-upstream", "unsupported"]
    reason: str = ""


APPLY = Verdict("apply")


def fixed_upstream(reason: str) -> Verdict:
    """The installed upstream code already contains the fix; ``reason`` says how we know."""
    return Verdict("fixed-upstream", reason)


def unsupported(expected: str, found: str) -> Verdict:
    """The live target does not look like the code the fix was written for."""
    return Verdict("unsupported", f"expected {expected}; found {found}")


class StaticRule:
    """A patch's decision on a release's source, read and never executed (``scripts/compat-matrix``).

    ``decide(tree)`` takes an ``UpstreamTree`` (``patches/_fingerprints.py``) and returns the
    ``Verdict`` the live ``check`` would; ``reads`` names the upstream files it reads, as laid out in
    the installed packages (``"vllm/v1/engine/core.py"``); ``note(tree)`` optionally adds what a
    user needs to know about a release whatever the state (or returns ``None``). ``also`` holds
    the rules over another project's files the live check consults as well (torch's own code, for a
    patch of megatron-core or torch_npu): the table decides each on that project's releases.
    """

    __slots__ = ("also", "decide", "note", "reads")

    def __init__(
        self,
        decide: Callable[[Any], Verdict],
        reads: tuple[str, ...],
        note: Callable[[Any], str | None] | None = None,
        also: tuple[StaticRule, ...] = (),
    ) -> None:
        if not reads or any(not f.endswith(".py") or f.startswith("/") for f in reads):
            raise ValueError(f"StaticRule.reads must name upstream .py files by relative path, got {reads!r}")
        self.decide, self.reads, self.note, self.also = decide, reads, note, also

    def rules(self) -> tuple[StaticRule, ...]:
        """This rule, then every rule of ``also``."""
        return (self, *self.also)


class ComputedSites(NamedTuple):
    """A family of further sites a fix changes, known only from the live module: ``find(module)``
    names them in ``module`` (the imported module called ``module``), each an attribute path
    (``"apply_liger_kernel_to_qwen3"``) or a dict entry (``"MODEL_TYPE_TO_APPLY_LIGER_FN[qwen3]"``);
    ``pattern`` is how ``list``, ``status`` and docs/patches.md show the family."""

    module: str
    pattern: str
    find: Callable[[ModuleType], tuple[str, ...]]

    def __str__(self) -> str:
        return f"{self.module}:{self.pattern}"


class Site(NamedTuple):
    """The live target a patch is about to check and fix.

    ``owner`` holds the attribute named ``attribute`` (a class or the module itself); ``value`` is
    the raw attribute as stored on the owner (so a ``staticmethod`` object stays one),
    ``versions`` maps the distributions the patch gates on to their installed versions, and
    ``handover`` is what the fix may ask of the engine applying it (:class:`HandOver`: for fixes that
    arbitrate with other patches; ``engine``, its former name, still reads it).
    """

    patch: Patch
    target: Target
    module: ModuleType
    owner: Any
    attribute: str
    value: Any
    versions: Mapping[str, str | None] = MappingProxyType({})
    handover: HandOver | None = None

    @property
    def engine(self) -> HandOver | None:
        """The former name of :attr:`handover`, kept for one release."""
        return self.handover


@dataclass(frozen=True, init=False)
class Reach:
    """Where a patch reaches beyond its targets: rare, each optional, each shown by ``status`` and
    docs/patches.md.

    ``triggers``: places whose import runs the patch but which it does not change (the engine hooks
    and resolves the ``Site`` on them instead; e.g. a package's ``__file__``). ``secondary``:
    further attributes the fix replaces; ``computed``: further families of them found in the live
    module. ``via``: enclosing callables the target is only reached through (experts through the
    MoE block's forward): another owner holding one makes the record ``yielded`` or ``superseded``.
    ``copies_in``: packages whose modules may hold copies of a module-level target taken with
    ``from ... import``: the engine rebinds each to the fix's value and restores it on revert.
    ``stale_values()``: for targets another owner replaced, the value each held before, which
    earlier copies still hold; the engine rebinds those copies to the live value (the targets are
    then the copies' sources, not sites). ``in_place(site)``: for a fix that leaves no mark on its
    target (``computed`` sites), whether it is live already (decided again: ``already in place``).
    """

    triggers: tuple[Target, ...] = ()
    secondary: tuple[Target, ...] = ()
    computed: tuple[ComputedSites, ...] = ()
    via: tuple[Target, ...] = ()
    copies_in: tuple[str, ...] = ()
    stale_values: Callable[[], dict[Target, Any]] | None = None
    in_place: Callable[[Site], bool] | None = None

    def __init__(
        self,
        triggers: tuple[Target, ...] = (),
        secondary: tuple[Target, ...] = (),
        computed: tuple[ComputedSites, ...] = (),
        via: tuple[Target, ...] = (),
        copies_in: tuple[str, ...] = (),
        stale_values: Callable[[], dict[Target, Any]] | None = None,
        in_place: Callable[[Site], bool] | None = None,
    ) -> None:
        # Written out, as Patch's is: a generated one costs every activation its compilation.
        if stale_values is not None and not copies_in:
            raise ValueError("Reach.stale_values is declared for copies only (copies_in)")
        values = (triggers, secondary, computed, via, copies_in, stale_values, in_place)
        for key, value in zip(_REACH_FIELDS, values, strict=True):
            object.__setattr__(self, key, value)


_REACH_FIELDS = tuple(Reach.__dataclass_fields__)

#: The empty reach: a patch that changes its targets alone.
NO_REACH = Reach()

#: The keyword arguments of ``Patch`` before 0.2, now fields of :class:`Reach` (accepted, with a
#: ``DeprecationWarning``, for one release).
_FORMER = {
    "triggers": "triggers",
    "secondary": "secondary",
    "computed": "computed",
    "via": "via",
    "copies": "copies_in",
    "stale": "stale_values",
    "in_place": "in_place",
}


@dataclass(frozen=True, init=False, repr=False)
class Patch:
    """A runtime fix and everything the engine needs to decide whether and where to apply it.

    ``targets``: where it applies (variants: the first found live is used). ``check(site)``
    inspects the live target and returns ``APPLY``, ``fixed_upstream(...)`` or ``unsupported(...)``;
    ``fix(site)`` applies the fix and returns an ``Undo``. ``groups``, ``default`` (off: opt-in),
    ``requires`` (distribution specifiers), ``device`` and ``reference`` decide and explain when it
    runs. ``yields_to``: detectors naming another owner of the target (Liger-Kernel, verl), which
    the patch then leaves alone (``yielded``). ``static``: its rule on a release's source, for the
    decision table. ``reach``: the rare rest (:class:`Reach`). ``defined_at`` (``path.py:line``)
    is filled in when the patch is made: the family's (or plugin's) line, past the kit's helpers.
    """

    name: str
    summary: str
    targets: tuple[Target, ...]
    fix: Callable[[Site], Undo]
    check: Callable[[Site], Verdict] | None = None
    groups: tuple[str, ...] = ()
    reference: str = ""
    requires: tuple[str, ...] = ()
    device: Device = "npu-stack"
    default: bool = True
    yields_to: tuple[Callable[[Site], str | None], ...] = ()
    static: StaticRule | None = None
    reach: Reach = NO_REACH
    defined_at: str = field(default="", compare=False)

    def __init__(
        self,
        name: str,
        summary: str,
        targets: tuple[Target, ...],
        fix: Callable[[Site], Undo],
        check: Callable[[Site], Verdict] | None = None,
        groups: tuple[str, ...] = (),
        reference: str = "",
        requires: tuple[str, ...] = (),
        device: Device = "npu-stack",
        default: bool = True,
        yields_to: tuple[Callable[[Site], str | None], ...] = (),
        static: StaticRule | None = None,
        reach: Reach = NO_REACH,
        defined_at: str = "",
        **former: Any,
    ) -> None:
        # Written out: a generated ``__init__`` costs every activation its compilation (0.3 ms).
        # ``former``: the keywords of before 0.2 (``_FORMER``), accepted with a warning for one release.
        if former:
            reach = _former_reach(former)
        if not name or " " in name:
            raise ValueError(f"patch name must be a dotted word, got {name!r}")
        if not targets:
            raise ValueError(f"patch {name} has no targets")
        if reach.copies_in and any("." in t.qualname for t in targets):
            raise ValueError(f"patch {name}: copies are rebound for module-level targets only")
        if device not in ("npu-stack", "npu-device", "any"):
            raise ValueError(f"patch {name}: unknown device requirement {device!r}")
        made = defined_at or _maker()
        values = (name, summary, targets, fix, check, groups, reference, requires, device, default, yields_to)
        for key, value in zip(_PATCH_FIELDS, (*values, static, reach, made), strict=True):
            object.__setattr__(self, key, value)

    def __repr__(self) -> str:
        return f"Patch({self.name!r})"

    @property
    def hooks(self) -> tuple[Target, ...]:
        """Where the engine hooks and resolves the site, in variant order: the triggers when the
        patch declares any, else its targets."""
        return self.reach.triggers or self.targets

    def touches(self) -> tuple[Target, ...]:
        """Every place the patch declares: hooks first, then targets and secondary sites."""
        return tuple(dict.fromkeys((*self.reach.triggers, *self.targets, *self.reach.secondary)))


_PATCH_FIELDS = tuple(Patch.__dataclass_fields__)


def _former_reach(former: dict[str, Any]) -> Reach:
    """The :class:`Reach` that ``Patch``'s keyword arguments of before 0.2 (``_FORMER``) declare."""
    unknown = sorted(set(former) - set(_FORMER))
    if unknown:
        raise TypeError(f"Patch.__init__() got an unexpected keyword argument {unknown[0]!r}")
    import warnings

    moved = ", ".join(f"{key}= -> reach=Reach({_FORMER[key]}=...)" for key in former)
    warnings.warn(f"Patch({moved}): the rare fields moved into Reach", DeprecationWarning, stacklevel=3)
    return Reach(**{_FORMER[key]: value for key, value in former.items()})


def _maker() -> str:
    """``path.py:line`` of the code making a :class:`Patch` (the first frame outside this module
    and the ``patches/_*.py`` helpers), the path as deep as its module's dotted name."""
    frame = sys._getframe(2)  # _maker <- Patch.__init__ <- its caller
    while frame.f_back is not None and _builder(frame.f_globals.get("__name__") or ""):
        frame = frame.f_back
    path = frame.f_code.co_filename.replace("\\", "/").split("/")
    name = frame.f_globals.get("__name__") or ""
    depth = name.count(".") + 1 + (path[-1] == "__init__.py")
    return f"{'/'.join(path[-depth:])}:{frame.f_lineno}"


def _builder(module: str) -> bool:
    """Whether ``module`` makes patches for others: the authoring kit or a family helper
    (``verl_npu_autopatch.patches._*``)."""
    return module.startswith(("verl_npu_autopatch.authoring.", "verl_npu_autopatch.patches._"))
