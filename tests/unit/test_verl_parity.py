"""``docs/verl.md`` "Parity with verl 0.9.1" cites only patches that exist in the catalog, and
every row either names patches or says why not."""

from __future__ import annotations

import re
from pathlib import Path

from verl_npu_autopatch.engine import catalog

DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
HEADING = "## Parity with verl 0.9.1"
#: verl's runtime patch sites that are verl's own wiring, not fixes of another package's code.
STAYS = 4
#: verl fixes decided against from upstream evidence (row 26: the NPU P2P shape race, verl PR #7862).
NOT_PORTED = 1


def _rows() -> list[list[str]]:
    text = DOC.read_text(encoding="utf-8")
    assert HEADING in text, f"{DOC} has no '{HEADING}' section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def test_every_cited_patch_exists_and_every_site_is_accounted_for() -> None:
    rows = _rows()
    assert [int(row[0]) for row in rows] == list(range(1, len(rows) + 1)) and len(rows) == 30
    known = {patch.name for patch in catalog.builtin()}
    prefixes = tuple(f"{family}." for family in ("vllm", "ascend", "transformers", "liger", "tensordict"))
    prefixes += ("torch_npu.", "megatron.", "verl.")
    cited: set[str] = set()
    for number, _file, _target, _when, ours in rows:
        names = [n for n in re.findall(r"`([a-z0-9_.]+)`", ours) if n.startswith(prefixes) and "." in n]
        stays = ours.startswith(("stays in verl", "not ported: "))
        assert names or stays or ours.startswith("not needed"), f"row {number} names no patch and no reason"
        cited.update(names)
    assert cited - known == set(), f"docs/verl.md cites patches that do not exist: {sorted(cited - known)}"
    assert sum(row[4].startswith("stays in verl") for row in rows) == STAYS
    assert sum(row[4].startswith("not ported: ") for row in rows) == NOT_PORTED
    assert {"tensordict.npu_sync", "torch_npu.nested_tensor_intercept", "megatron.mtp_postprocess"} <= cited
    assert {"transformers.qwen3_vl.deepstack_clone", "transformers.qwen3_vl_moe.deepstack_clone"} <= cited
    assert "ascend.dispatcher_expert_ids_sleep" in cited  # row 28: verl PR #7086
    assert "verl.hccl_broadcast_thread" in cited  # row 29: verl issue #7416, verl's own code
    assert "megatron.bridge_mindspeed_te" in cited  # row 30: verl PR #7218, Megatron-Bridge with MindSpeed
