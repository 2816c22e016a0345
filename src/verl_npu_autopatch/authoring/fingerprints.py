"""Source fingerprints: what a patch's check rule looks at, read from a live object or a release's files.

A rule is a pure function over :class:`Code` values (whitespace-free source plus parameter names).
``check`` builds them from the live target (``Code.live``); ``scripts/compat-matrix`` builds them
with :class:`UpstreamTree` from a downloaded release's source, read with :mod:`ast` and never
executed. Both therefore run the one implementation of each rule. Standard library only.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from verl_npu_autopatch.authoring.patching import marked_by, normalized_source, parameter_names, signature_text
from verl_npu_autopatch.authoring.spec import Verdict, unsupported


class Code(NamedTuple):
    """One callable as a rule sees it: whitespace-free source, parameter names, our marker."""

    source: str | None
    params: tuple[str, ...] | None
    marker: str | None = None

    @classmethod
    def live(cls, obj: Any) -> Code:
        """From a live function (a ``staticmethod``/``classmethod`` object is unwrapped)."""
        return cls(normalized_source(obj), parameter_names(obj), marked_by(obj))

    def has(self, *needles: str) -> bool:
        """Whether the source contains every needle (needles are written without whitespace)."""
        return self.source is not None and all(n in self.source for n in needles)


def params_mismatch(
    code: Code, expected: tuple[str, ...], name: str, expected_name: str | None = None
) -> Verdict | None:
    """``unsupported`` naming both signatures (``name(a, b)``) when ``code`` does not take exactly
    ``expected``; ``None`` when it does. ``expected_name`` names the expected callable when it
    differs from ``name`` (a fully qualified one)."""
    if code.params == expected:
        return None
    return unsupported(f"{expected_name or name}{signature_text(expected)}", f"{name}{signature_text(code.params)}")


def takes(name: str, expected: tuple[str, ...]) -> Callable[[Callable[..., Verdict]], Callable[..., Verdict]]:
    """A rule's signature check, written once: the decorated rule decides only on code taking
    exactly ``expected``; other code is ``unsupported`` naming both signatures (:func:`params_mismatch`)."""

    def decorate(rule: Callable[..., Verdict]) -> Callable[..., Verdict]:
        @functools.wraps(rule)
        def checked(code: Code, *others: Code | None) -> Verdict:
            return params_mismatch(code, expected, name) or rule(code, *others)

        return checked

    return decorate


# --------------------------------------------------------------------------- static reading
def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg:
        names.append(args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append(args.kwarg.arg)
    return tuple(names)


def definition_defaults(node: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, bool]:
    """Each parameter of a definition → whether it has a default (``*args``/``**kw``: ``True``, as
    a caller may leave them out); what :func:`patching.parameter_defaults` reads from a live one."""
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    found = {a.arg: i >= len(positional) - len(args.defaults) for i, a in enumerate(positional)}
    found.update({a.arg: d is not None for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)})
    found.update({a.arg: True for a in (args.vararg, args.kwarg) if a is not None})
    return found


def _overload(node: ast.AST) -> bool:
    """Whether ``node`` is a ``@typing.overload`` stub (the implementation follows it)."""
    decorators = getattr(node, "decorator_list", [])
    return any(ast.unparse(d).rpartition(".")[2] == "overload" for d in decorators)


def _definitions(body: list[ast.stmt]) -> list[ast.AST]:
    """The classes and functions of ``body``, ``@overload`` stubs left out."""
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [node for node in body if isinstance(node, kinds) and not _overload(node)]


class ModuleSource:
    """One module's source text, parsed once."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tree = ast.parse(text)

    def _top(self, name: str) -> ast.AST | None:
        for node in _definitions(self.tree.body):
            if getattr(node, "name", None) == name:
                return node
        return None

    def _segment(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
        """The lines ``inspect.getsource`` would return: decorators through the last body line."""
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        lines = self.text.splitlines()[start - 1 : node.end_lineno]
        return "".join("\n".join(lines).split())

    def code(self, qualname: str) -> Code | None:
        """``Code`` of ``function`` or ``Class.method`` (following base classes defined in this
        module), or ``None`` when the module does not define it."""
        *owners, name = qualname.split(".")
        if not owners:
            node = self._top(name)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return Code(self._segment(node), _params(node))
            return None
        cls = self._top(owners[0])
        return self._method(cls, name, set()) if isinstance(cls, ast.ClassDef) and len(owners) == 1 else None

    def function_node(self, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The definition of top-level ``function`` or ``Class.method`` (this class only)."""
        *owners, name = qualname.split(".")
        scope = self._top(owners[0]) if owners else self.tree
        if len(owners) > 1 or not isinstance(scope, (ast.ClassDef, ast.Module)):
            return None
        for node in _definitions(scope.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        return None

    def _method(self, cls: ast.ClassDef, name: str, seen: set[str]) -> Code | None:
        seen.add(cls.name)
        for node in _definitions(cls.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return Code(self._segment(node), _params(node))
        for base in cls.bases:
            parent = self._top(base.id) if isinstance(base, ast.Name) and base.id not in seen else None
            if isinstance(parent, ast.ClassDef):
                found = self._method(parent, name, seen)
                if found is not None:
                    return found
        return None

    def binds(self, name: str) -> bool:
        """Whether the module binds ``name`` at top level (def, class, import or assignment)."""
        for node in self.tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return True
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names
            ):
                return True
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        return False

    def imports_from(self, module: str, name: str) -> bool:
        """Whether a top-level ``from module import name`` is present."""
        return any(
            isinstance(node, ast.ImportFrom) and node.module == module and any(a.name == name for a in node.names)
            for node in self.tree.body
        )

    def returned_names(self, function: str) -> list[str]:
        """Names a top-level function can ``return`` (``return SomeClass``), in source order."""
        node = self._top(function)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return []
        return [
            sub.value.id for sub in ast.walk(node) if isinstance(sub, ast.Return) and isinstance(sub.value, ast.Name)
        ]


def imports_module_unconditionally(text: str, module: str) -> bool:
    """Whether ``text`` (a module's source) imports ``module`` in a top-level statement, i.e. not
    under an ``if``/``try`` or inside a function."""
    package, _, leaf = module.rpartition(".")
    for node in ast.parse(text).body:
        if isinstance(node, ast.Import) and any(a.name == module for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == package and any(a.name == leaf for a in node.names):
            return True
    return False


class UpstreamTree:
    """A release's source files laid out as in the installed packages (``vllm_ascend/...``,
    ``vllm/...``), possibly spread over several roots, plus the versions they come from."""

    def __init__(self, roots: Iterable[Path], versions: dict[str, str]) -> None:
        self.roots = tuple(Path(r) for r in roots)
        self.versions = dict(versions)
        self._cache: dict[str, ModuleSource | None] = {}

    def _path(self, module: str) -> Path | None:
        relative = module.replace(".", "/")
        for root in self.roots:
            for candidate in (root / f"{relative}.py", root / relative / "__init__.py"):
                if candidate.is_file():
                    return candidate
        return None

    def has_module(self, module: str) -> bool:
        return self._path(module) is not None

    def module(self, module: str) -> ModuleSource | None:
        """The parsed source of ``module``, or ``None`` when the release lacks it."""
        if module not in self._cache:
            path = self._path(module)
            self._cache[module] = ModuleSource(path.read_text(encoding="utf-8")) if path else None
        return self._cache[module]

    def code(self, module: str, qualname: str) -> Code | None:
        source = self.module(module)
        return None if source is None else source.code(qualname)

    def judge(self, module: str, qualname: str, rule: Callable[[Code], Verdict]) -> Verdict:
        """``rule`` on ``module:qualname``'s code, or ``unsupported`` when the release lacks it."""
        source = self.module(module)
        code = None if source is None else source.code(qualname)
        if code is None:
            return unsupported(f"{module}:{qualname}", "no such module" if source is None else f"{module} without it")
        return rule(code)
