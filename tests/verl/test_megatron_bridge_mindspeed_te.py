"""``megatron.bridge_mindspeed_te`` on Megatron-Bridge's real ``param_mapping.py`` (each release's file
executed whole, with megatron-core imported from its wheel's files; Bridge's two helper modules it
imports from, which need transformers, rich and Megatron-LM, are left out as empty names). The modules
are stand-ins with MindSpeed's class names and the attributes MindSpeed's classes set. The doubles are
for the device only: a tensor-parallel group of two whose ``all_gather`` hands back both ranks' shards."""

from __future__ import annotations

import importlib.util
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.support import release_loaders
from tests.verl.helpers import forget_megatron, import_megatron, record, release_root, start
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.lifecycle import Engine
from verl_npu_autopatch.patches import megatron_bridge_mindspeed_te as family

(PATCH,) = family.PATCHES
#: Every release read by the table; 0.3.x pins megatron-core < 0.17.
RELEASES = ("0.3.0", "0.3.1", "0.4.0", "0.4.1", "0.4.2", "0.5.0", "0.5.1", "0.6.0", "0.6.1", "0.6.2")
CORE = {"0.3.0": "0.16.1", "0.3.1": "0.16.1"}
#: Before 0.5.0 the fused class's "Norm" sends it to replicated; from 0.5.0 a substring rule catches it.
NORM_FALLBACK = ("0.3.0", "0.3.1", "0.4.0", "0.4.1", "0.4.2")
HELPERS = {
    "megatron.bridge.models.conversion.utils": {
        "get_module_and_param_from_name": None,
        "remove_non_pickleables": None,
        "is_modelopt_dynamic_module": lambda module: False,  # the release's answer without modelopt
    },
    "megatron.bridge.utils.common_utils": {"extract_expert_number_from_param": None},
}


@release_loaders.loads(family, "megatron-bridge", RELEASES, sites={"0.6.2": {str(PATCH.targets[0])}})
@pytest.fixture
def bridge_mapping(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Execute a release's ``param_mapping.py`` under its real name on its megatron-core."""

    def load(version: str) -> types.ModuleType:
        import_megatron(monkeypatch, CORE.get(version, "0.17.0"), "megatron.core")
        for name in ("megatron.bridge", "megatron.bridge.models", "megatron.bridge.models.conversion"):
            package = types.ModuleType(name)
            package.__path__ = []
            monkeypatch.setitem(sys.modules, name, package)
        for name, values in HELPERS.items():
            monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(__name__=name, **values))
        path = release_root("megatron-bridge", version) / family.FILE
        spec = importlib.util.spec_from_file_location(family.MODULE, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, family.MODULE, module)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec.loader.exec_module(module)
        return module

    yield load
    forget_megatron()


# ----------------------------------------------------------------------------- MindSpeed's modules
class MindSpeedTELayerNormColumnParallelLinear(torch.nn.Module):
    """Fused norm + column-parallel linear: ``weight``/``bias`` split by rows, the norm's whole."""

    def __init__(self, rows: torch.Tensor, norm: torch.Tensor) -> None:
        super().__init__()
        self.parallel_mode = "column"
        self.weight = torch.nn.Parameter(rows)
        self.layer_norm_weight = torch.nn.Parameter(norm)


class MindSpeedTEGroupedLinear(torch.nn.Module):
    """MindSpeed's grouped linear: ``partition_dim`` and ``parallel_mode``, no ``tensor_model_parallel``."""

    mode = ""

    def __init__(self) -> None:
        super().__init__()
        self.parallel_mode = self.mode
        self.partition_dim = {"column": 0, "row": 1}[self.mode]
        self.weight0 = torch.nn.Parameter(torch.zeros(2, 2))


class MindSpeedTEColumnParallelGroupedLinear(MindSpeedTEGroupedLinear):
    mode = "column"


class MindSpeedTERowParallelGroupedLinear(MindSpeedTEGroupedLinear):
    mode = "row"


class MindSpeedTEPerformanceColumnParallelGroupedLinear(MindSpeedTEGroupedLinear):
    mode = "column"


class MindSpeedTEPerformanceRowParallelGroupedLinear(MindSpeedTEGroupedLinear):
    mode = "row"


class MindSpeedTELayernorm(torch.nn.LayerNorm):
    def __init__(self) -> None:
        super().__init__(4)


class MindSpeedTEDotProductAttention(torch.nn.Module):
    pass


class MindSpeedTELinear(torch.nn.Module):
    def __init__(self, parallel_mode: str) -> None:
        super().__init__()
        self.parallel_mode = parallel_mode


class MindSpeedTEColumnParallelLinear(torch.nn.Module):
    pass


