"""Automatic arbitration with Liger-Kernel: one owner per target, in either order.

Liger first: every ``transformers_npu`` patch carries the ``liger_owner`` detector and records
``yielded`` when the live target already comes from liger_kernel.

Liger after us: this patch wraps liger's ``apply_liger_kernel_to_<family>`` functions for our
families — the module attributes *and* the entries of ``MODEL_TYPE_TO_APPLY_LIGER_FN``, which
``_apply_liger_kernel_to_instance`` (verl's call) and ``_apply_liger_kernel`` look up. Once the
Liger function has run, the wrapper hands over (``Engine.yield_to``: revert, record ``yielded``
naming the Liger function) each of our patches on that model that the Liger function replaces:
its switch (``rms_norm`` → RMSNorm, ``swiglu`` → MLP and experts, ``rope`` → rotary) is on *and*
the function's own code rebinds our target's class or function under that switch
(:func:`rebound_names`, read from the installed Liger: e.g. Liger 0.8.5's Qwen3-MoE ``swiglu``
takes the experts but not ``Qwen3MoeMLP``, and Qwen3-VL has no ``swiglu`` code at all). The
others stay ours, and the record says so; a target Liger took anyway is handed over too. When
the Liger function raises (Liger 0.8.5's Qwen3-VL code cannot import on transformers 5.24), only
what it rebound before failing is handed over.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    ComputedSites,
    HandOver,
    Patch,
    Reach,
    Site,
    Target,
    Undo,
    Verdict,
    chain,
    marked_by,
    parameter_names,
    set_entry,
    set_marked,
    signature_text,
    unsupported,
)
from verl_npu_autopatch.authoring import definition as parsed_definition
from verl_npu_autopatch.engine.ownership import lookup
from verl_npu_autopatch.patches.transformers_npu.models import MODELS, kinds, patch_name
from verl_npu_autopatch.patches.transformers_npu.owners import from_package
from verl_npu_autopatch.patches.transformers_npu.table import KERNELS

NAME = "liger.arbitration"
MODULE = "liger_kernel.transformers.monkey_patch"
TABLE = "MODEL_TYPE_TO_APPLY_LIGER_FN"
DISPATCHERS = ("_apply_liger_kernel_to_instance", "_apply_liger_kernel")

#: Our kernel kind -> the Liger switch that replaces the same target (from the kernel table ``KERNELS``).
LIGER_SWITCH = {kind: kernel.liger for kind, kernel in KERNELS.items() if kernel.liger}

_via = threading.local()


def _apply_functions(module: Any) -> dict[str, Callable]:
    """Our family -> liger's ``apply_liger_kernel_to_<family>`` present in ``module``."""
    found = {}
    for family in MODELS:
        fn = getattr(module, f"apply_liger_kernel_to_{family}", None)
        if callable(fn):
            found[family] = fn
    return found


def rebound_sites(module: Any) -> tuple[str, ...]:
    """What :func:`_fix` rebinds besides its target, in the live ``module``: the apply function of
    each of our families, and each dispatch-table entry holding one of them (upstream's or ours)."""
    functions = _apply_functions(module)
    ours = {id(fn) for fn in functions.values()}
    table = getattr(module, TABLE, None)
    entries = [key for key, fn in table.items() if id(fn) in ours] if isinstance(table, dict) else []
    return (*(f"apply_liger_kernel_to_{family}" for family in functions), *(f"{TABLE}[{key}]" for key in entries))


def _check(site: Site) -> Verdict:
    """Liger's monkey_patch must have the dispatch table, the instance entry point taking
    ``model`` first, and apply functions for at least one of our families."""
    module = site.module
    if not isinstance(getattr(module, TABLE, None), dict):
        return unsupported(f"{MODULE}.{TABLE} (a dict)", type(getattr(module, TABLE, None)).__name__)
    if (parameter_names(site.value) or ())[:1] != ("model",):
        found = signature_text(parameter_names(site.value))
        return unsupported("_apply_liger_kernel_to_instance(model, **kwargs)", found)
    if not _apply_functions(module):
        return unsupported("apply_liger_kernel_to_<qwen family> functions", "none")
    return APPLY


def _liger_took(target: str) -> bool:
    """Whether the live ``module:qualname`` (or the class holding it) now comes from liger_kernel."""
    module_name, _, qualname = target.partition(":")
    module = sys.modules.get(module_name)
    found = lookup(module, qualname) if module is not None and qualname else None
    if found is None:
        return False
    holder, value = found
    return from_package("liger_kernel", value, holder)


