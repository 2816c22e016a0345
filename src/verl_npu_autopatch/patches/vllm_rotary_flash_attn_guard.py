"""vLLM ``ApplyRotaryEmb.__init__`` without the flash-attn fast path on NPU.

MindSpeed installs a dummy ``flash_attn`` *module* (a single file, not a package). vLLM 0.13 - 0.23
find it with ``find_spec("flash_attn")`` and then ``from flash_attn.ops.triton.rotary import
apply_rotary``, which fails with ``ModuleNotFoundError: No module named 'flash_attn.ops';
'flash_attn' is not a package`` while the model's rotary layers are built (verl #5640, #6224). The
Triton RoPE kernel is unusable on NPU anyway. The fix replaces ``__init__`` with one that calls the
base initialiser with the caller's ``enforce_enable`` (verl's version dropped it, which matters on
310P where custom ops are not forced on), keeps ``is_neox_style`` / ``enable_fp32_compute``, sets
``apply_rotary_emb_flash_attn = None`` and never imports flash_attn.

The check accepts only the upstream body it was written for (parsed with ``ast``): the base call
with ``enforce_enable``, the two plain assignments and the flash-attn import block. Anything else in
the body (new state the replacement would silently drop) records ``unsupported``.

When is the patch redundant (``fixed-upstream``)? Newer vLLM (0.32 in the test environment, also
0.25.1 and 0.33 per the research notes) skips the import on CPU and otherwise runs
``import_module("flash_attn.ops.triton.rotary")`` inside ``suppress(ModuleNotFoundError)``. Decided:
that *is* a fix for this patch's problem, so every flash-attn import in the body sitting under
``suppress(ModuleNotFoundError | ImportError | Exception)`` or a matching ``try``/``except`` records
``fixed-upstream``. Why: importing a submodule of a module that is not a package raises
``ModuleNotFoundError`` (the exact error above), and a missing flash_attn raises it too, so the
upstream guard turns both into ``apply_rotary_emb_flash_attn = None`` while keeping every argument,
which is what the patch does. What upstream still does that the patch would not: it executes the
dummy ``flash_attn`` module once (MindSpeed installs it to be imported; harmless), and a *broken
real* flash-attn whose import raises a plain ``ImportError``/``OSError`` (e.g. a CUDA build with
missing CUDA libraries) would still propagate. That is a broken environment rather than this
patch's bug, and replacing an upstream ``__init__`` that already copes costs more in drift risk
than it buys. The tests pin this on the real classes: unpatched vLLM 0.13.0 and 0.23.0 crash on the
dummy on a non-CPU platform (``scripts/compat-vllm``) and the check says ``apply``; the unpatched
0.32 class tolerates it and the check says ``fixed-upstream``; the replacement imports nothing.

Next to verl: verl 0.9's ``patch_vllm013_rotary_emb`` assigns its own ``__init__`` (no marker, no
``functools.wraps``) that calls the base initialiser without ``enforce_enable``. Ours is strictly
better, so ours (or vLLM's own fixed ``__init__``) is what runs in both orders: run after verl,
the check reads the upstream ``__init__`` from the class's source file (verl kept no reference to
it) and the fix replaces verl's, also when upstream is fixed (verl's would still drop
``enforce_enable``); run before verl, patch ``verl.defer_duplicates`` turns verl's call into a no-op.
"""

from __future__ import annotations

import ast
import functools
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Patch,
    Site,
    StaticRule,
    Target,
    Undo,
    Verdict,
    definition,
    describe,
    fixed_upstream,
    replace_method,
    signature_from_ast,
    signature_of,
    signature_text,
    statements,
    underlying,
    unsupported,
)
from verl_npu_autopatch.patches._verl import verl_owned

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations only: the kit's static reading is not loaded at activation
    from verl_npu_autopatch.authoring import UpstreamTree

