"""Small tools every fix uses: replace an attribute with an undo, mark what we install, read and
describe upstream callables."""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import re
import textwrap
import types
from collections.abc import Callable, Iterable
from typing import Any

from verl_npu_autopatch.authoring.spec import Undo
from verl_npu_autopatch.engine.text import safe_repr

__all__ = [
    "ABSENT",
    "MARKER",
    "chain",
    "definition",
    "describe",
    "mark",
    "marked_by",
    "normalized_source",
    "origin",
    "own_value",
    "parameter_defaults",
    "parameter_names",
    "replace_method",
    "set_attribute",
    "set_entry",
    "set_marked",
    "signature_from_ast",
    "signature_of",
    "signature_text",
    "statements",
    "underlying",
]

#: Attribute set on everything a fix installs; its value is the patch name.
MARKER = "__verl_npu_autopatch__"
#: Set beside ``MARKER``: the marked function itself. ``functools.wraps`` copies ``__dict__``, so
#: another owner's wrapper around ours carries ``MARKER`` too; this back-reference tells them apart.
_MARKED = "__verl_npu_autopatch_function__"
#: "No such attribute in the owner's own ``__dict__``" for :func:`own_value` / :func:`set_attribute`.
ABSENT: Any = object()
_READ: Any = object()
_FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_STARS: dict[Any, str] = dict(zip(_VARIADIC, ("*", "**"), strict=True))
#: The first line of a definition, as ``inspect.findsource`` recognises one.
_DEFINITION = re.compile(r"^(\s*def\s)|(\s*async\s+def\s)|(.*(?<!\w)lambda(:|\s))|^(\s*@)")


def underlying(obj: Any) -> Any:
    """The function inside a ``staticmethod``/``classmethod`` object or a bound method; else ``obj``."""
    return _read(obj, "__func__", obj)


