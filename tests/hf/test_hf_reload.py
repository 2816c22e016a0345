"""``importlib.reload`` of a patched transformers modeling module, with the process-wide engine
(start-up hook, fresh child interpreter): the re-executed classes get the fix again, and the
records say so."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.children import ROOT

CODE = """
import importlib, json, sys
from tests.hf import npu_emulation
sys.modules["torch_npu"] = npu_emulation
import verl_npu_autopatch
from verl_npu_autopatch.authoring.patching import marked_by
from transformers.models.qwen3 import modeling_qwen3 as m
before = verl_npu_autopatch.report()["transformers.qwen3.rms_norm"].state
old = m.Qwen3RMSNorm
importlib.reload(m)
records = {{n: [r.state, r.reason] for n, r in ((r.name, r) for r in verl_npu_autopatch.report().records)
           if n.startswith("transformers.qwen3.")}}
print(json.dumps({{"before": before, "records": records, "new_class": m.Qwen3RMSNorm is not old,
                  "markers": [marked_by(m.Qwen3RMSNorm.forward), marked_by(m.Qwen3MLP.forward),
                              marked_by(m.apply_rotary_pos_emb)],
                  "loader": type(m.__loader__).__name__}}))
"""


def test_reload_of_a_modeling_module_applies_the_fixes_again() -> None:
    env = {"VERL_NPU_AUTOPATCH_DEVICE": "npu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CODE.format()], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] == "applied" and out["new_class"] is True
    assert out["records"] == {
        f"transformers.qwen3.{kind}": ["applied", "fix installed; again after importlib.reload"]
        for kind in ("rms_norm", "mlp", "rotary")
    }
    assert out["markers"] == ["transformers.qwen3.rms_norm", "transformers.qwen3.mlp", "transformers.qwen3.rotary"]
    assert out["loader"] == "SourceFileLoader"  # the module keeps its own loader
