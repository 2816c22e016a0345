"""Foreign text (exceptions and values from upstream code, plugins or other users' files) made safe
to keep and show: its ``__str__`` may raise, it may hold terminal escapes or run to megabytes.
Imports nothing at run time: the engine uses it inside its guards."""

TYPE_CHECKING = False
if TYPE_CHECKING:  # without importing typing at run time
    from collections.abc import Callable

__all__ = ["REASON_CHARS", "cut", "describe", "printable", "safe_repr", "safe_str"]

#: Longest reason a record, a report file or ``--json`` keeps (screens cut shorter).
REASON_CHARS = 2000

#: Besides C0/C1 controls and DEL, :func:`printable` escapes what reorders or hides text on a terminal
#: (bidirectional overrides and isolates, zero-width marks) and lone surrogates (a non-UTF-8 name).
_HIDDEN = (*range(0x200B, 0x2010), 0x2028, 0x2029, 0x2060, 0xFEFF, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_escapes: dict[int, str] = {}  # printable's table, made at its first use (not on the engine's active path)


def cut(text: str, limit: int = REASON_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def safe_str(value: object, limit: int = REASON_CHARS) -> str:
    """``str(value)`` cut to ``limit``, or a stand-in naming its type where ``str`` raises (or
    returns no string). Never raises."""
    return _safely(str, value, limit)


def safe_repr(value: object, limit: int = 200) -> str:
    """As :func:`safe_str`, with ``repr``."""
    return _safely(repr, value, limit)


def _safely(render: "Callable[[object], str]", value: object, limit: int) -> str:
    try:
        text = render(value)
        if type(text) is not str:  # a str subclass could misbehave later: keep a plain copy
            text = str.__str__(text)
    except BaseException as exc:  # a broken __str__ / __repr__ must not break the caller's guard
        if isinstance(exc, KeyboardInterrupt):
            raise
        return f"<unprintable {_type_name(value)} object>"
    return cut(text, limit)


def describe(exc: BaseException, limit: int = REASON_CHARS) -> str:
    """``"TypeName: message"`` (``"TypeName"`` for an empty message), bounded. Never raises."""
    name = _type_name(exc)
    message = safe_str(exc, limit)
    return f"{name}: {message}" if message else name


def _type_name(value: object) -> str:
    try:
        name = type(value).__name__
        return name if type(name) is str else "object"
    except Exception:  # a metaclass with a broken __name__: the stand-in says nothing more
        return "object"


def printable(text: str) -> str:
    """``text`` with control, bidirectional and zero-width characters escaped (``\\x1b``,
    ``\\u202e``, ``\\n``): what a terminal shows is what the text holds."""
    if text.isprintable():
        return text
    if not _escapes:
        table = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
        table.update({c: f"\\u{c:04x}" for c in (*_HIDDEN, *range(0xD800, 0xE000))})  # and lone surrogates
        table.update({ord("\t"): "\\t", ord("\n"): "\\n", ord("\r"): "\\r"})
        _escapes.update(table)
    return text.translate(_escapes)
