"""transformers' own ``ModelTesterMixin`` on the MoE families, with our patches active.

``tests/test_modeling_common.py`` comes from the sdist of the installed transformers release
(sha256-checked against the index by ``scripts/compat-matrix``'s downloader, cached under
``.cache/upstream/``). The sdist lacks the two modules it imports beside ``ModelTesterMixin``
(``tests/exporters/test_export.py``, ``tests/generation/test_utils.py``): they get empty stand-in
mixins, so their tests are simply not collected. The tester classes are ours
(``upstream/moe_testers.py``). A child pytest runs the selected upstream tests for real.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import transformers

from tests.hf.conftest import PRESENT
from tests.support.matrix import matrix_script

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
UPSTREAM = HERE / "upstream"
MOE = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_vl_moe")

#: Upstream tests selected: equivalence of outputs across implementations, batching, reloads, training.
SELECTED = (
    "test_eager_matches_batched_and_grouped_inference",
    "test_batching_equivalence",
    "test_determinism",
    "test_save_load",
    "test_model_outputs_equivalence",
    "test_training",
)
EXPERTS_CHOICE = "test_eager_matches_batched_and_grouped_inference"
STAND_INS = {
    "exporters/test_export.py": "class ExportTesterMixin:\n    pass\n",
    "generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
}


def _test_modeling_common(version: str) -> str:
    matrix = matrix_script()
    sdist = matrix.download(matrix.Artifact("transformers", version, f"transformers-{version}.tar.gz"))
    with tarfile.open(sdist) as archive:
        member = archive.extractfile(f"transformers-{version}/tests/test_modeling_common.py")
        assert member is not None
        return member.read().decode()


@pytest.fixture(scope="module")
def upstream_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    version = transformers.__version__
    try:
        common = _test_modeling_common(version)
    except OSError as error:  # no index reachable: the one dependency that cannot be had offline
        pytest.skip(f"transformers {version} sdist not downloadable: {error}")
    root = tmp_path_factory.mktemp("upstream")
    package = root / "upstream_tests"
    for sub in ("", "exporters", "generation"):
        (package / sub).mkdir(parents=True, exist_ok=True)
        (package / sub / "__init__.py").write_text("")
    (package / "test_modeling_common.py").write_text(common)
    for name, text in STAND_INS.items():
        (package / name).write_text(text)
    shutil.copy(UPSTREAM / "moe_testers.py", package / "test_moe_testers.py")
    shutil.copy(UPSTREAM / "conftest_child.py", root / "conftest.py")
    summary = root / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOPATCH_SUMMARY": str(summary)}
    env.pop("VERL_NPU_AUTOPATCH_DEVICE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "--rootdir", str(root),
         "-k", f"({' or '.join(SELECTED)}) and not gradient_checkpointing", str(package / "test_moe_testers.py")],
        cwd=root, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    return {
        "proc": proc,
        "summary": json.loads(summary.read_text()) if summary.exists() else None,
        "choice_test": f"def {EXPERTS_CHOICE}(" in common,
    }


def _outcomes(output: str) -> dict[str, str]:
    """``{test id: PASSED|FAILED|SKIPPED|ERROR}`` from ``pytest -rA``."""
    found = {}
    for line in output.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "SKIPPED", "ERROR") and "::" in rest:
            found[rest.split(" ")[0]] = word
    return found


def test_upstream_mixin_passes_with_our_patches(upstream_run: dict) -> None:
    proc = upstream_run["proc"]
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    outcomes = _outcomes(proc.stdout)
    present = [f for f in MOE if f in PRESENT]
    classes = {f: f"{moe_class(f).__name__}UpstreamMixinTest" for f in present}
    for family, case in classes.items():
        ran = {test.split("::")[-1] for test, outcome in outcomes.items() if f"::{case}::" in test}
        assert {t for t in ran if outcomes[f"upstream_tests/test_moe_testers.py::{case}::{t}"] != "PASSED"} == set()
        assert {"test_batching_equivalence", "test_determinism", "test_training"} <= ran, (family, sorted(ran))
        if upstream_run["choice_test"]:  # transformers 5.x: the user's experts choice (eager, ...) is respected
            assert {t for t in ran if t.startswith(EXPERTS_CHOICE)}, (family, sorted(ran))
    summary = upstream_run["summary"]
    for family in present:
        state, reason, _target = summary["records"][f"transformers.{family}.experts"]
        assert state == "applied", (family, reason)
    # Our kernel ran where no choice was made (training: the weight-gradient grouped matmul).
    assert summary["calls"].get("npu_grouped_matmul[group_type=2]", 0) > 0, summary["calls"]
    assert summary["calls"].get("npu_moe_token_permute", 0) > 0, summary["calls"]


def moe_class(family: str) -> type:
    import importlib

    tester = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
              "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_vl_moe": "Qwen3VLMoeTextModel"}  # fmt: skip
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), tester[family])
