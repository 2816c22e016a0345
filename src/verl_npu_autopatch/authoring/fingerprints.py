"""What a patch's rule reads: :class:`Code` (whitespace-free source, parameter names) of a live object
(``Code.live``, for ``check``) or of a release's files (:class:`UpstreamTree`, for
``scripts/compat-matrix``, parsed with :mod:`ast`, never run): one implementation of each rule."""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from verl_npu_autopatch.authoring import patching
from verl_npu_autopatch.authoring.patching import marked_by, normalized_source, parameter_names, signature_text
from verl_npu_autopatch.authoring.spec import Verdict, unsupported

_Function = ast.FunctionDef | ast.AsyncFunctionDef


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
    """``unsupported`` naming both signatures (``name(a, b)``; ``expected_name`` for the expected
    one where it differs) when ``code`` does not take exactly ``expected``, else ``None``."""
    if code.params == expected:
        return None
    return unsupported(f"{expected_name or name}{signature_text(expected)}", f"{name}{signature_text(code.params)}")


def takes(name: str, expected: tuple[str, ...]) -> Callable[[Callable[..., Verdict]], Callable[..., Verdict]]:
    """The decorated rule decides on code taking exactly ``expected`` only (:func:`params_mismatch`)."""

    def decorate(rule: Callable[..., Verdict]) -> Callable[..., Verdict]:
        @functools.wraps(rule)
        def checked(code: Code, *others: Code | None) -> Verdict:
            return params_mismatch(code, expected, name) or rule(code, *others)

        return checked

    return decorate


def definition_defaults(node: _Function) -> dict[str, bool]:
    """Each parameter of a definition → whether a caller may leave it out, as
    :func:`~.patching.parameter_defaults` reads it from a live one."""
    return {
        name: default is not None or kind in patching._VARIADIC for name, kind, default in patching._parameters(node)
    }


def imports_module_unconditionally(text: str, module: str) -> bool:
    """Whether ``text`` (a module's source) imports ``module`` in a top-level statement (not under an
    ``if``/``try``, not in a function)."""
    package, _, leaf = module.rpartition(".")
    return any(
        (isinstance(node, ast.Import) and any(a.name == module for a in node.names))
        or (isinstance(node, ast.ImportFrom) and node.module == package and any(a.name == leaf for a in node.names))
        for node in ast.parse(text).body
    )


class ModuleSource:
    """One module's source text, parsed once."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tree = ast.parse(text)

    def _top(self, name: str) -> ast.AST | None:
        return next((node for node in _definitions(self.tree.body) if node.name == name), None)

    def function_node(self, qualname: str, bases: bool = False) -> _Function | None:
        """The definition of top-level ``function`` or ``Class.method`` (``bases``: or of a base
        class defined in this module)."""
        *owners, name = qualname.split(".")
        scope = self._top(owners[0]) if owners else self.tree
        if len(owners) > 1 or not isinstance(scope, (ast.ClassDef, ast.Module)):
            return None
        return self._member(scope, name, set() if bases else None)

    def _member(self, scope: ast.ClassDef | ast.Module, name: str, seen: set[str] | None) -> _Function | None:
        found = next(
            (n for n in _definitions(scope.body) if isinstance(n, patching._FUNCTION) and n.name == name), None
        )
        if found is not None or seen is None or not isinstance(scope, ast.ClassDef):
            return found
        seen.add(scope.name)
        for base in scope.bases:
            parent = self._top(base.id) if isinstance(base, ast.Name) and base.id not in seen else None
            found = self._member(parent, name, seen) if isinstance(parent, ast.ClassDef) else None
            if found is not None:
                return found
        return None

    def code(self, qualname: str) -> Code | None:
        """``Code`` of ``function`` or ``Class.method`` (following base classes defined in this
        module), or ``None`` when the module does not define it."""
        node = self.function_node(qualname, bases=True)
        if node is None:
            return None
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])  # as inspect.getsource reads it
        lines = self.text.splitlines()[start - 1 : node.end_lineno]
        return Code("".join("\n".join(lines).split()), tuple(name for name, _, _ in patching._parameters(node)))

    def binds(self, name: str) -> bool:
        """Whether the module binds ``name`` at top level (def, class, import or assignment)."""
        for node in self.tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bound = [a.asname or a.name.split(".")[0] for a in node.names]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                bound = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                bound = [node.name] if isinstance(node, (ast.ClassDef, *patching._FUNCTION)) else []
            if name in bound:
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
        if not isinstance(node, patching._FUNCTION):
            return []
        return [n.value.id for n in ast.walk(node) if isinstance(n, ast.Return) and isinstance(n.value, ast.Name)]


def _definitions(body: list[ast.stmt]) -> list[Any]:
    """The classes and functions of ``body``, ``@typing.overload`` stubs left out."""
    return [
        node
        for node in body
        if isinstance(node, (ast.ClassDef, *patching._FUNCTION))
        and not any(ast.unparse(d).rpartition(".")[2] == "overload" for d in node.decorator_list)
    ]


class UpstreamTree:
    """A release's source files laid out as installed (``vllm_ascend/...``, ``vllm/...``), possibly
    over several roots, and the versions they come from."""

    def __init__(self, roots: Iterable[Path], versions: dict[str, str]) -> None:
        self.roots = tuple(Path(r) for r in roots)
        self.versions = dict(versions)
        self._cache: dict[str, ModuleSource | None] = {}

    def has_module(self, module: str) -> bool:
        return self._path(module) is not None

    def _path(self, module: str) -> Path | None:
        relative = module.replace(".", "/")
        candidates = ((root / f"{relative}.py", root / relative / "__init__.py") for root in self.roots)
        return next((path for pair in candidates for path in pair if path.is_file()), None)

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
        code = self.code(module, qualname)
        if code is None:
            found = "no such module" if self.module(module) is None else f"{module} without it"
            return unsupported(f"{module}:{qualname}", found)
        return rule(code)