def _modules() -> dict[str, torch.nn.Module]:
    """One module per MindSpeed class (``MindSpeedTELinear`` in each of its modes)."""
    fused = MindSpeedTELayerNormColumnParallelLinear(torch.zeros(2, 4), torch.ones(4))
    found: dict[str, torch.nn.Module] = {"fused": fused, "layernorm": MindSpeedTELayernorm()}
    for cls in MindSpeedTEGroupedLinear.__subclasses__():
        found[cls.__name__] = cls()
    found["attention"] = MindSpeedTEDotProductAttention()
    found.update({f"linear {m}": MindSpeedTELinear(m) for m in ("column", "row", "duplicated")})
    found["column linear"] = MindSpeedTEColumnParallelLinear()
    return found


def _enabled(engines: list[Engine]) -> Engine:
    """An activated private engine with the opt-in group ``megatron_bridge`` turned on, device forced to NPU."""
    engine = Engine([PATCH], Config(device="npu", enable=frozenset({"megatron_bridge"})))
    engines.append(engine)
    engine.activate()
    return engine


def _detect(module: types.ModuleType, param: str, target: torch.nn.Module) -> str:
    mapping = module.AutoMapping(param, "hf." + param)
    return mapping._detect_parallelism_type(target)


def _te_named(name: str, like: torch.nn.Module) -> torch.nn.Module:
    """A module of TE's class ``name`` with ``like``'s attributes: what the release itself decides for TE."""
    twin = type(name, (torch.nn.Module,), {})()
    twin.__dict__.update({k: v for k, v in vars(like).items() if not k.startswith("_")})
    return twin


# ----------------------------------------------------------------------------- without the patch
@pytest.mark.parametrize("version", RELEASES)
def test_without_the_patch_the_release_misroutes_or_rejects_mindspeeds_classes(
    bridge_mapping: Any, version: str
) -> None:
    module = bridge_mapping(version)
    found = _modules()
    fused = _detect(module, "decoder.layers.0.self_attention.linear_qkv.weight", found["fused"])
    assert fused == ("replicated" if version in NORM_FALLBACK else "column")
    for name in ("MindSpeedTEColumnParallelGroupedLinear", "MindSpeedTERowParallelGroupedLinear", "layernorm"):
        with pytest.raises(ValueError, match="Cannot determine parallelism type"):
            _detect(module, "decoder.layers.0.mlp.linear_fc1.weight", found[name])


def test_the_patch_is_opt_in(bridge_mapping: Any, engines: list) -> None:
    bridge_mapping("0.6.2")
    assert record(start(engines, [PATCH]), PATCH.name)[0] == "disabled"


