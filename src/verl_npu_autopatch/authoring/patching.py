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
#: Set next to ``MARKER``: the marked function itself. ``functools.wraps`` copies a function's
#: ``__dict__`` into its wrapper, so someone else's wrapper around ours (verl's) carries our
#: ``MARKER`` too; only this back-reference tells the marked function from such a wrapper.
_MARKED = "__verl_npu_autopatch_function__"

#: "No such attribute in the owner's own ``__dict__``" for :func:`own_value` / :func:`set_attribute`.
ABSENT: Any = object()
_READ: Any = object()


def underlying(obj: Any) -> Any:
    """The function inside a ``staticmethod``/``classmethod`` object or a bound method; else ``obj``."""
    return getattr(obj, "__func__", obj)


def mark(obj: Any, patch_name: str) -> Any:
    """Tag ``obj`` (a function, or the function inside a static/class method) as installed by us."""
    func = underlying(obj)
    setattr(func, MARKER, patch_name)
    setattr(func, _MARKED, func)
    return obj


def marked_by(obj: Any) -> str | None:
    """The patch name ``obj`` was marked with, or ``None`` (also for another owner's
    ``functools.wraps`` wrapper around a marked function)."""
    func = underlying(obj)
    if getattr(func, _MARKED, None) is not func:
        return None
    return getattr(func, MARKER, None)


def own_value(owner: Any, name: str) -> Any:
    """What ``owner.__dict__`` holds under ``name`` (not inherited), or :data:`ABSENT`."""
    return getattr(owner, "__dict__", {}).get(name, ABSENT)


def set_attribute(owner: Any, name: str, value: Any, original: Any = _READ) -> Undo:
    """Set ``owner.name = value`` and return an undo that restores exactly what was there.

    The original is read from ``owner.__dict__`` where it has one, so an inherited attribute is
    removed again on undo rather than copied down, and a ``staticmethod`` stays a ``staticmethod``.
    Pass ``original`` (from :func:`own_value`, :data:`ABSENT` for none) when something else already
    replaced the attribute before the fix runs (an upstream module the fix imports assigns it).
    The undo acts only while ``value`` is still in place: it never clobbers a later owner of the
    attribute (e.g. Liger-Kernel rebinding the same name after us).
    """
    if original is _READ:
        original = own_value(owner, name)
    setattr(owner, name, value)

    def undo() -> None:
        if own_value(owner, name) is not value:
            return
        if original is ABSENT:
            try:
                delattr(owner, name)
            except AttributeError:  # already gone (e.g. another owner deleted it): nothing to undo
                pass
        else:
            setattr(owner, name, original)

    return undo


def set_marked(owner: Any, name: str, value: Any, patch_name: str, original: Any = _READ) -> Undo:
    """:func:`set_attribute` of ``value`` marked as installed by ``patch_name`` (:func:`mark`)."""
    return set_attribute(owner, name, mark(value, patch_name), original)


def set_entry(table: dict, key: Any, value: Any) -> Undo:
    """Set ``table[key] = value`` (a dispatch table's entry) and return an undo that puts back
    what was there, only while ``value`` is still in place."""
    original = table[key]
    table[key] = value

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


def normalized_source(obj: Any) -> str | None:
    """The source of ``obj`` with all whitespace removed, or ``None`` when it has no source.

    For a class: the sources of the functions it defines, joined in definition order. Each is
    read from the function's own lines; ``inspect.getsource(cls)`` would re-parse the whole
    module on every call before Python 3.13 (0.2 s for a transformers modeling module).
    """
    obj = underlying(obj)
    if isinstance(obj, type):
        parts = [normalized_source(_function_of(v)) for v in vars(obj).values() if _function_of(v) is not None]
        found = [p for p in parts if p]
        return "".join(found) if found else None
    try:  # inspect reads what ``__wrapped__`` leads to: so does the cache
        code = getattr(inspect.unwrap(obj), "__code__", None)
    except ValueError:  # a ``__wrapped__`` cycle, which inspect cannot read either
        return None
    if isinstance(code, types.CodeType):  # one reading per function body: a check and its fix both read it
        return _code_source(code)
    return _inspected(obj)


@functools.lru_cache(maxsize=4096)
def _code_source(code: types.CodeType) -> str | None:
    """The whitespace-free source of a function's code, read once (a reload makes new code): the
    block at its first line, as ``inspect.getsource`` reads it, without inspect's first look-up of
    the module, which scans every loaded module (about 20 ms in a vLLM process)."""
    lines = linecache.getlines(code.co_filename)
    start = code.co_firstlineno - 1
    if 0 <= start < len(lines) and _DEFINITION.match(lines[start]):
        try:
            return "".join("".join(inspect.getblock(lines[start:])).split())
        except Exception:  # tokenize gave up on the block: inspect's own reading decides below
            pass
    return _inspected(code)


def _inspected(obj: Any) -> str | None:
    """``inspect.getsource(obj)`` without whitespace, or ``None`` when it has no source."""
    try:
        return "".join(inspect.getsource(obj).split())
    except (OSError, TypeError):  # no source (built-in, C extension, REPL): the caller says so
        return None


