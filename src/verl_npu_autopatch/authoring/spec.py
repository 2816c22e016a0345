"""The declarative patch spec: everything a patch touches, when it may run, how it checks and fixes.

No ``from __future__ import annotations``: a ``NamedTuple`` compiles each string annotation (a
``ForwardRef``) as its class is made, at every activation; only the forward references are quoted."""

import sys
from collections.abc import Callable, Mapping
from dataclasses import FrozenInstanceError, dataclass, field
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
#: ``npu-stack``: torch_npu is installed; ``npu-device``: an NPU is visible (checked at the target's
#: import); ``any``: no requirement. ``VERL_NPU_AUTOPATCH_DEVICE=npu`` passes all.
Device = Literal["npu-stack", "npu-device", "any"]


class Target(NamedTuple):
    """``module:qualname`` a patch applies to, for the versions ``requires`` (``"vllm>=0.24"``) admits."""

    module: str
    qualname: str
    requires: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str, *requires: str) -> "Target":
        """``Target.parse("pkg.mod:Cls.meth", "vllm>=0.24")``."""
        module, sep, qualname = text.partition(":")
        if not (sep and module and qualname):
            raise ValueError(f"target must look like 'package.module:Qualified.name', got {text!r}")
        return cls(module, qualname, requires)

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
    """A patch's decision on a release's source (``decide(tree)``: the ``Verdict`` the live ``check``
    would), the files it ``reads``, a ``note`` and the rules over another project's files it consults
    ``also`` (docs/writing-a-patch.md, "In the decision table")."""

    __slots__ = ("also", "decide", "note", "reads")

    def __init__(
        self,
        decide: Callable[[Any], Verdict],
        reads: tuple[str, ...],
        note: Callable[[Any], str | None] | None = None,
        also: "tuple[StaticRule, ...]" = (),
    ) -> None:
        if not reads or any(not f.endswith(".py") or f.startswith("/") for f in reads):
            raise ValueError(f"StaticRule.reads must name upstream .py files by relative path, got {reads!r}")
        self.decide, self.reads, self.note, self.also = decide, reads, note, also

    def rules(self) -> "tuple[StaticRule, ...]":
        """This rule, then every rule of ``also``."""
        return (self, *self.also)


class ComputedSites(NamedTuple):
    """Further sites a fix changes that ``find(module)`` names in the live ``module`` (``"attr.path"``,
    ``"TABLE[key]"``); ``pattern`` is how ``list`` and the docs show them."""

    module: str
    pattern: str
    find: Callable[[ModuleType], tuple[str, ...]]

    def __str__(self) -> str:
        return f"{self.module}:{self.pattern}"


class Site(NamedTuple):
    """The live target a patch is about to check and fix: ``owner`` holds the raw ``value`` of
    ``attribute``; ``versions``: the gated distributions' versions; ``handover``: :class:`HandOver`."""

    patch: "Patch"
    target: Target
    module: ModuleType
    owner: Any
    attribute: str
    value: Any
    versions: Mapping[str, str | None] = MappingProxyType({})
    handover: "HandOver | None" = None

    @property
    def engine(self) -> "HandOver | None":
        """The former name of :attr:`handover`, kept for one release."""
        return self.handover


class _Frozen:
    """A frozen dataclass's behaviour written out (equal by the compared fields, hashed by them,
    never assigned to): ``dataclass(frozen=True)`` compiles five methods per class at every activation."""

    __slots__ = ()
    _compared = tuple[str, ...]()  # the compared fields (:func:`_frozen`); unannotated: no type hint

    def _key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._compared)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._compared)
        return f"{type(self).__name__}({shown})"

    def __hash__(self) -> int:
        return hash(self._key())

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")


@dataclass(init=False, eq=False, repr=False)
class Reach(_Frozen):
    """Where a patch reaches beyond its targets, each field optional and rare (docs/writing-a-patch.md,
    "Everything a patch touches")."""

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
        self.__dict__.update(zip(_REACH_FIELDS, values, strict=True))


