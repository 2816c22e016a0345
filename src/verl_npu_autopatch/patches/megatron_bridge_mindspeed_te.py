"""``megatron.bridge_mindspeed_te``: Megatron-Bridge's ``AutoMapping`` converts MindSpeed's TE module
classes as the Transformer Engine classes they replace.

With MindSpeed's TE spec (``transformer_impl=transformer_engine`` on NPU), MindSpeed swaps
megatron-core's TE layers for its own ``MindSpeedTE*`` classes (its ``transformer_engine_basic``
feature). ``AutoMapping._detect_parallelism_type`` (``megatron/bridge/models/conversion/param_mapping.py``)
finds a module's parallelism by its class name: TE's fused layernorm+linear by exact name, then
``_MODULE_TYPE_REGISTRY``, then a module's own ``tensor_model_parallel``, then any name containing
``Norm`` as replicated, then it raises. Every release lists no MindSpeed class, so up to 0.4.2
``MindSpeedTELayerNormColumnParallelLinear`` (the name contains "Norm") is exported as replicated: each
TP rank's shard of a column-parallel weight passes for the whole weight (a silent wrong HF export). The
grouped linears (which set ``partition_dim`` but no ``tensor_model_parallel``) and
``MindSpeedTELayernorm`` raise "Cannot determine parallelism type" (verl PR #7218, unmerged; the same
fix by hand in vime, miles and slime).

The fix wraps the method: a MindSpeed module in :data:`COUNTERPARTS` is handed to the release's own
detection under the name of the TE class it replaces (its attributes read through), so each gets that
release's TE rule. The fused class gets the per-parameter rule: ``layer_norm_weight`` and
``layer_norm_bias`` replicated, the rest column. The hand fixes register that class as ``column``,
which would split the norm weight too. Opt-in (group ``megatron_bridge``): only Megatron-Bridge with
MindSpeed's TE spec builds these modules. The device gate stays ``npu-stack`` (torch_npu installed, no
NPU needed): MindSpeed imports torch_npu, so its classes exist only there, and a conversion may run
where no NPU is visible.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Patch,
    Site,
    StaticRule,
    Target,
    UpstreamTree,
    Verdict,
    fixed_upstream,
    params_mismatch,
    unsupported,
    wrapping_fix,
)

MODULE = "megatron.bridge.models.conversion.param_mapping"
CLASS = "AutoMapping"
METHOD = "_detect_parallelism_type"
PARAMS = ("self", "module")
FILE = "megatron/bridge/models/conversion/param_mapping.py"
REGISTRY = "_MODULE_TYPE_REGISTRY"
#: MindSpeed's TE classes (MindSpeed master, 26.x, core_r0.15.3 and dev) -> the TE class each
#: replaces. ``MindSpeedTELayernorm`` stands for ``transformer_engine.pytorch.LayerNorm``, the class
#: TE's ``TENorm`` builds.
COUNTERPARTS = {
    "MindSpeedTELayerNormColumnParallelLinear": "TELayerNormColumnParallelLinear",
    "MindSpeedTEColumnParallelGroupedLinear": "TEColumnParallelGroupedLinear",
    "MindSpeedTERowParallelGroupedLinear": "TERowParallelGroupedLinear",
    "MindSpeedTEPerformanceColumnParallelGroupedLinear": "TEColumnParallelGroupedLinear",
    "MindSpeedTEPerformanceRowParallelGroupedLinear": "TERowParallelGroupedLinear",
    "MindSpeedTELayernorm": "LayerNorm",
    "MindSpeedTEDotProductAttention": "TEDotProductAttention",
    "MindSpeedTELinear": "TELinear",
    "MindSpeedTEColumnParallelLinear": "TEColumnParallelLinear",
}
#: The fused layernorm+linear class: its weights are column-parallel, its norm's replicated.
FUSED = "MindSpeedTELayerNormColumnParallelLinear"
#: What the method must do for a TE-named stand-in to get the release's TE rule (whitespace-free).
DETECTS = ("type(module).__name__", f"self.{REGISTRY}.items()", 'endswith("layer_norm_weight")')


@dataclass(frozen=True)
class Known:
    """What ``AutoMapping`` knows beside the method: its registry (parallelism -> class names) and
    its string constants (``_FUSED_LAYER_NORM_COLUMN_PARALLEL_SUBSTRING`` from 0.5.0)."""

    registry: Mapping[str, Collection[str]]
    constants: Mapping[str, str] = field(default_factory=dict)


def knows(name: str, detect: Code, known: Known) -> bool:
    """Whether the release detects class ``name`` by name: in the registry, named in the method, or
    containing a constant the method matches ``in module_type``."""
    if any(name in names for names in known.registry.values()) or detect.has(f'"{name}"'):
        return True
    return any(value in name and detect.has(f"self.{key}inmodule_type") for key, value in known.constants.items())


def detection_rule(detect: Code, known: Known | None) -> Verdict:
    """Decide on ``AutoMapping._detect_parallelism_type`` and what the class knows beside it."""
    mismatch = params_mismatch(detect, PARAMS, METHOD)
    if mismatch:
        return mismatch
    if not detect.has(*DETECTS):
        return unsupported(f"{METHOD} by class name, {REGISTRY} and layer_norm_weight by parameter", "another body")
    if known is None or not {"column", "row", "replicated"} <= set(known.registry):
        return unsupported(f"{CLASS}.{REGISTRY} of column, row and replicated", "another registry")
    missing = [te for te in dict.fromkeys(COUNTERPARTS.values()) if not knows(te, detect, known)]
    if missing:
        return unsupported(f"{CLASS} knowing TE's {', '.join(missing)}", "none")
    # a registry entry gives the fused class one parallelism for all its weights: only the method's
    # own per-parameter handling counts for it
    fused = Known({}, known.constants)
    found = [n for n in COUNTERPARTS if knows(n, detect, fused if n == FUSED else known)]
    if len(found) == len(COUNTERPARTS):
        return fixed_upstream(f"{CLASS} knows every MindSpeed TE class by name")
    known_here = f"{len(found)} ({', '.join(found)})" if found else "none"
    return Verdict(APPLY.action, f"{CLASS} knows {known_here} of MindSpeed's {len(COUNTERPARTS)} TE classes")


def _live_known(owner: Any) -> Known | None:
    registry = getattr(owner, REGISTRY, None)
    if not isinstance(registry, Mapping):
        return None
    constants = {k: v for k, v in vars(owner).items() if isinstance(v, str) and not k.startswith("__")}
    return Known(registry, constants)


def _check(site: Site) -> Verdict:
    return detection_rule(Code.live(site.value), _live_known(site.owner))


def _class_body(tree: UpstreamTree) -> list[ast.stmt]:
    source = tree.module(MODULE)
    found = [n for n in source.tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS] if source else []
    return found[0].body if found else []


def _static_known(tree: UpstreamTree) -> Known | None:
    """The registry and string constants of the release's ``AutoMapping`` class body, read with ``ast``."""
    registry: Any = None
    constants: dict[str, str] = {}
    target: ast.expr
    value: ast.expr
    for statement in _class_body(tree):
        if isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        elif isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == REGISTRY:
            try:
                registry = ast.literal_eval(value)
            except ValueError:  # built by code, not a literal: the rule says unsupported
                registry = None
        elif isinstance(target, ast.Name) and isinstance(value, ast.Constant) and isinstance(value.value, str):
            constants[target.id] = value.value
    return Known(registry, constants) if isinstance(registry, dict) else None