def _read(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr(obj, name, default)`` that never raises: a value another owner put at a target may
    be a proxy whose ``__getattr__`` raises more than ``AttributeError``."""
    try:
        return getattr(obj, name, default)
    except Exception:  # such an attribute is not there for us: the record still names the value's owner
        return default


def mark(obj: Any, patch_name: str) -> Any:
    """Tag ``obj`` (a function, or the function inside a static/class method) as installed by us."""
    func = underlying(obj)
    setattr(func, MARKER, patch_name)
    setattr(func, _MARKED, func)
    return obj


def marked_by(obj: Any) -> str | None:
    """The patch name ``obj`` was marked with, or ``None`` (also for another owner's wrapper of it)."""
    func = underlying(obj)
    return _read(func, MARKER) if _read(func, _MARKED) is func else None


def own_value(owner: Any, name: str) -> Any:
    """What ``owner.__dict__`` holds under ``name`` (not inherited), or :data:`ABSENT`."""
    return getattr(owner, "__dict__", {}).get(name, ABSENT)


def set_attribute(owner: Any, name: str, value: Any, original: Any = _READ) -> Undo:
    """Set ``owner.name = value``; the undo restores exactly what ``owner.__dict__`` held (so an
    inherited attribute is removed again, a ``staticmethod`` stays one), or ``original`` when given
    (:func:`own_value` before something else replaced it), and only while ``value`` is still there:
    it never clobbers a later owner (Liger-Kernel rebinding the name after us)."""
    if original is _READ:
        original = own_value(owner, name)
    setattr(owner, name, value)

    def undo() -> None:
        if own_value(owner, name) is not value:
            return
        if original is not ABSENT:
            setattr(owner, name, original)
            return
        try:
            delattr(owner, name)
        except AttributeError:  # already gone (e.g. another owner deleted it): nothing to undo
            pass

    return undo


def set_marked(owner: Any, name: str, value: Any, patch_name: str, original: Any = _READ) -> Undo:
    """:func:`set_attribute` of ``value`` marked as installed by ``patch_name`` (:func:`mark`)."""
    return set_attribute(owner, name, mark(value, patch_name), original)


def set_entry(table: dict, key: Any, value: Any) -> Undo:
    """Set ``table[key] = value``; the undo puts back what was there, only while ``value`` is."""
    original, table[key] = table[key], value

    def undo() -> None:
        if table.get(key) is value:
            table[key] = original

    return undo


def chain(*undos: Undo) -> Undo:
    """One undo running ``undos`` in reverse order."""

    def undo() -> None:
        for step in reversed(undos):
            step()

    return undo


def replace_method(owner: Any, name: str, make: Callable[[Any], Any], patch_name: str) -> Undo:
    """Replace ``owner.name`` by ``make(original)`` (``make`` receives the plain function), marked
    with ``patch_name``, of the original's kind (``staticmethod``/``classmethod``)."""
    raw = inspect.getattr_static(owner, name)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    replacement = mark(make(raw.__func__ if kind else raw), patch_name)
    return set_attribute(owner, name, kind(replacement) if kind else replacement)


def normalized_source(obj: Any) -> str | None:
    """The source of ``obj`` without whitespace, or ``None`` when it has none; for a class, its
    functions' sources joined in definition order (``inspect.getsource(cls)`` would parse the whole
    module on every call before Python 3.13: 0.2 s for a transformers modeling module)."""
    obj = underlying(obj)
    if isinstance(obj, type):
        values = (getattr(v, "fget", None) if isinstance(v, property) else underlying(v) for v in vars(obj).values())
        found = [source for v in values if inspect.isfunction(v) and (source := normalized_source(v))]
        return "".join(found) if found else None
    try:  # inspect reads what ``__wrapped__`` leads to: so does the cache
        code = getattr(inspect.unwrap(obj), "__code__", None)
    except ValueError:  # a ``__wrapped__`` cycle, which inspect cannot read either
        return None
    return _code_source(code) if isinstance(code, types.CodeType) else _inspected(obj)


@functools.lru_cache(maxsize=4096)
def _code_source(code: types.CodeType) -> str | None:
    """A function's whitespace-free source, read once per code object: the block at its first line,
    as ``inspect.getsource`` reads it, without inspect's look-up of the module through every loaded
    one (about 20 ms in a vLLM process)."""
    lines = linecache.getlines(code.co_filename)
    start = code.co_firstlineno - 1
    if 0 <= start < len(lines) and _DEFINITION.match(lines[start]):
        try:
            return "".join("".join(inspect.getblock(lines[start:])).split())
        except Exception:  # tokenize gave up on the block: inspect's own reading decides below
            pass
    return _inspected(code)


def _inspected(obj: Any) -> str | None:
    try:
        return "".join(inspect.getsource(obj).split())
    except (OSError, TypeError):  # no source (built-in, C extension, REPL): the caller says so
        return None


def signature_of(obj: Any) -> inspect.Signature | None:
    """The signature of a callable (inside a static/class method), or ``None`` when it has none."""
    try:
        return inspect.signature(underlying(obj))
    except (TypeError, ValueError):  # no inspectable signature (some built-ins): the caller says so
        return None


def parameter_names(obj: Any) -> tuple[str, ...] | None:
    """Parameter names of a callable, or ``None`` when it has no inspectable signature."""
    signature = signature_of(obj)
    return None if signature is None else tuple(signature.parameters)


def parameter_defaults(obj: Any) -> dict[str, bool] | None:
    """Each parameter of a callable → whether a caller may leave it out (a default, ``*args``,
    ``**kw``), or ``None`` when it has no inspectable signature."""
    signature = signature_of(obj)
    if signature is None:
        return None
    return {n: p.default is not p.empty or p.kind in _VARIADIC for n, p in signature.parameters.items()}


def signature_text(params: Iterable[str] | inspect.Signature | None) -> str:
    """A signature for reports: ``(a, b)`` from names; from a ``Signature``, ``(a, b=1, *, c, **kw)``
    (defaults as ``repr``, no annotations, kinds marked); ``(unknown)`` for none."""
    if params is None or not isinstance(params, inspect.Signature):
        return "(unknown)" if params is None else f"({', '.join(params)})"
    parts, star = [], False
    for p in params.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        parts.append(_STARS.get(p.kind, "") + p.name + ("" if p.default is p.empty else f"={safe_repr(p.default)}"))
    return f"({', '.join(parts)})"


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, Any, ast.expr | None]]:
    """``(name, kind, default expression or None)`` of each parameter a parsed definition declares."""
    args, kind = node.args, inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    kinds = [kind.POSITIONAL_ONLY] * len(args.posonlyargs) + [kind.POSITIONAL_OR_KEYWORD] * len(args.args)
    found: list[tuple[str, Any, ast.expr | None]] = list(zip([a.arg for a in positional], kinds, defaults, strict=True))
    found += [(args.vararg.arg, kind.VAR_POSITIONAL, None)] if args.vararg else []
    found += [(a.arg, kind.KEYWORD_ONLY, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    return found + ([(args.kwarg.arg, kind.VAR_KEYWORD, None)] if args.kwarg else [])


def signature_from_ast(node: ast.FunctionDef | ast.AsyncFunctionDef) -> inspect.Signature:
    """The signature a parsed definition declares (no annotations); ``ValueError`` for a default
    that is not a literal."""
    empty = inspect.Parameter.empty
    return inspect.Signature(
        [inspect.Parameter(n, k, default=empty if d is None else ast.literal_eval(d)) for n, k, d in _parameters(node)]
    )


def definition(obj: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | None:
    """The parsed definition of a live function or class, or ``None`` without readable source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(underlying(obj))))
    except (OSError, TypeError, SyntaxError, ValueError):  # no readable or parsable source (or a __wrapped__ loop)
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (*_FUNCTION, ast.ClassDef)) else None


def statements(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    """The statements of a function's body without its docstring."""
    body = list(node.body)
    docstring = body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1:] if docstring else body


def describe(obj: Any) -> str:
    """Short human name of a callable for reports: ``module.qualname``."""
    func = underlying(obj)
    return f"{_read(func, '__module__') or '?'}.{_read(func, '__qualname__', type(func).__name__)}"


def origin(obj: Any) -> str:
    """Where a callable was written, ``module.qualname``, read from its code and globals, which
    ``functools.wraps`` does not copy: another owner's wrapper is named by its own module
    (:func:`describe` for callables without Python code)."""
    func = underlying(obj)
    code, namespace = _read(func, "__code__"), _read(func, "__globals__")
    if code is None or not isinstance(namespace, dict):
        return describe(obj)
    return f"{namespace.get('__name__') or '?'}.{getattr(code, 'co_qualname', code.co_name)}"
