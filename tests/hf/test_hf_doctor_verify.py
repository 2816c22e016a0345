"""``verl-npu-autopatch doctor --verify``, run as users run it (the console script of this
environment), with the real transformers Qwen families and a ``torch_npu`` made of the test
double: a shim directory first on the doctor child's PYTHONPATH holds ``torch_npu.py``, which is
``npu_emulation`` itself, or ``npu_emulation`` with one op deliberately wrong or broken."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf.conftest import PRESENT
from tests.support.children import ROOT
from verl_npu_autopatch.cli.verify import TOLERANCE, not_numeric
from verl_npu_autopatch.patches import transformers_npu

HERE = Path(__file__).resolve().parent
SCRIPT = Path(sys.executable).parent / "verl-npu-autopatch"

#: ``torch_npu`` is the test double itself.
EMULATION = (
    "import sys\n\nfrom tests.hf import npu_emulation\n\n"
    "npu_emulation.integer_histc()\nsys.modules[__name__] = npu_emulation\n"
)
#: npu_rms_norm off by a scale of 1.1: every RMSNorm kernel is wrong, the rest right.
WRONG_RMS_NORM = """from tests.hf.npu_emulation import *  # noqa: F403
from tests.hf import npu_emulation

npu_emulation.integer_histc()


def npu_rms_norm(x, gamma, epsilon=1e-6):
    y, rstd = npu_emulation.npu_rms_norm(x, gamma, epsilon)
    return y * 1.1, rstd
"""
#: npu_swiglu raises: the SwiGLU MLPs and the MoE experts cannot run.
BROKEN_SWIGLU = """from tests.hf.npu_emulation import *  # noqa: F403
from tests.hf import npu_emulation

npu_emulation.integer_histc()


def npu_swiglu(x, dim=-1):
    raise RuntimeError("the shim's swiglu kernel refuses")
"""
#: Two families keep the runs with a deliberately bad kernel short: plain and (1+w) RMSNorm,
#: gated RMSNorm, MLP, rotary, MoE experts between them.
FEW = ("qwen3", "qwen3_next")


def doctor(
    tmp_path: Path, shim: str | None, *args: str, families: tuple[str, ...] | None = None
) -> subprocess.CompletedProcess:
    """``doctor --verify --device npu [args]`` with ``shim`` as ``torch_npu`` (``None``: no
    torch_npu at all); only ``families`` of the transformers kernels (default: all)."""
    shim_dir = tmp_path / "shim"
    shim_dir.mkdir(exist_ok=True)
    if shim is not None:
        (shim_dir / "torch_npu.py").write_text(shim)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_NPU_AUTOPATCH")}
    env["PYTHONPATH"] = os.pathsep.join([str(shim_dir), str(ROOT)])
    if families is not None:
        off = [f"transformers.{f}" for f in transformers_npu.MODELS if f not in families]
        env["VERL_NPU_AUTOPATCH_DISABLE"] = ",".join(off)
    command = [str(SCRIPT), "doctor", "--verify", "--device", "npu", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)


def applied_kernels(data: dict) -> set[str]:
    """The applied transformers kernel patches (not the other transformers fixes, e.g. deepstack)."""
    return {
        r["name"]
        for r in data["records"]
        if r["state"] == "applied"
        and r["name"].startswith("transformers.")
        and r["name"].rsplit(".", 1)[-1] in transformers_npu.KERNELS
    }


def rows(data: dict) -> dict[tuple[str, str | None], dict]:
    """The verify rows by (patch, dtype)."""
    return {(r["name"], r["dtype"]): r for r in data["verify"]["results"]}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``doctor --verify --json`` with the test double as torch_npu, every family (run once)."""
    proc = doctor(tmp_path_factory.mktemp("emulated"), EMULATION, "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_verify_json_covers_every_applied_kernel_in_both_dtypes(emulated: dict) -> None:
    data = emulated
    verify = data["verify"]
    assert verify["ok"] is True and verify["error"] is None
    assert verify["device"] == "cpu" and verify["torch_npu"] == str(HERE / "npu_emulation.py")
    kernels = applied_kernels(data)
    # every present family's kernels went in, or stood aside for another of ours on a class two
    # families share (transformers 4.57: qwen2_5_vl uses Qwen2RMSNorm); each applied one was verified
    expected = {transformers_npu.patch_name(f, k) for f in PRESENT for k in transformers_npu.kinds(f)}
    states = {r["name"]: r for r in data["records"]}
    shared = {n for n in expected if states[n]["state"] == "yielded" and "(shared class" in states[n]["reason"]}
    assert kernels == expected - shared and len(shared) <= 1
    found = rows(data)
    assert set(found) == {(name, dtype) for name in kernels for dtype in ("float32", "bfloat16")}
    for row in found.values():
        assert row["passed"] and row["error"] is None, row
        for key in ("fwd_max_abs", "fwd_max_rel", "bwd_max_abs", "bwd_max_rel", "time_ratio"):
            assert math.isfinite(row[key]) and row[key] >= 0, (key, row)
        assert row["fwd_max_rel"] <= row["tolerance"] and row["bwd_max_rel"] <= row["tolerance"]
    assert verify["tolerance"] == {"float32": 1e-4, "bfloat16": 2e-2}
    # the rotary input is what the family feeds: a partial rotary where upstream takes one
    partial = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}
    for family in [f for f in PRESENT if "rotary" in transformers_npu.kinds(f)]:
        rotated = 8 if family in partial else 16
        row = found[f"transformers.{family}.rotary", "float32"]
        assert row["inputs"] == f"q [2, 4, 8, 16], k 2 heads, rotary dim {rotated}", row
    # applied but not arithmetic: listed with the reason, never counted as verified
    not_checked = {entry["name"]: entry["reason"] for entry in verify["not_checked"]}
    assert not_checked["liger.arbitration"] == not_numeric("liger.arbitration")
    others = {r["name"] for r in data["records"] if r["state"] == "applied"} - kernels
    assert others <= set(not_checked), others - set(not_checked)