TARGET = Target.parse("vllm.model_executor.layers.rotary_embedding.common:ApplyRotaryEmb.__init__")
#: The upstream signature the replacement reproduces (unchanged in vLLM 0.13 ... 0.33).
EXPECTED_SIGNATURE = "(self, enforce_enable=False, is_neox_style=True, enable_fp32_compute=False)"

#: Statements of the upstream body the replacement reproduces, as ``ast.unparse`` prints them.
KNOWN_STATEMENTS = frozenset(
    {
        "super().__init__(enforce_enable)",
        "super().__init__(enforce_enable=enforce_enable)",
        "self.is_neox_style = is_neox_style",
        "self.enable_fp32_compute = enable_fp32_compute",
        "self.apply_rotary_emb_flash_attn = None",
    }
)
_BASE_CALLS = ("super().__init__(enforce_enable)", "super().__init__(enforce_enable=enforce_enable)")
_REQUIRED = frozenset({"self.is_neox_style = is_neox_style", "self.enable_fp32_compute = enable_fp32_compute"})

#: Exceptions whose handler tolerates ``ModuleNotFoundError`` from a missing or dummy flash_attn.
_TOLERANT = frozenset({"ModuleNotFoundError", "ImportError", "Exception", "BaseException"})


def _body(func: Any, owner: Any = None) -> list[ast.stmt] | None:
    """The statements of ``func``'s body, or ``None`` without source. With ``owner`` (a class):
    the body of the ``__init__`` written in the class's own source instead."""
    node: Any = definition(owner if owner is not None else func)
    if owner is not None and isinstance(node, ast.ClassDef):
        node = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return statements(node)


def _is_flash_attn_import(node: ast.AST) -> bool:
    """An import statement or ``import_module``/``__import__`` call naming flash_attn."""
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "flash_attn" for alias in node.names)
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == "flash_attn"
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0]
        return (
            name in ("import_module", "__import__")
            and isinstance(first, ast.Constant)
            and isinstance(first.value, str)
            and first.value.split(".")[0] == "flash_attn"
        )
    return False


def _names(node: ast.expr | None) -> set[str]:
    """Exception class names in a handler type or ``suppress`` argument."""
    if node is None:
        return {"BaseException"}  # bare ``except:``
    if isinstance(node, ast.Tuple):
        return set().union(*(_names(item) for item in node.elts))
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Name):
        return {node.id}
    return set()


def _guards(node: ast.AST) -> bool:
    """Whether ``node`` (a ``with`` or ``try``) swallows ModuleNotFoundError for its body."""
    if isinstance(node, ast.With):
        for item in node.items:
            call = item.context_expr
            if isinstance(call, ast.Call):
                func = call.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name == "suppress" and any(_names(arg) & _TOLERANT for arg in call.args):
                    return True
        return False
    if isinstance(node, ast.Try):
        return any(_names(handler.type) & _TOLERANT for handler in node.handlers)
    return False


def _unguarded_imports(stmt: ast.stmt) -> tuple[int, int]:
    """``(flash-attn imports in stmt, how many of them are not under a tolerant guard)``."""
    total = unguarded = 0

    def visit(node: ast.AST, guarded: bool) -> None:
        nonlocal total, unguarded
        child: ast.AST
        if _is_flash_attn_import(node):
            total += 1
            unguarded += not guarded
        if isinstance(node, ast.Try):  # only the try body is guarded, not handlers/else/finally
            for child in node.body:
                visit(child, guarded or _guards(node))
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, guarded)
            return
        inner = guarded or (isinstance(node, ast.With) and _guards(node))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(stmt, False)
    return total, unguarded


