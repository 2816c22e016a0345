"""``verl.3d_position_ids`` on verl's released ``tensordict_utils.py`` (0.8.0, 0.9.0, 0.9.1: the
wheels of the decision table, run as ``verl.utils.tensordict_utils`` on the real torch and
tensordict 0.9.1), and its copies in the releases' engine modules, made by their own
``from verl.utils.tensordict_utils import ...`` lines."""

from __future__ import annotations

import ast
import pickle
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.support import release_loaders, upstream
from tests.verl.helpers import record, release_root, start
from verl_npu_autopatch.authoring.patching import marked_by
from verl_npu_autopatch.engine.lifecycle import Engine
from verl_npu_autopatch.patches import verl_3d_position_ids as family

VERSIONS = ("0.8.0", "0.9.0", "0.9.1")
(PATCH,) = family.PATCHES


def _copier(path: Path, name: str) -> types.ModuleType:
    """Module ``name`` holding what the release's file at ``path`` imports from
    ``verl.utils.tensordict_utils``: its own import statements, run with its file name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == family.MODULE]
    module = types.ModuleType(name)
    module.__file__ = str(path)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), module.__dict__)
    return module


@release_loaders.loads(
    family,
    "verl",
    VERSIONS,
    sites={"0.9.1": {f"{module}:{family.FUNCTION}" for module in (family.MODULE, *family.COPIERS)}},
)
@pytest.fixture
def verl(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], dict[str, types.ModuleType]]:
    """Install a release's ``tensordict_utils`` under its real name (bare ``verl`` packages above
    it), then the engine modules that copy from it; returns ``{module name: module}``."""

    def install(version: str) -> dict[str, types.ModuleType]:
        root = release_root("verl", version)
        for package in ("verl", "verl.utils", "verl.workers", "verl.workers.engine"):
            monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
        utils = upstream.load_file(root / "verl" / "utils" / "tensordict_utils.py", family.MODULE)
        monkeypatch.setitem(sys.modules, family.MODULE, utils)
        found = {family.MODULE: utils}
        for name in family.COPIERS:
            path = root / f"{name.replace('.', '/')}.py"
            if path.exists():
                found[name] = _copier(path, name)
                monkeypatch.setitem(sys.modules, name, found[name])
        return found

    return install


#: Per sample ``[channels, tokens]``: equal lengths, then unequal ones.
SAMPLES = [torch.arange(20).reshape(4, 5), torch.arange(100, 120).reshape(4, 5)]
RAGGED = [torch.arange(20).reshape(4, 5), torch.arange(100, 128).reshape(4, 7)]


def _batch(ids: torch.Tensor) -> TensorDict:
    return TensorDict({"position_ids": ids}, batch_size=[ids.size(0)])


def _unbound(data: TensorDict) -> list[list[Any]]:
    return [t.tolist() for t in data["position_ids"].unbind()]


def _channel_packed() -> TensorDict:
    """Equal-length samples through ``torch.nested.as_nested_tensor``: the channels are ragged."""
    return _batch(torch.nested.as_nested_tensor(SAMPLES, layout=torch.jagged))


def _pickled(utils: types.ModuleType, samples: list[torch.Tensor]) -> TensorDict:
    """verl's canonical layout after a consolidated TensorDict's pickle round trip."""
    data = _batch(utils.nested_tensor_from_tensor_list(samples, ragged_idx=2))
    return pickle.loads(pickle.dumps(data.consolidate()))


@pytest.mark.parametrize("version", VERSIONS)
def test_the_release_breaks_equal_length_batches_and_the_fix_repairs_them(
    verl: Callable[[str], dict[str, types.ModuleType]], engines: list[Engine], version: str
) -> None:
    modules = verl(version)
    utils = modules[family.MODULE]
    upstream_fix = utils.maybe_fix_3d_position_ids
    broken = _channel_packed()
    upstream_fix(broken)
    with pytest.raises(RuntimeError):  # the relabelled offsets count channels, not tokens
        broken["position_ids"].unbind()

    engine = start(engines, [PATCH])
    assert record(engine, PATCH.name) == ("applied", "fix installed")
    copies = {name: m for name, m in modules.items() if name != family.MODULE}
    assert set(copies) == ({*family.COPIERS} if version != "0.8.0" else set(family.COPIERS[:2]))
    for module in copies.values():  # the engine modules imported before the fix call the fix
        assert module.maybe_fix_3d_position_ids is utils.maybe_fix_3d_position_ids
        assert marked_by(module.maybe_fix_3d_position_ids) == PATCH.name
    call = copies["verl.workers.engine.base"].maybe_fix_3d_position_ids

    data = _channel_packed()
    call(data)
    assert data["position_ids"]._ragged_idx == 2 and _unbound(data) == [s.tolist() for s in SAMPLES]
    for samples in (SAMPLES, RAGGED):  # what the release already handled stays as it was
        data = _pickled(utils, samples)
        assert data["position_ids"]._ragged_idx == 1
        call(data)
        assert _unbound(data) == [s.tolist() for s in samples]
    canonical = _batch(utils.nested_tensor_from_tensor_list(RAGGED, ragged_idx=2))
    ids = canonical["position_ids"]
    call(canonical)
    assert canonical["position_ids"] is ids
    flat = _batch(torch.arange(6).reshape(2, 3))
    call(flat)
    assert flat["position_ids"].tolist() == [[0, 1, 2], [3, 4, 5]]

    assert engine.revert() == [PATCH.name]
    assert all(m.maybe_fix_3d_position_ids is upstream_fix for m in modules.values())


def test_an_engine_module_imported_after_the_fix_reads_it(
    verl: Callable[[str], dict[str, types.ModuleType]], engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    modules = verl("0.9.1")
    monkeypatch.delitem(sys.modules, "verl.workers.engine_workers")
    upstream_fix = modules[family.MODULE].maybe_fix_3d_position_ids
    engine = start(engines, [PATCH])
    path = release_root("verl", "0.9.1") / "verl" / "workers" / "engine_workers.py"
    late = _copier(path, "verl.workers.engine_workers")
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert marked_by(late.maybe_fix_3d_position_ids) == PATCH.name
    assert engine.revert() == [PATCH.name] and late.maybe_fix_3d_position_ids is upstream_fix


@pytest.mark.parametrize("version", VERSIONS)
def test_the_live_check_agrees_with_the_decision_table(
    verl: Callable[[str], dict[str, types.ModuleType]], version: str
) -> None:
    from verl_npu_autopatch.authoring.fingerprints import UpstreamTree

    utils = verl(version)[family.MODULE]
    tree = UpstreamTree((release_root("verl", version),), {"verl": version})
    assert PATCH.static is not None
    assert PATCH.check is not None
    live = PATCH.check(contract_site(utils))
    assert (live.action, PATCH.static.decide(tree).action) == ("apply", "apply")


def contract_site(utils: types.ModuleType) -> Any:
    from verl_npu_autopatch.authoring.spec import Site

    return Site(PATCH, PATCH.targets[0], utils, utils, family.FUNCTION, utils.maybe_fix_3d_position_ids)