def _static(tree: UpstreamTree) -> Verdict:
    return tree.judge(MODULE, f"{CLASS}.{METHOD}", lambda code: detection_rule(code, _static_known(tree)))


class Counterpart:
    """A MindSpeed module seen under the TE class name it replaces; its attributes read through."""

    __slots__ = ("_module",)

    def __init__(self, module: Any) -> None:
        object.__setattr__(self, "_module", module)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_module"), name)


_STANDINS: dict[str, type[Counterpart]] = {}


def as_counterpart(module: Any) -> Any:
    """``module`` itself, or for a MindSpeed TE class a :class:`Counterpart` of its TE class's name."""
    name = COUNTERPARTS.get(type(module).__name__)
    if name is None:
        return module
    if name not in _STANDINS:
        _STANDINS[name] = type(name, (Counterpart,), {"__slots__": (), "__module__": __name__})
    return _STANDINS[name](module)


def _wrap(site: Site, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _detect_parallelism_type(self: Any, module: Any) -> Any:
        return original(self, as_counterpart(module))

    return _detect_parallelism_type


PATCHES = [
    Patch(
        name="megatron.bridge_mindspeed_te",
        summary="Megatron-Bridge's AutoMapping converts MindSpeed's TE modules as the TE classes they replace.",
        targets=(Target.parse(f"{MODULE}:{CLASS}.{METHOD}"),),
        check=_check,
        fix=wrapping_fix(_wrap),
        groups=("megatron_bridge", "megatron"),
        default=False,
        static=StaticRule(_static, reads=(FILE,)),
        reference="https://github.com/verl-project/verl/pull/7218",
    ),
]