def rotary_rule(signature: str | None, body: list[ast.stmt] | None, what: str) -> Verdict:
    """Decide on vLLM's own ``ApplyRotaryEmb.__init__`` from its signature text and body statements."""
    if signature != EXPECTED_SIGNATURE:
        return unsupported(f"__init__{EXPECTED_SIGNATURE}", f"{what}{signature or ' without a signature'}")
    if body is None:
        return unsupported("inspectable Python source of ApplyRotaryEmb.__init__", "no source")
    imports = unguarded = 0
    unknown, seen = [], set()
    for stmt in body:
        text = ast.unparse(stmt)
        found, open_ = _unguarded_imports(stmt)
        if found:
            imports, unguarded = imports + found, unguarded + open_
        elif text in KNOWN_STATEMENTS:
            seen.add(text)
        else:
            unknown.append(text.splitlines()[0][:100])
    if not imports:
        return fixed_upstream("ApplyRotaryEmb.__init__ no longer imports flash_attn")
    if not unguarded:
        return fixed_upstream(
            "ApplyRotaryEmb.__init__ guards its flash_attn import (suppress/except ModuleNotFoundError), "
            "so a missing or dummy non-package flash_attn leaves apply_rotary_emb_flash_attn = None"
        )
    if unknown or not seen & set(_BASE_CALLS) or not _REQUIRED.issubset(seen):
        return unsupported(
            "a body of super().__init__(enforce_enable), self.is_neox_style/enable_fp32_compute "
            "assignments and the flash_attn import",
            "; ".join(unknown) if unknown else "only " + "; ".join(sorted(seen)),
        )
    return APPLY


def _check(site: Site) -> Verdict:
    """Apply only to the known upstream ``__init__`` whose flash-attn import is unguarded, or
    over verl's replacement of it."""
    func = underlying(site.value)
    verl = verl_owned(func)
    signature = signature_of(func)
    text = None if signature is None else signature_text(signature)
    verdict = rotary_rule(text, _body(func, site.owner if verl else None), describe(func))
    if verl is None or verdict.action == "unsupported":
        return verdict
    upstream = "copes with a dummy flash_attn" if verdict.action == "fixed-upstream" else "needs this fix"
    return Verdict("apply", f"replaces verl's {verl}, which drops enforce_enable (vLLM's own __init__ {upstream})")


def make_init(owner: type[Any]) -> Any:
    """The factory for ``replace_method``: an ``__init__`` of ``owner`` that never imports flash_attn."""

    def make(original: Any) -> Any:
        def __init__(
            self: Any,
            enforce_enable: bool = False,
            is_neox_style: bool = True,
            enable_fp32_compute: bool = False,
        ) -> None:
            super(owner, self).__init__(enforce_enable=enforce_enable)
            self.is_neox_style = is_neox_style
            self.enable_fp32_compute = enable_fp32_compute
            self.apply_rotary_emb_flash_attn = None

        if verl_owned(original) is None:
            functools.update_wrapper(__init__, original)
        else:  # verl's replacement: name ours after the upstream method, not after verl's
            __init__.__module__, __init__.__qualname__ = owner.__module__, f"{owner.__qualname__}.__init__"
        return __init__

    return make


def _fix(site: Site) -> Undo:
    """Install the flash-attn-free ``__init__`` on the class."""
    return replace_method(site.owner, site.attribute, make_init(site.owner), site.patch.name)


def _static(tree: UpstreamTree) -> Verdict:
    target = TARGET
    module = tree.module(target.module)
    node = module.function_node(target.qualname) if module is not None else None
    if node is None:
        return unsupported(str(target), f"{target.module} without it" if module else f"{target.module} is missing")
    body = statements(node)
    try:
        signature: str | None = signature_text(signature_from_ast(node))
    except ValueError:  # a non-literal default
        signature = None
    return rotary_rule(signature, body, target.qualname)


PATCHES = [
    Patch(
        name="vllm.rotary_flash_attn_guard",
        summary=(
            "ApplyRotaryEmb never imports flash_attn on NPU (MindSpeed's dummy flash_attn module breaks "
            "the import); keeps enforce_enable and every other argument; fixed upstream where vLLM "
            "guards the import."
        ),
        reference="https://github.com/verl-project/verl/issues/6224",
        groups=("vllm",),
        targets=(TARGET,),
        device="npu-stack",
        default=True,
        check=_check,
        fix=_fix,
        static=StaticRule(_static, reads=("vllm/model_executor/layers/rotary_embedding/common.py",)),
    ),
]
