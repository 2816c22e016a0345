"""Foreign text made safe (``text``): broken ``__str__``, escape sequences, megabytes."""

from __future__ import annotations

from verl_npu_autopatch.engine.text import REASON_CHARS, cut, describe, printable, safe_str


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class WeirdStr(str):
    def __len__(self) -> int:
        raise RuntimeError("no len")


class ReturnsWeird:
    def __str__(self) -> str:
        return WeirdStr("weird")


def test_a_raising_str_gives_a_stand_in() -> None:
    assert safe_str(Unprintable()) == "<unprintable Unprintable object>"
    assert describe(Unprintable("x")) == "Unprintable: <unprintable Unprintable object>"


def test_a_str_subclass_is_copied_plain() -> None:
    text = safe_str(ReturnsWeird())
    assert text == "weird" and type(text) is str


def test_megabytes_are_cut_with_their_length() -> None:
    text = describe(ValueError("x" * 219_000))
    assert len(text) < REASON_CHARS + 40 and text.endswith("... (219,000 characters)")
    assert cut("short") == "short"


def test_empty_message_names_the_type() -> None:
    assert describe(KeyError()) == "KeyError"


def test_escape_sequences_are_shown_not_run() -> None:
    hostile = "ok\x1b]0;pwned\x07\x1b[2J\u202eevil\u200b\r\n\x9b"
    shown = printable(hostile)
    assert shown == "ok\\x1b]0;pwned\\x07\\x1b[2J\\u202eevil\\u200b\\r\\n\\x9b"
    assert shown.isprintable()
    assert printable("plain é 中文") == "plain é 中文"


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


BAD_DEFAULT = BadRepr()


def test_a_signature_with_a_default_whose_repr_raises_is_still_shown() -> None:
    import inspect

    from verl_npu_autopatch.authoring.patching import signature_text
    from verl_npu_autopatch.engine.text import safe_repr

    def upstream(x, flag=BAD_DEFAULT, size=3):  # type: ignore[no-untyped-def]
        return x

    assert signature_text(inspect.signature(upstream)) == "(x, flag=<unprintable BadRepr object>, size=3)"
    assert safe_repr("x" * 500).endswith("... (502 characters)")
