"""``megatron.layer_offset`` on the real megatron-core: each release's wheel is put on ``sys.path``
and its ``transformer_layer`` and the modules copying ``get_transformer_layer_offset`` are imported
as they are, on CPU. The pipeline stage is set through the release's own ``parallel_state``
setters (no process group needed)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.support import release_loaders
from tests.support.upstream import load_imports
from tests.verl.helpers import forget_megatron, import_megatron, record, start, verl_files
from verl_npu_autopatch.authoring.patching import marked_by
from verl_npu_autopatch.engine.lifecycle import Engine
from verl_npu_autopatch.patches import megatron_layer_offset as family

(PATCH,) = family.PATCHES
#: Releases importable on this CPU env (0.19.2's MoE package needs triton).
VERSIONS = ("0.12.1", "0.16.1", "0.17.0")
#: The copying_modules imported in every release read here.
COPIERS = ("megatron.core.transformer.transformer_block", "megatron.core.models.gpt.gpt_layer_specs")


@release_loaders.loads(
    family,
    "megatron-core",
    VERSIONS,
    sites={"0.17.0": {f"{module}:{family.FUNCTION}" for module in (family.MODULE, *COPIERS)}},
)
@pytest.fixture
def megatron_layers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Import a release's ``transformer_layer`` and :data:`COPIERS` from its wheel's files (before
    any fix: the copies hold Megatron's function); forgets them after the test."""

    def load(version: str) -> dict[str, ModuleType]:
        names = (family.MODULE, *COPIERS)
        return dict(zip(names, import_megatron(monkeypatch, version, *names), strict=True))

    yield load
    forget_megatron()


def _config(layers: int, stages: int, num_layer_list: Any = None, **extra: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=8,
        num_attention_heads=1,
        pipeline_model_parallel_size=stages,
        pipeline_dtype=torch.float32,
        **extra,
    )
    config.num_layer_list = num_layer_list  # as MindSpeed-LLM's config_from_args puts it there
    return config


def _offsets(function: Any, config: Any) -> list[int]:
    """The offset ``function`` answers on each stage of ``config``'s pipeline."""
    from megatron.core import parallel_state

    parallel_state.set_pipeline_model_parallel_world_size(config.pipeline_model_parallel_size)
    found = []
    for rank in range(config.pipeline_model_parallel_size):
        parallel_state.set_pipeline_model_parallel_rank(rank)
        found.append(function(config))
    parallel_state.set_pipeline_model_parallel_rank(None)
    parallel_state.set_pipeline_model_parallel_world_size(None)
    return found


def _layer_ids(offsets: list[int], sizes: list[int]) -> list[int]:
    """The 1-based global layer numbers the stages build (``layer_number + offset``)."""
    return [offset + number for offset, size in zip(offsets, sizes, strict=True) for number in range(1, size + 1)]


@pytest.mark.parametrize("version", VERSIONS)
def test_uneven_stages_get_duplicate_ids_and_the_fix_numbers_them_in_order(
    megatron_layers: Any, engines: list[Engine], version: str
) -> None:
    modules = megatron_layers(version)
    upstream = modules[family.MODULE].get_transformer_layer_offset
    assert all(m.get_transformer_layer_offset is upstream for m in modules.values())
    sizes = [3, 2, 2]
    uneven = _config(7, 3, "3,2,2")
    before = _offsets(upstream, uneven)
    assert before == [0, 2, 4] and _layer_ids(before, sizes) == [1, 2, 3, 3, 4, 5, 6]  # layer 3 twice, 7 never
    others = (_config(6, 3, [2, 2, 2]), _config(7, 3), _config(8, 3, "3,2,2"))  # even, unset, not summing up
    megatron_answers = [_offsets(upstream, config) for config in others]

    engine = start(engines, [PATCH])
    assert record(engine, PATCH.name) == ("applied", "fix installed")
    fixed = modules[family.MODULE].get_transformer_layer_offset
    assert marked_by(fixed) == PATCH.name
    assert all(m.get_transformer_layer_offset is fixed for m in modules.values())  # the copies rebound
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs as late  # copies after the fix
    assert late.get_transformer_layer_offset is fixed
    block = modules["megatron.core.transformer.transformer_block"].get_transformer_layer_offset
    assert _offsets(block, uneven) == [0, 3, 5] and _layer_ids([0, 3, 5], sizes) == list(range(1, 8))
    assert _offsets(block, _config(7, 3, "'3;2;2'")) == [0, 3, 5]  # MindSpeed's quoted, ';'-separated form
    assert [_offsets(block, config) for config in others] == megatron_answers  # Megatron's answer stands
    if version != "0.12.1":  # pp_rank / vp_stage parameters since 0.15.3 / 0.13.1
        assert [block(uneven, pp_rank=rank) for rank in range(3)] == [0, 3, 5]
        # a virtual stage goes to Megatron's own function
        assert block(uneven, vp_stage=1, pp_rank=1) == upstream(uneven, vp_stage=1, pp_rank=1)

    assert engine.revert() == [PATCH.name]
    assert all(m.get_transformer_layer_offset is upstream for m in [*modules.values(), late])


