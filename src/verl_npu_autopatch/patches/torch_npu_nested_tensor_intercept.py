"""``torch_npu.nested_tensor_intercept``: remove torch_npu's "not supported in npu" intercept from
``torch.nested.nested_tensor`` and ``torch.nested.as_nested_tensor``.

Up to the 2.6 line, ``import torch_npu`` wraps both functions (``torch_npu/utils/npu_intercept.py``,
``_add_intercept_methods`` over ``unsupport_api.unsupported_nested_api``) with a
``functools.wraps`` wrapper that raises ``RuntimeError("... is not supported in npu.")`` as soon as
a tensor of the list is on the NPU, although jagged nested tensors work there (verl builds them
for packed sequences; verl PR #4309). verl restores ``__wrapped__`` of whatever wrapper it finds;
this patch removes only torch_npu's own wrapper, recognised by where its code lives (module
``torch_npu.utils.npu_intercept``, function ``wrapper``); a wrapper anyone else installed is left
in place (the record says ``yielded`` and names it). Releases whose ``unsupport_api`` lists no
``torch.nested`` function (of those read: 2.7.1.post11 on) leave both untouched: ``fixed-upstream``,
as long as both are torch's own plain functions (defined in ``torch.nested``, wrapping nothing);
that side reads torch's code, so the decision table decides it per torch release too, from
``torch/nested/__init__.py`` (a definition without decorators), through the same rule.

The target is reached through ``torch_npu``'s own ``torch`` so the post-import hook fires when
``torch_npu`` has finished loading, i.e. after it installed the intercept (also when torch's
device-backend autoload imports ``torch_npu`` from ``import torch``).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    ModuleSource,
    Patch,
    Reach,
    Site,
    StaticRule,
    Target,
    Undo,
    UpstreamTree,
    Verdict,
    chain,
    fixed_upstream,
    marked_by,
    set_marked,
    signature_of,
    unsupported,
)

NAME = "torch_npu.nested_tensor_intercept"
INTERCEPT = "torch_npu.utils.npu_intercept"
INTERCEPT_FILE = "torch_npu/utils/npu_intercept.py"
NESTED_FILE = "torch/nested/__init__.py"
UNSUPPORT = "torch_npu.utils.unsupport_api"
FUNCTIONS = ("nested_tensor", "as_nested_tensor")
NESTED = "torch.nested"


def _defining_module(fn: Any) -> str | None:
    """The module whose code defines ``fn`` (``functools.wraps`` copies ``__module__`` from the
    wrapped function, so that attribute cannot tell)."""
    globals_ = getattr(fn, "__globals__", None)
    return globals_.get("__name__") if isinstance(globals_, dict) else None


def is_intercept(fn: Any) -> bool:
    """Whether ``fn`` is torch_npu's intercept wrapper: the ``wrapper`` closure of
    ``npu_intercept._create_wrap_func``, made with ``functools.wraps`` (so ``__wrapped__`` is set)."""
    code = getattr(fn, "__code__", None)
    return (
        code is not None
        and code.co_name == "wrapper"
        and code.co_filename.replace("\\", "/").endswith(INTERCEPT_FILE)
        and _defining_module(fn) == INTERCEPT
        and callable(getattr(fn, "__wrapped__", None))
    )


def kind(fn: Any) -> str:
    """``ours``, ``intercept`` (torch_npu's), ``plain`` (torch's own function) or ``foreign``."""
    if marked_by(fn) == NAME:
        return "ours"
    if is_intercept(fn):
        return "intercept"
    if _defining_module(fn) == NESTED and not hasattr(fn, "__wrapped__"):
        return "plain"
    return "foreign"


def owner_name(fn: Any) -> str:
    """``module.function`` where ``fn``'s code is defined (not the ``__module__`` it copied)."""
    code = getattr(fn, "__code__", None)
    name = getattr(code, "co_qualname", None) or getattr(code, "co_name", None) or type(fn).__name__
    return f"{_defining_module(fn) or getattr(fn, '__module__', '?')}.{name}"


def _live(site: Site) -> dict[str, Any]:
    return {name: getattr(site.owner, name, None) for name in FUNCTIONS}


def nested_rule(kinds: dict[str, str]) -> Verdict:
    """Decide from the kind of each live ``torch.nested`` function."""
    if "intercept" in kinds.values():
        return APPLY
    if all(k in ("plain", "ours") for k in kinds.values()):
        return fixed_upstream("torch_npu installed no intercept on torch.nested.nested_tensor / as_nested_tensor")
    return unsupported("torch.nested functions wrapped by torch_npu's npu_intercept", str(kinds))