#: The first line of a definition, as ``inspect.findsource`` recognises one.
_DEFINITION = re.compile(r"^(\s*def\s)|(\s*async\s+def\s)|(.*(?<!\w)lambda(:|\s))|^(\s*@)")


def _function_of(value: Any) -> Any:
    """The plain function behind a class attribute (method, static/class method, property)."""
    value = getattr(value, "fget", None) if isinstance(value, property) else underlying(value)
    return value if inspect.isfunction(value) else None


def signature_of(obj: Any) -> inspect.Signature | None:
    """The signature of a callable (of the function inside a static/class method), or ``None``
    when it has none to inspect."""
    try:
        return inspect.signature(underlying(obj))
    except (TypeError, ValueError):  # no inspectable signature (some built-ins): the caller says so
        return None


def parameter_names(obj: Any) -> tuple[str, ...] | None:
    """Parameter names of a callable, or ``None`` when it has no inspectable signature."""
    signature = signature_of(obj)
    return None if signature is None else tuple(signature.parameters)


def parameter_defaults(obj: Any) -> dict[str, bool] | None:
    """Each parameter of a callable → whether a caller may leave it out (it has a default, or is
    ``*args``/``**kw``), or ``None`` when it has no inspectable signature."""
    signature = signature_of(obj)
    if signature is None:
        return None
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n: p.default is not p.empty or p.kind in variadic for n, p in signature.parameters.items()}


_STARS: dict[Any, str] = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}


def signature_text(params: Iterable[str] | inspect.Signature | None) -> str:
    """The one rendering of a signature for reports: ``(a, b, c)`` from parameter names; from an
    ``inspect.Signature``, ``(a, b=1, *, c, **kw)`` without annotations (defaults as ``repr``,
    keyword-only and variadic parameters with their ``*`` markers, so a changed kind shows);
    ``(unknown)`` when there is no signature."""
    if params is None:
        return "(unknown)"
    if not isinstance(params, inspect.Signature):
        return f"({', '.join(params)})"
    parts, star = [], False
    for p in params.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        star = star or p.kind is p.VAR_POSITIONAL
        parts.append(_STARS.get(p.kind, "") + p.name + ("" if p.default is p.empty else f"={safe_repr(p.default)}"))
    return f"({', '.join(parts)})"


def signature_from_ast(node: ast.FunctionDef | ast.AsyncFunctionDef) -> inspect.Signature:
    """The signature a parsed definition declares (no annotations); raises ``ValueError`` for a
    default that is not a literal."""
    args, kind = node.args, inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    kinds = [kind.POSITIONAL_ONLY] * len(args.posonlyargs) + [kind.POSITIONAL_OR_KEYWORD] * len(args.args)
    params = [_parameter(a.arg, k, d) for a, k, d in zip(positional, kinds, defaults, strict=True)]
    if args.vararg:
        params.append(kind(args.vararg.arg, kind.VAR_POSITIONAL))
    params += [_parameter(a.arg, kind.KEYWORD_ONLY, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        params.append(kind(args.kwarg.arg, kind.VAR_KEYWORD))
    return inspect.Signature(params)


def _parameter(name: str, kind: Any, default: ast.expr | None) -> inspect.Parameter:
    if default is None:
        return inspect.Parameter(name, kind)
    return inspect.Parameter(name, kind, default=ast.literal_eval(default))


def definition(obj: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | None:
    """The parsed definition of a live function or class (its own source lines, dedented), or
    ``None`` when it has no readable source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(underlying(obj))))
    except (OSError, TypeError, SyntaxError):  # no readable or parsable source: the caller says so
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None


def statements(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    """The statements of a function's body without its docstring."""
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def describe(obj: Any) -> str:
    """Short human name of a callable for reports: ``module.qualname``."""
    func = underlying(obj)
    module = getattr(func, "__module__", None) or "?"
    return f"{module}.{getattr(func, '__qualname__', type(func).__name__)}"


def origin(obj: Any) -> str:
    """Where a callable was really written, as ``module.qualname``: read from its code object and
    globals, which ``functools.wraps`` does not copy (unlike ``__module__``/``__qualname__``), so a
    wrapper installed by someone else is named by its own module, not by the function it wraps.
    Falls back to :func:`describe` for callables without Python code."""
    func = underlying(obj)
    code, namespace = getattr(func, "__code__", None), getattr(func, "__globals__", None)
    if code is None or not isinstance(namespace, dict):
        return describe(obj)
    return f"{namespace.get('__name__') or '?'}.{getattr(code, 'co_qualname', code.co_name)}"


def replace_method(owner: Any, name: str, make: Callable[[Any], Any], patch_name: str) -> Undo:
    """Replace ``owner.name`` by ``make(original)``, marked with ``patch_name``; keeps the
    ``staticmethod``/``classmethod`` kind of the original. ``make`` receives the plain function."""
    raw = inspect.getattr_static(owner, name)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    func = raw.__func__ if kind else raw
    replacement = mark(make(func), patch_name)
    return set_attribute(owner, name, kind(replacement) if kind else replacement)