#: A stand-in shaped like MindSpeed-LLM's DeepSeek-V4 attention module (``deepseek4/csa.py``): it
#: takes the function with ``from ... import`` at top level and numbers its layer by it.
CSA = f"""
from {family.MODULE} import {family.FUNCTION}


class DeepSeek4SelfAttention:
    def __init__(self, config, layer_number):
        self.config = config
        self.layer_number = layer_number + {family.FUNCTION}(self.config)
"""


def _copier_from_source(monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> ModuleType:
    """Module ``name`` executed from ``source`` and put in ``sys.modules`` (removed after the test)."""
    module = ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.mark.parametrize("version", ["0.12.1", "0.17.0"])
def test_copies_outside_megatron_taken_before_the_fix_are_rebound(
    megatron_layers: Any, engines: list[Engine], monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    modules = megatron_layers(version)
    upstream = modules[family.MODULE].get_transformer_layer_offset
    csa = _copier_from_source(monkeypatch, family.OUTSIDE_COPIERS[0], CSA)
    replay_file = verl_files("0.9.1") / "verl/utils/megatron/router_replay_utils.py"
    replay = load_imports(replay_file, family.OUTSIDE_COPIERS[1], (family.MODULE,))  # verl's own import line
    monkeypatch.setitem(sys.modules, replay.__name__, replay)
    assert csa.get_transformer_layer_offset is upstream and replay.get_transformer_layer_offset is upstream
    uneven = _config(7, 3, "3,2,2")

    def first_layers() -> list[int]:
        """The global number of each stage's first attention layer, as the DeepSeek-V4 module computes it."""
        from megatron.core import parallel_state

        parallel_state.set_pipeline_model_parallel_world_size(3)
        found = []
        for rank in range(3):
            parallel_state.set_pipeline_model_parallel_rank(rank)
            found.append(csa.DeepSeek4SelfAttention(uneven, 1).layer_number)
        parallel_state.set_pipeline_model_parallel_rank(None)
        parallel_state.set_pipeline_model_parallel_world_size(None)
        return found

    assert first_layers() == [1, 3, 5]  # stage 1 starts at layer 3, the last layer of stage 0

    engine = start(engines, [PATCH])
    assert record(engine, PATCH.name) == ("applied", "fix installed")
    fixed = modules[family.MODULE].get_transformer_layer_offset
    assert csa.get_transformer_layer_offset is fixed and replay.get_transformer_layer_offset is fixed
    assert first_layers() == [1, 4, 6]
    assert _offsets(replay.get_transformer_layer_offset, uneven) == [0, 3, 5]  # verl's router replay too

    assert engine.revert() == [PATCH.name]
    assert csa.get_transformer_layer_offset is upstream and replay.get_transformer_layer_offset is upstream


def test_every_known_outside_copier_is_swept() -> None:
    from verl_npu_autopatch.engine.ownership import within

    assert all(within(name, PATCH.reach.copies_in) for name in family.OUTSIDE_COPIERS)
    assert not within("verl.workers.engine_workers", PATCH.reach.copies_in)  # verl's other modules cost nothing
