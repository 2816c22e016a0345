"""The family skeleton (``patches/_family.py``): what ``decides``, ``around`` and ``wrapping_patch``
make for every family that states only its rule, its advice and its words."""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring.family import around, decides, wrapping_patch
from verl_npu_autopatch.authoring.fingerprints import Code, UpstreamTree
from verl_npu_autopatch.authoring.spec import APPLY, Verdict, unsupported


@decides("pkg.mod:Owner.method", ("self", "x"))
def _rule(code: Code) -> Verdict:
    return APPLY


def test_a_bound_rule_knows_its_target_and_checks_the_signature_first() -> None:
    assert (_rule.target.module, _rule.target.qualname) == ("pkg.mod", "Owner.method")
    assert _rule(Code("", ("self", "x"))) is APPLY
    mismatch = _rule(Code("", ("self",)))
    assert (mismatch.action, mismatch.reason) == ("unsupported", "expected method(self, x); found method(self)")


@decides("pkg.mod:function")
def _unchecked(code: Code) -> Verdict:
    return APPLY


@decides("pkg.mod:function", ())
def _no_params(code: Code) -> Verdict:
    return APPLY


def test_an_empty_signature_is_checked_too() -> None:
    assert _unchecked(Code("", ("x",))) is APPLY  # no params given: the rule alone decides
    assert _no_params(Code("", ())) is APPLY
    mismatch = _no_params(Code("", ("x",)))
    assert (mismatch.action, mismatch.reason) == ("unsupported", "expected function(); found function(x)")


def _upstream(self: Any, x: int) -> int:
    """Upstream's method."""
    return x + 1


async def _upstream_async(self: Any, x: int) -> int:
    return x + 1


def _twice(original: Callable[..., Any], self: Any, x: int) -> int:
    return int(original(self, x)) * 2


async def _twice_async(original: Callable[..., Any], self: Any, x: int) -> int:
    return int(await original(self, x)) * 2


def test_around_calls_the_advice_with_the_original_and_keeps_its_metadata() -> None:
    made = around(_twice)(None, _upstream)  # around needs no site
    assert made(None, 3) == 8
    assert (made.__name__, made.__doc__, made.__wrapped__) == ("_upstream", "Upstream's method.", _upstream)
    assert not inspect.iscoroutinefunction(made)


def test_around_an_async_advice_makes_an_async_replacement() -> None:
    made = around(_twice_async)(None, _upstream_async)
    assert inspect.iscoroutinefunction(made)  # Ray and verl tell async methods by this
    assert asyncio.run(made(None, 3)) == 8


def test_the_spec_derives_groups_default_and_reads() -> None:
    opt_in = wrapping_patch("fam.fix", "A fix.", rule=_rule, wrap=around(_twice), opt_in="extra", reference="r")
    assert (opt_in.groups, opt_in.default) == (("extra", "fam"), False)
    assert opt_in.static is not None and opt_in.static.reads == ("pkg/mod.py",)
    on = wrapping_patch("fam.fix", "A fix.", rule=_rule, wrap=around(_twice), copying_modules=("pkg.user",))
    assert (on.groups, on.default, on.targets) == (("fam",), True, (_rule.target,))
    assert on.static is not None and on.static.reads == ("pkg/mod.py", "pkg/user.py")


@decides("pkg_read.mod:Owner.method", ("self",), reading=("pkg_read.other:helper", "pkg_read.gone:nothing"))
def _reading(code: Code, helper: Code | None, gone: Code | None) -> Verdict:
    assert gone is None  # a module the release lacks reads as None
    return APPLY if helper is not None and helper.has("return1") else unsupported("a helper returning 1", "other")


def test_a_rule_reading_other_code_sees_it_live_and_in_a_release(tmp_path, monkeypatch) -> None:
    (tmp_path / "pkg_read").mkdir()
    (tmp_path / "pkg_read" / "__init__.py").write_text("")
    (tmp_path / "pkg_read" / "mod.py").write_text("class Owner:\n    def method(self):\n        pass\n")
    (tmp_path / "pkg_read" / "other.py").write_text("def helper():\n    return 1\n")
    tree = UpstreamTree([tmp_path], {})
    assert _reading.judge(tree) is APPLY
    monkeypatch.syspath_prepend(str(tmp_path))
    import pkg_read.mod

    try:
        assert _reading.live(pkg_read.mod.Owner.method) is APPLY
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "pkg_read"]:
            del sys.modules[name]
    (tmp_path / "pkg_read" / "other.py").write_text("def helper():\n    return 2\n")
    assert _reading.judge(UpstreamTree([tmp_path], {})).action == "unsupported"
    patch = wrapping_patch("fam.read", "A fix.", rule=_reading, wrap=around(_twice))
    assert patch.static is not None
    assert patch.static.reads == ("pkg_read/mod.py", "pkg_read/other.py", "pkg_read/gone.py")


def test_a_kit_module_star_exports_exactly_the_names_the_kit_lists_for_it() -> None:
    from verl_npu_autopatch import authoring

    for module in ("spec", "patching", "handover", "family"):
        found: dict[str, object] = {}
        exec(f"from verl_npu_autopatch.authoring.{module} import *", found)
        assert set(found) - {"__builtins__"} == set(authoring._KIT[module].split()), module