def _frozen(cls: type[_Frozen]) -> tuple[str, ...]:
    """``cls``'s field names, in order, after noting which it compares and telling ``dataclasses``
    it is frozen (a subclass must then be frozen too, as of a generated frozen dataclass)."""
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    cls._compared = tuple(name for name, found in fields.items() if found.compare)
    cls.__dataclass_params__.frozen = True  # type: ignore[attr-defined]
    return tuple(fields)


_REACH_FIELDS = _frozen(Reach)
#: The empty reach: a patch that changes its targets alone.
NO_REACH = Reach()
#: ``Patch``'s keywords of before 0.2, now the fields of :class:`Reach` in order (one more release).
_FORMER = dict(
    zip(("triggers", "secondary", "computed", "via", "copies", "stale", "in_place"), _REACH_FIELDS, strict=True)
)


@dataclass(init=False, eq=False, repr=False)
class Patch(_Frozen):
    """A runtime fix and what the engine needs to decide whether and where to apply it (the fields:
    docs/writing-a-patch.md); ``defined_at`` (``path.py:line``) is where the family or plugin made it."""

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
        # Written out: a generated one costs every activation its compilation (0.3 ms).
        if former:  # the keywords of before 0.2 (_FORMER)
            reach = _former_reach(former)
        if not name or " " in name:
            raise ValueError(f"patch name must be a dotted word, got {name!r}")
        if not targets:
            raise ValueError(f"patch {name} has no targets")
        if reach.copies_in and any("." in t.qualname for t in targets):
            raise ValueError(f"patch {name}: copies are rebound for module-level targets only")
        if device not in ("npu-stack", "npu-device", "any"):
            raise ValueError(f"patch {name}: unknown device requirement {device!r}")
        values = (name, summary, targets, fix, check, groups, reference, requires, device, default, yields_to)
        self.__dict__.update(zip(_PATCH_FIELDS, (*values, static, reach, defined_at or _maker()), strict=True))

    def __repr__(self) -> str:
        return f"Patch({self.name!r})"

    @property
    def hooks(self) -> tuple[Target, ...]:
        """Where the engine hooks and resolves the site: the triggers, if any, else the targets."""
        return self.reach.triggers or self.targets

    def touches(self) -> tuple[Target, ...]:
        """Every place the patch declares: hooks first, then targets and secondary sites."""
        return tuple(dict.fromkeys((*self.reach.triggers, *self.targets, *self.reach.secondary)))


_PATCH_FIELDS = _frozen(Patch)


def _former_reach(former: dict[str, Any]) -> Reach:
    """The :class:`Reach` ``Patch``'s keywords of before 0.2 declare, with a ``DeprecationWarning``."""
    unknown = sorted(set(former) - set(_FORMER))
    if unknown:
        raise TypeError(f"Patch.__init__() got an unexpected keyword argument {unknown[0]!r}")
    import warnings

    moved = ", ".join(f"{key}= -> reach=Reach({_FORMER[key]}=...)" for key in former)
    warnings.warn(f"Patch({moved}): the rare fields moved into Reach", DeprecationWarning, stacklevel=3)
    return Reach(**{_FORMER[key]: value for key, value in former.items()})


def _maker() -> str:
    """``path.py:line`` (the path as deep as the module's dotted name) of the code making a
    :class:`Patch`: the first frame outside the kit and the family helpers (``patches._*``)."""
    frame = sys._getframe(2)  # _maker <- Patch.__init__ <- its caller
    kit = ("verl_npu_autopatch.authoring.", "verl_npu_autopatch.patches._")
    while frame.f_back is not None and (frame.f_globals.get("__name__") or "").startswith(kit):
        frame = frame.f_back
    path = frame.f_code.co_filename.replace("\\", "/").split("/")
    name = frame.f_globals.get("__name__") or ""
    depth = name.count(".") + 1 + (path[-1] == "__init__.py")
    return f"{'/'.join(path[-depth:])}:{frame.f_lineno}"
