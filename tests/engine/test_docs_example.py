"""The worked example in docs/writing-a-patch.md runs as written, against the real transformers."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.children import ROOT, run_json


def example_code() -> str:
    text = (ROOT / "docs" / "writing-a-patch.md").read_text()
    (block,) = re.findall(r"```python\n(\"\"\"my_package/npu_fixes.py.*?)```", text, re.S)
    return block


def test_docs_example_patch_applies_to_real_transformers(hf_python: Path, tmp_path: Path) -> None:
    (tmp_path / "npu_fixes.py").write_text(example_code())
    code = """
import json, torch
import npu_fixes
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.lifecycle import Engine
engine = Engine(npu_fixes.PATCHES, Config(device="npu"))
engine.activate("docs")
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
norm = Qwen2RMSNorm(8)
out = norm(torch.ones(2, 8))
record = engine.report()["example.qwen2_rms_norm_counter"]
state = [record.state, npu_fixes.CALLS[0], bool(torch.allclose(out, torch.ones(2, 8)))]
engine.revert()
norm(torch.ones(2, 8))
print(json.dumps(state + [npu_fixes.CALLS[0], engine.report()["example.qwen2_rms_norm_counter"].state]))
"""
    seen = run_json(hf_python, code, env={"PYTHONPATH": str(tmp_path)}, fixtures=False)
    assert seen == ["applied", 1, True, 1, "reverted"]
