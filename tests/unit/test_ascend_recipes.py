"""``docs/ascend-recipes.md`` classifies every recipe patch (33 files, two script changes) and cites
only patches that exist in the catalog."""

from __future__ import annotations

import re
from pathlib import Path

from verl_npu_autopatch.engine import catalog

DOC = Path(__file__).resolve().parents[2] / "docs" / "ascend-recipes.md"
PREFIXES = ("vllm.", "ascend.", "transformers.", "liger.", "tensordict.", "torch_npu.", "megatron.", "verl.")


def _rows() -> list[list[str]]:
    rows = [line for line in DOC.read_text(encoding="utf-8").splitlines() if re.match(r"\| (\d+|s\d) \|", line)]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def test_every_recipe_patch_has_a_row_and_a_decision() -> None:
    rows = _rows()
    assert [row[0] for row in rows] == [str(n) for n in range(1, 34)] + ["s1", "s2"]
    known = {patch.name for patch in catalog.builtin()}
    cited: set[str] = set()
    for number, _file, _target, _kind, ours in rows:
        names = {n for n in re.findall(r"`([a-z0-9_.]+)`", ours) if n.startswith(PREFIXES)}
        assert names or "out of scope" in ours, f"row {number}: no patch and no reason"
        assert "planned" not in ours, f"row {number}: a fix still planned (build it or say why it is out of scope)"
        cited |= names
    assert cited - known == set(), f"docs/ascend-recipes.md cites patches that do not exist: {sorted(cited - known)}"
    assert {"ascend.sampler_record_stream", "ascend.gate_fp32_in_place", "vllm.routed_experts_padding_slots"} <= cited
    unsafe = [row[0] for row in rows if "unsafe" in row[4]]
    assert unsafe == ["14", "15", "22"]
