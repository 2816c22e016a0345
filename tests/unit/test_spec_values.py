"""The spec's value types keep the behaviour of the dataclasses they were (hand-written
constructors and named tuples cost activation less): field order, equality, hashing,
immutability, ``dataclasses.replace``; the engine's records copy and serialize as before."""

from __future__ import annotations

import dataclasses
import sys
import typing

import pytest

from verl_npu_autopatch.authoring.spec import NO_REACH, Patch, Reach, Site, StaticRule, Target, Verdict
from verl_npu_autopatch.engine.records import Record


def _fix(site: Site) -> None:
    return None


def _patch(**changes: object) -> Patch:
    return Patch("p.one", "a fix", (Target("m", "f"),), lambda s: _fix, **changes)  # type: ignore[arg-type]


def test_patch_fields_in_order_equality_and_replace() -> None:
    patch = _patch(groups=("g",), reach=Reach(copies_in=("m",)))
    values = [getattr(patch, f.name) for f in dataclasses.fields(Patch)]
    assert Patch(*values) == patch and hash(Patch(*values)) == hash(patch)  # type: ignore[arg-type]
    changed = dataclasses.replace(patch, check=None, reach=dataclasses.replace(patch.reach, via=(Target("m", "g"),)))
    assert changed.defined_at == patch.defined_at and changed.groups == ("g",) and changed != patch
    assert changed.reach.via == (Target("m", "g"),) and changed.reach.copies_in == ("m",)
    assert _patch().reach is NO_REACH and repr(patch) == "Patch('p.one')"
    assert patch.defined_at.endswith(f"test_spec_values.py:{_patch.__code__.co_firstlineno + 1}")


def test_patch_and_reach_stay_frozen_and_validated() -> None:
    patch = _patch()
    with pytest.raises(dataclasses.FrozenInstanceError):
        patch.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        NO_REACH.via = ()  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        _patch(colour="red")
    with pytest.raises(ValueError, match="dotted word"):
        Patch("has space", "s", (Target("m", "f"),), lambda s: _fix)
    with pytest.raises(ValueError, match="copies only"):
        Reach(stale_values=dict)
    with pytest.raises(ValueError, match="relative path"):
        StaticRule(lambda tree: Verdict("apply"), ("/abs.py",))


def test_targets_verdicts_and_sites_are_immutable_values() -> None:
    target = Target.parse("pkg.mod:Cls.meth", "vllm>=0.24")
    assert target == Target("pkg.mod", "Cls.meth", ("vllm>=0.24",)) and str(target) == "pkg.mod:Cls.meth"
    assert {target: 1}[Target("pkg.mod", "Cls.meth", ("vllm>=0.24",))] == 1
    with pytest.raises(AttributeError):
        target.module = "x"  # type: ignore[misc]
    site = Site(_patch(), target, sys, sys, "f", None)
    assert dict(site.versions) == {} and site.handover is None
    with pytest.raises(TypeError):
        site.versions["x"] = "1"  # type: ignore[index]  # the shared default cannot be filled


def test_record_copy_and_dict() -> None:
    record = Record("p.one", ("g",), "m:f", "applied", "why", {"vllm": "0.1"}, pid=7)
    copy = record.copy()
    copy.versions["vllm"] = "0.2"
    assert record.versions == {"vllm": "0.1"}
    assert list(record.to_dict()) == ["name", "groups", "target", "state", "reason", "versions", "pid"]
    assert record.to_dict()["groups"] == ["g"] and Record("n", (), "t").state == "pending"


def test_frozen_to_dataclasses_and_their_subclasses() -> None:
    """A plugin may subclass ``Patch`` or ``Reach`` as dataclasses do a frozen one: frozen again,
    never plain; ``dataclasses`` reads both as frozen, as it did when they were generated."""
    assert Patch.__dataclass_params__.frozen and Reach.__dataclass_params__.frozen  # type: ignore[attr-defined]

    @dataclasses.dataclass(frozen=True)
    class TaggedPatch(Patch):
        tag: str = ""

    tagged = TaggedPatch("p.one", "a fix", (Target("m", "f"),), lambda s: _fix, tag="t")  # type: ignore[call-arg]
    assert tagged.tag == "t" and tagged.name == "p.one" and tagged.hooks == (Target("m", "f"),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tagged.tag = "u"  # type: ignore[misc]
    with pytest.raises(TypeError, match="non-frozen dataclass from a frozen one"):

        @dataclasses.dataclass
        class PlainReach(Reach):
            extra: int = 0


def test_type_hints_name_the_fields_only() -> None:
    # as of the generated dataclasses: the written-out frozen behaviour adds no annotated name
    for cls in (Patch, Reach):
        assert list(typing.get_type_hints(cls)) == [f.name for f in dataclasses.fields(cls)]