def rebound_names(function: Callable) -> dict[str, set[str]] | None:
    """Liger's switch parameter -> the module attributes ``function`` rebinds (``x.Name = ...``)
    in the branches that run when that switch is on, with branches on module-level booleans
    (``IS_TRANSFORMERS_V5_OR_LATER``) decided by their live value; ``None`` without source."""
    function = inspect.unwrap(function)
    definition = parsed_definition(function)
    if not isinstance(definition, ast.FunctionDef):
        return None
    switches = {arg.arg for arg in definition.args.args + definition.args.kwonlyargs}
    flags = getattr(function, "__globals__", {})
    found: dict[str, set[str]] = {switch: set() for switch in switches}

    def visit(statements: list[ast.stmt], active: frozenset[str]) -> None:
        for statement in statements:
            if isinstance(statement, ast.If):
                test = statement.test
                name = test.id if isinstance(test, ast.Name) else None
                if name in switches:
                    visit(statement.body, active | {name})
                    visit(statement.orelse, active)
                elif name is not None and isinstance(flags.get(name), bool):
                    visit(statement.body if flags[name] else statement.orelse, active)
                else:
                    visit(statement.body, active)
                    visit(statement.orelse, active)
                continue
            if isinstance(statement, ast.Assign):
                for target in statement.targets:
                    if isinstance(target, ast.Attribute):
                        for switch in active:
                            found[switch].add(target.attr)
            if isinstance(statement, (ast.For, ast.While, ast.With, ast.Try)):
                for block in (statement.body, getattr(statement, "orelse", []), getattr(statement, "finalbody", [])):
                    visit(block, active)
                for handler in getattr(statement, "handlers", []):
                    visit(handler.body, active)

    visit(definition.body, frozenset())
    return found


def _holders(target: str) -> set[str]:
    """First qualname parts of a record's target(s): the class or function Liger would rebind."""
    return {part.partition(":")[2].split(".")[0] for part in target.split(" | ")}


def _hand_over_taken(engine: HandOver, patches: list[str], owner: str) -> None:
    """Yield each applied patch whose live target Liger took (rebound) anyway."""
    for patch in patches:
        record = engine.record(patch)
        if record is not None and record.state == "applied" and _liger_took(record.target):
            engine.yield_to(patch, owner)


def _wrap_apply(original: Callable, family: str, engine: HandOver, name: str) -> Callable:
    try:
        signature: inspect.Signature | None = inspect.signature(original)
    except (TypeError, ValueError):  # not inspectable: no switch is read, ours are handed over only where Liger rebinds
        signature = None
    rebound = rebound_names(original)
    ours = [(kind, patch_name(family, kind)) for kind in kinds(family)]

    @functools.wraps(original)
    def apply(*args: Any, **kwargs: Any) -> Any:
        via = getattr(_via, "name", None)
        owner = f"liger-kernel ({via + ' -> ' if via else ''}{original.__name__})"
        switches: dict[str, Any] = {}
        if signature is not None:
            try:
                bound = signature.bind_partial(*args, **kwargs)
                bound.apply_defaults()
                switches = dict(bound.arguments)
            except TypeError:  # arguments Liger's function rejects: the call below raises, and ours stay
                switches = {}
        handed, kept = [], []
        for kind, patch in ours:
            switch = LIGER_SWITCH.get(kind)
            if switch is None or switch not in switches:
                kept.append(patch)
                continue
            if not switches[switch]:
                continue
            record = engine.record(patch)
            if rebound is None or record is None or _holders(record.target) & rebound.get(switch, set()):
                handed.append(patch)
            else:
                kept.append(patch)
                engine.note(patch, f"kept: {original.__name__}({switch}=True) does not replace {record.target}")
        try:
            result = original(*args, **kwargs)
        except BaseException:
            _hand_over_taken(engine, [*handed, *kept], owner)  # ours stays where Liger failed to take over
            raise
        for patch in handed:
            engine.yield_to(patch, owner)
        _hand_over_taken(engine, kept, owner)
        return result

    return apply


def _wrap_dispatcher(original: Callable) -> Callable:
    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        outer = getattr(_via, "name", None)
        _via.name = outer or original.__name__
        try:
            return original(*args, **kwargs)
        finally:
            _via.name = outer

    return dispatch


def _fix(site: Site) -> Undo:
    """Wrap the apply functions (attributes and dispatch-table entries) and the dispatchers."""
    module, name = site.module, site.patch.name
    engine = site.handover
    if engine is None:  # the engine passes itself; a hand-built Site cannot arbitrate with Liger
        raise TypeError(f"{name} needs the engine applying it (Site.handover)")
    undos: list[Undo] = []
    wrapped: dict[int, Callable] = {}
    for family, fn in _apply_functions(module).items():
        if marked_by(fn) == name:
            continue
        wrapper = _wrap_apply(fn, family, engine, name)
        wrapped[id(fn)] = wrapper
        undos.append(set_marked(module, fn.__name__, wrapper, name))
    table = getattr(module, TABLE)
    for key, entry in list(table.items()):
        replacement = wrapped.get(id(entry))
        if replacement is not None:
            undos.append(set_entry(table, key, replacement))
    for dispatcher in DISPATCHERS:
        live = getattr(module, dispatcher, None)
        if callable(live) and marked_by(live) != name:
            undos.append(set_marked(module, dispatcher, _wrap_dispatcher(live), name))
    return chain(*undos)


PATCHES: list[Patch] = [
    Patch(
        name=NAME,
        summary="Hand our transformers kernels to Liger-Kernel when it is applied to the same model.",
        reference="https://github.com/verl-project/verl/pull/6244",
        groups=("transformers", "liger"),
        targets=(Target(MODULE, DISPATCHERS[0]),),
        reach=Reach(
            secondary=(Target(MODULE, DISPATCHERS[1]),),
            computed=(ComputedSites(MODULE, f"apply_liger_kernel_to_<family>, {TABLE}[<model type>]", rebound_sites),),
        ),
        requires=("liger-kernel",),
        device="npu-device",
        default=True,
        check=_check,
        fix=_fix,
    )
]