def test_verify_table_fits_120_columns(tmp_path: Path, emulated: dict) -> None:
    proc = doctor(tmp_path, EMULATION)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 120, [line for line in lines if len(line) > 120]
    header = next(i for i, line in enumerate(lines) if line.startswith("kernel "))
    columns = ["kernel", "dtype", "result", "fwd abs", "fwd rel", "bwd abs", "bwd rel", "time patched/upstream"]
    assert re.split(r"\s{2,}", lines[header]) == columns
    table = {tuple(line.split()[:3]) for line in lines[header + 2 :] if line.startswith("qwen")}
    kernels = applied_kernels(emulated)
    assert len(kernels) > 20  # every present family (the JSON test checks which)
    assert table == {(name.removeprefix("transformers."), d, "ok") for name in kernels for d in ("fp32", "bf16")}


def test_verify_reports_a_wrong_kernel_and_exits_non_zero(tmp_path: Path) -> None:
    data = json.loads(doctor(tmp_path, WRONG_RMS_NORM, "--json", families=FEW).stdout)
    assert data["verify"]["ok"] is False
    for (name, _), row in rows(data).items():
        kind = name.rsplit(".", 1)[-1]
        if kind in ("rms_norm", "rms_norm_gated"):
            # the scale of 1.1 shows as a 10 % error against upstream, forward and backward
            assert not row["passed"] and row["error"] is None, row
            assert row["fwd_max_rel"] == pytest.approx(0.1, abs=0.02), row
            assert row["bwd_max_rel"] > row["tolerance"], row
        else:
            assert row["passed"], row
    proc = doctor(tmp_path, WRONG_RMS_NORM, families=FEW)
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MISMATCH transformers.qwen3.rms_norm (float32): error above the fp32 tolerance 0.0001" in proc.stdout
    table = [line.split()[:3] for line in proc.stdout.splitlines()]
    assert ["qwen3_next.rms_norm_gated", "bf16", "FAIL"] in table and ["qwen3.mlp", "bf16", "ok"] in table


def test_verify_reports_a_kernel_that_raises_without_crashing(tmp_path: Path) -> None:
    proc = doctor(tmp_path, BROKEN_SWIGLU, "--json", families=FEW)
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["status"] == "active"
    found = rows(data)
    assert {name for name, _ in found} == applied_kernels(data)
    for (name, _), row in found.items():
        if name.rsplit(".", 1)[-1] in ("mlp", "experts"):
            assert not row["passed"] and row["error"] == "RuntimeError: the shim's swiglu kernel refuses", row
            assert (row["fwd_max_abs"], row["time_ratio"], row["tolerance"]) == (None, None, TOLERANCE[row["dtype"]])
        else:
            assert row["passed"], row


def test_verify_without_torch_npu_says_it_could_not_run(tmp_path: Path) -> None:
    """``--device npu`` on a host where ``import torch_npu`` fails: the kernels went in (forced),
    the verification cannot run; that is a failure to verify, not a pass."""
    proc = doctor(tmp_path, None, families=("qwen3",))
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "VERIFY FAILED: cannot choose the device (3 applied kernels not verified): ModuleNotFoundError: No module"
        in (" ".join(proc.stdout.split()))
    )
    assert "no applied kernel patch to verify" not in proc.stdout


def test_the_experts_check_leaves_the_last_expert_without_tokens() -> None:
    """The empty expert's zero weight gradient (assumed by us and verl, promised by no document) is
    compared with upstream's on the device."""
    import torch

    from verl_npu_autopatch.patches.transformers_npu import verify_cases as cases

    index, _ = cases._routing(torch.float32, torch.device("cpu"))
    assert index.shape == (cases.B * cases.S, cases.K)
    assert int(index.max()) == cases.E - 2  # experts 0 .. E-2 get tokens, E-1 none