# ----------------------------------------------------------------------------- with the patch
#: (module key, parameter, the TE class whose rule it must get)
CASES = [
    ("fused", "decoder.layers.0.self_attention.linear_qkv.weight", "TELayerNormColumnParallelLinear"),
    ("fused", "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "TELayerNormColumnParallelLinear"),
    ("fused", "decoder.layers.0.mlp.linear_fc1.layer_norm_bias", "TELayerNormColumnParallelLinear"),
    (
        "MindSpeedTEColumnParallelGroupedLinear",
        "decoder.layers.0.mlp.experts.linear_fc1.weight0",
        "TEColumnParallelGroupedLinear",
    ),
    (
        "MindSpeedTERowParallelGroupedLinear",
        "decoder.layers.0.mlp.experts.linear_fc2.weight0",
        "TERowParallelGroupedLinear",
    ),
    (
        "MindSpeedTEPerformanceColumnParallelGroupedLinear",
        "decoder.layers.0.mlp.experts.linear_fc1.weight0",
        "TEColumnParallelGroupedLinear",
    ),
    (
        "MindSpeedTEPerformanceRowParallelGroupedLinear",
        "decoder.layers.0.mlp.experts.linear_fc2.weight0",
        "TERowParallelGroupedLinear",
    ),
    ("layernorm", "decoder.final_layernorm.weight", "LayerNorm"),
    ("attention", "decoder.layers.0.self_attention.core_attention.softmax_offset", "TEDotProductAttention"),
    ("linear column", "decoder.layers.0.mlp.linear_fc1.weight", "TELinear"),
    ("linear row", "decoder.layers.0.mlp.linear_fc2.weight", "TELinear"),
    ("linear duplicated", "decoder.layers.0.mlp.router.weight", "TELinear"),
    ("column linear", "output_layer.weight", "TEColumnParallelLinear"),
]
EXPECTED = ["column", "replicated", "replicated", "column", "row", "column", "row", "replicated", "column"]
EXPECTED += ["column", "row", "replicated", "column"]


@pytest.mark.parametrize("version", RELEASES)
def test_with_the_patch_each_mindspeed_class_gets_its_te_classs_rule(
    bridge_mapping: Any, engines: list, version: str
) -> None:
    module = bridge_mapping(version)
    engine = _enabled(engines)
    known = "none" if version in NORM_FALLBACK else f"1 ({family.FUSED})"  # by the substring rule
    assert record(engine, PATCH.name) == (
        "applied",
        f"fix installed; AutoMapping knows {known} of MindSpeed's 9 TE classes",
    )
    found = _modules()
    detected = [_detect(module, param, found[key]) for key, param, _ in CASES]
    assert detected == EXPECTED
    # exactly what the release decides for the TE class with the same attributes
    assert detected == [_detect(module, param, _te_named(te, found[key])) for key, param, te in CASES]
    plain = torch.nn.Linear(2, 2)  # any other class: the release's own answer, unchanged
    with pytest.raises(ValueError, match="Cannot determine parallelism type for module 'Linear'"):
        _detect(module, "decoder.extra.weight", plain)


# ----------------------------------------------------------------------------- the exported weights
class TpGroup:
    """Rank 0 of a tensor-parallel group of two; the other rank's shards are held here."""

    def __init__(self, other: dict[tuple[int, ...], torch.Tensor]) -> None:
        self.other = other

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Megatron's parallel state says TP = 2 on rank 0; ``all_gather`` returns [this shard, the other
    rank's shard of that shape]."""

    def install(other: dict[tuple[int, ...], torch.Tensor]) -> None:
        from megatron.core import parallel_state

        group = TpGroup(other)
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(parallel_state, "is_initialized", lambda: True)
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_group", lambda *a, **k: group)
        for name in ("pipeline_model_parallel", "expert_model_parallel", "expert_tensor_parallel"):
            monkeypatch.setattr(parallel_state, f"get_{name}_group", lambda *a, **k: None)

        def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group: TpGroup, **_: Any) -> None:
            outputs[0].copy_(tensor)
            outputs[1].copy_(group.other[tuple(tensor.shape)])

        monkeypatch.setattr(torch.distributed, "all_gather", all_gather)

    return install


def _export(module: types.ModuleType, layer: torch.nn.Module) -> dict[str, torch.Size]:
    """What rank 0 exports to Hugging Face for the fused layer's weight and norm weight."""
    exported = {}
    for param in ("weight", "layer_norm_weight"):
        mapping = module.AutoMapping(f"decoder.layers.0.self_attention.linear_qkv.{param}", f"hf.{param}")
        (tensor,) = mapping.megatron_to_hf(getattr(layer, param).detach(), layer).values()
        exported[param] = tensor
    return exported


def test_the_fused_layers_export_without_the_patch_the_hand_fix_and_the_patch(
    bridge_mapping: Any, two_ranks: Any, engines: list
) -> None:
    module = bridge_mapping("0.3.1")
    full = torch.arange(16.0).reshape(4, 4)  # the whole qkv weight: rank 0 holds rows 0-1, rank 1 rows 2-3
    layer = MindSpeedTELayerNormColumnParallelLinear(full[:2].clone(), torch.ones(4))
    two_ranks({(2, 4): full[2:], (4,): torch.ones(4)})  # rank 1's weight shard and its copy of the norm
    # without the patch: replicated, rank 0's half passes for the whole weight
    assert torch.equal(_export(module, layer)["weight"], full[:2])
    # the hand fix (the whole class registered as column) gathers the norm weight too: 8 values, not 4
    module.AutoMapping.register_module_type(family.FUSED, "column")
    hand = _export(module, layer)
    assert torch.equal(hand["weight"], full) and hand["layer_norm_weight"].shape == (8,)
    module.AutoMapping._MODULE_TYPE_REGISTRY["column"].discard(family.FUSED)

    engine = _enabled(engines)
    exported = _export(module, layer)
    assert torch.equal(exported["weight"], full)  # gathered: the whole weight
    assert torch.equal(exported["layer_norm_weight"], torch.ones(4))  # the norm's, whole, once
    engine.revert()
    assert torch.equal(_export(module, layer)["weight"], full[:2])  # the release's own behaviour again


def test_revert_restores_the_releases_method(bridge_mapping: Any, engines: list) -> None:
    module = bridge_mapping("0.6.2")
    original = module.AutoMapping.__dict__[family.METHOD]
    engine = _enabled(engines)
    assert module.AutoMapping.__dict__[family.METHOD] is not original
    engine.revert()
    assert module.AutoMapping.__dict__[family.METHOD] is original
    with pytest.raises(ValueError, match="MindSpeedTELayernorm"):
        _detect(module, "decoder.final_layernorm.weight", MindSpeedTELayernorm())
