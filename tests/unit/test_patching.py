"""The one copy of each helper fixes share (``patching.py``)."""

from __future__ import annotations

from verl_npu_autopatch.authoring.fingerprints import Code, params_mismatch
from verl_npu_autopatch.authoring.patching import (
    ABSENT,
    definition,
    marked_by,
    own_value,
    set_attribute,
    set_marked,
    signature_text,
    statements,
)


def test_set_attribute_restores_a_given_original() -> None:
    """An upstream import assigned the attribute before the fix: the undo restores what was there before."""

    def vllm_capture(self):
        return "vllm"

    def ascend_capture(self):
        return "vllm-ascend"

    holder = type("Capturer", (), {"capture": vllm_capture})
    before = own_value(holder, "capture")
    holder.capture = ascend_capture  # what importing vllm-ascend's module does
    undo = set_attribute(holder, "capture", ascend_capture, before)
    undo()
    assert holder.__dict__["capture"] is vllm_capture
    absent = type("Bare", (), {})
    assert own_value(absent, "capture") is ABSENT
    set_attribute(absent, "capture", ascend_capture, ABSENT)()
    assert "capture" not in absent.__dict__


def test_signature_text_and_params_mismatch() -> None:
    assert signature_text(("self", "x")) == "(self, x)" and signature_text(None) == "(unknown)"
    assert params_mismatch(Code("", ("self", "x")), ("self", "x"), "forward") is None
    verdict = params_mismatch(Code("", ("self",)), ("self", "x"), "forward", "pkg.Layer.forward")
    assert verdict is not None and verdict.action == "unsupported"
    assert verdict.reason == "expected pkg.Layer.forward(self, x); found forward(self)"


def test_definition_and_statements_skip_the_docstring() -> None:
    def documented(a):
        """Doc."""
        return a

    node = definition(documented)
    assert node is not None and node.name == "documented"
    assert [type(s).__name__ for s in statements(node)] == ["Return"]
    assert definition(len) is None

    def looped() -> None: ...

    looped.__wrapped__ = looped  # type: ignore[attr-defined]  # a wrapper loop: no readable source either
    assert definition(looped) is None


def test_set_marked_marks_and_never_clobbers_a_later_owner() -> None:
    def upstream():
        return "upstream"

    def ours():
        return "ours"

    def later():
        return "later"

    holder = type("Holder", (), {"f": staticmethod(upstream)})
    undo = set_marked(holder, "f", ours, "test.marked")
    assert marked_by(holder.__dict__["f"]) == "test.marked"
    holder.f = later
    undo()
    assert holder.__dict__["f"] is later


def test_the_static_reader_skips_overload_stubs() -> None:
    """A release's ``@overload`` stubs come before the implementation; the rule reads the latter."""
    from verl_npu_autopatch.authoring.fingerprints import ModuleSource

    source = ModuleSource(
        "from typing import overload\n"
        "import typing\n"
        "@overload\ndef f(x: int) -> int: ...\n"
        "@typing.overload\ndef f(x: str) -> str: ...\n"
        "def f(x):\n    return impl(x)\n"
        "class C:\n"
        "    @overload\n    def m(self, a: int) -> int: ...\n"
        "    def m(self, a, b=None):\n        return impl(a)\n"
    )
    assert source.code("f") is not None and source.code("f").has("returnimpl(x)")
    method = source.code("C.m")
    assert method is not None and method.params == ("self", "a", "b") and method.has("returnimpl(a)")
    assert source.function_node("C.m") is not None and len(source.function_node("C.m").args.args) == 3
