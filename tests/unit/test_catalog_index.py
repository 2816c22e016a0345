"""The lazy catalog: ``patches/_index.py`` is what the families declare, and an activation imports
no family until one of its targets is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from verl_npu_autopatch.engine import catalog

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_SITE = ROOT / "tests" / "fixtures" / "site"


def test_the_committed_index_is_the_rendered_one() -> None:
    index = ROOT / "src" / "verl_npu_autopatch" / "patches" / "_index.py"
    assert index.read_text(encoding="utf-8") == catalog.render_index(), (
        "patches/_index.py is stale: run `PYTHONPATH=src python3 -m verl_npu_autopatch.engine.catalog"
        " > src/verl_npu_autopatch/patches/_index.py`"
    )


def test_each_declared_patch_loads_as_the_family_declares_it() -> None:
    declared, built_in = catalog.declared(), catalog.builtin()
    assert [d.name for d in declared] == [p.name for p in built_in]
    for entry, patch in zip(declared, built_in, strict=True):
        assert entry.load() is patch
        seen = (entry.groups, entry.default, entry.device, entry.requires, entry.hooks)
        assert seen == (patch.groups, patch.default, patch.device, patch.requires, patch.hooks)


def test_activation_imports_a_family_only_when_its_target_is_imported(tmp_path: Path) -> None:
    # a stand-in ``tensordict.base`` (not tensordict's code: the family's check will not take it)
    (tmp_path / "tensordict").mkdir()
    (tmp_path / "tensordict" / "__init__.py").write_text("")
    (tmp_path / "tensordict" / "base.py").write_text("class TensorDictBase:\n    def _sync_all(self): pass\n")
    code = """
import json, sys
import verl_npu_autopatch
verl_npu_autopatch.activate()
def families():
    return sorted(m for m in sys.modules if m.startswith("verl_npu_autopatch.patches.") and "._" not in m)
seen = [families()]
import vllm.model
seen.append(families())
import tensordict.base
seen.append(families())
states = verl_npu_autopatch.report().states()
print(json.dumps([seen, states["fixture.forward"], states["tensordict.npu_sync"]]))
"""
    path = f"{ROOT / 'src'}:{FIXTURE_SITE}:{tmp_path}"
    env = {"PYTHONPATH": path, "VERL_NPU_AUTOPATCH_DEVICE": "npu", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    seen, plugin_state, family_state = json.loads(out)
    assert seen[0] == seen[1] == []  # activation, then a plugin's target: no built-in family (all 30 before)
    assert plugin_state == "applied"  # the fixture plugin's patches are loaded as before
    assert seen[2] == ["verl_npu_autopatch.patches.tensordict_npu_sync"]  # imported with its target
    assert family_state not in ("pending", "failed")  # decided by the family's own check