def _check(site: Site) -> Verdict:
    return nested_rule({name: kind(fn) for name, fn in _live(site).items()})


def _other_owner(site: Site) -> str | None:
    """Yield when no torch_npu intercept is there but someone else wraps or replaced a function."""
    live = _live(site)
    if any(kind(fn) == "intercept" for fn in live.values()):
        return None
    foreign = [f"{name} by {owner_name(fn)}" for name, fn in live.items() if kind(fn) == "foreign"]
    return "; ".join(foreign) or None


def _fix(site: Site) -> Undo:
    undos = []
    for name, fn in _live(site).items():
        if kind(fn) != "intercept":
            continue  # torch's own, ours already, or someone else's wrapper: left in place
        original = fn.__wrapped__

        @functools.wraps(original)
        def unintercepted(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            return _original(*args, **kwargs)

        # No ``__wrapped__``: verl's ``import verl`` restores ``__wrapped__`` of whatever is there,
        # which would replace ours and leave the record claiming a target it no longer holds.
        del unintercepted.__wrapped__
        # functools.wraps' result type declares no __signature__; inspect.signature reads it
        unintercepted.__signature__ = signature_of(original)  # type: ignore[attr-defined]
        undos.append(set_marked(site.owner, name, unintercepted, site.patch.name))
    return chain(*undos)


# --------------------------------------------------------------------------- release sources
def _nested_entries(source: ModuleSource) -> list[str]:
    """Names mapped to ``torch.nested`` in the dict literals of ``unsupport_api.py``."""
    names = []
    for node in source.tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(key, ast.Constant) and ast.unparse(value) == NESTED:
                    names.append(str(key.value))
    return names


def _static(tree: UpstreamTree) -> Verdict:
    """The same decision from a torch_npu release's ``unsupport_api.py`` and ``npu_intercept.py``:
    ``apply`` when they wrap a ``torch.nested`` function with a wrapper :func:`is_intercept`
    recognises (a ``functools.wraps`` closure named ``wrapper`` that raises "not supported in npu")."""
    api = tree.module(UNSUPPORT)
    if api is None:
        return fixed_upstream("the release has no torch_npu/utils/unsupport_api.py: nothing intercepts torch.nested")
    nested = _nested_entries(api)
    if not nested:
        return fixed_upstream("unsupport_api lists no torch.nested function: torch_npu leaves them alone")
    intercept = tree.module(INTERCEPT)
    wrap = intercept.code("_create_wrap_func") if intercept is not None else None
    if wrap is None or not wrap.has("@wraps(func)", "defwrapper(*args,**kwargs):", "isnotsupportedinnpu"):
        return unsupported(
            "npu_intercept._create_wrap_func making a functools.wraps 'wrapper' that raises", "another wrapper"
        )
    return APPLY


def _torch_kind(source: ModuleSource | None, name: str) -> str:
    """What :func:`kind` finds for torch's own ``name`` where torch_npu installs nothing: ``plain``
    when ``torch/nested/__init__.py`` defines it without decorators (one may wrap it or move its code)."""
    node = None if source is None else source.function_node(name)
    return "plain" if node is not None and not node.decorator_list else "foreign"


def _torch_static(tree: UpstreamTree) -> Verdict:
    """A torch release's ``torch.nested``, read: the decision where torch_npu intercepts nothing."""
    source = tree.module(NESTED)
    return nested_rule({name: _torch_kind(source, name) for name in FUNCTIONS})


def _torch_note(tree: UpstreamTree) -> str:
    """What torch's cell decides: the patch where torch_npu installs no intercept."""
    return "the decision where torch_npu intercepts nothing (torch_npu 2.7.1.post11 on: see torch-npu's section)"


PATCHES = [
    Patch(
        name=NAME,
        summary="Removes torch_npu's 'not supported in npu' wrapper from torch.nested.nested_tensor/as_nested_tensor.",
        reference="https://github.com/verl-project/verl/pull/4309",
        groups=("torch_npu",),
        targets=(Target.parse("torch_npu:torch.nested.nested_tensor"),),
        reach=Reach(secondary=(Target.parse("torch_npu:torch.nested.as_nested_tensor"),)),
        check=_check,
        fix=_fix,
        yields_to=(_other_owner,),
        static=StaticRule(
            _static,
            reads=(INTERCEPT_FILE, "torch_npu/utils/unsupport_api.py"),
            also=(StaticRule(_torch_static, reads=(NESTED_FILE,), note=_torch_note),),
        ),
    ),
]
