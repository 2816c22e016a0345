"""``doctor --verify`` for ``ascend.rms_norm_residual``: the fix's explicit add + RMSNorm against the
release's fused add-RMSNorm (``AscendRMSNorm.forward_oot`` of the real 0.23.0 / 0.23.0.post1
``layernorm.py``), forward only, with the torch_npu test doubles; in-process (``verify.run`` on
a private engine's records) and through the console script (the doctor child imports a
``vllm_ascend`` made of the release file and the doubles, from a shim directory)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.ascend import doubles
from tests.support import upstream
from tests.support.children import ROOT
from verl_npu_autopatch.cli import verify
from verl_npu_autopatch.engine import catalog

NAME = "ascend.rms_norm_residual"
PATCH = [p for p in catalog.builtin() if p.name == NAME]
SCRIPT = Path(sys.executable).parent / "verl-npu-autopatch"
DTYPES = ("float32", "bfloat16")


def verified(**env: str) -> dict:
    """``verify.run`` on the records of a private engine over the patch (``env``: its config)."""
    engine = upstream.run_engine(PATCH, **env)
    return verify.run(engine.report().to_dict()["records"])


def rows(report: dict) -> dict[str | None, dict]:
    """The patch's verify rows by dtype."""
    found = {r["dtype"]: r for r in report["results"] if r["name"] == NAME}
    assert len(found) == len([r for r in report["results"] if r["name"] == NAME])
    return found


def test_the_fix_equals_the_fused_op_forward(layernorm: ModuleType) -> None:
    report = verified(VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert (report["ok"], report["error"], report["device"]) == (True, None, "cpu")
    found = rows(report)
    assert set(found) == set(DTYPES)
    for dtype, row in found.items():
        assert row["passed"] and row["error"] is None, row
        assert row["target"] == "vllm_ascend.ops.layernorm:AscendRMSNorm.forward_oot"
        assert row["inputs"] == "x and residual [16, 64], forward only (inference)"
        assert row["backward"] is False and (row["bwd_max_abs"], row["bwd_max_rel"]) == (None, None)
        assert row["fwd_max_rel"] <= row["tolerance"] == verify.TOLERANCE[dtype]
        assert math.isfinite(row["time_ratio"]) and row["time_ratio"] > 0
    # both paths ran: the release's fused kernel (upstream) and the fix's plain RMSNorm (patched)
    assert {"torch_npu.npu_add_rms_norm", "torch_npu.npu_rms_norm"} <= set(doubles.names())
    # fp32: the same float32 sum either way; bf16: the fix normalises the rounded bf16 sum, the
    # fused kernel its float32 sum, a difference well inside the bf16 tolerance
    assert found["float32"]["fwd_max_abs"] == 0.0
    assert 0.0 < found["bfloat16"]["fwd_max_rel"] < 0.02
    assert NAME not in {entry["name"] for entry in report["not_checked"] + report["not_run"]}


def test_the_table_row_says_forward_only(layernorm: ModuleType) -> None:
    lines = "\n".join(verify.render(verified(VERL_NPU_AUTOPATCH_ENABLE="glm52"))).splitlines()
    table = [line.split() for line in lines if line.startswith(NAME)]
    # kernel, dtype, result, fwd abs, fwd rel, then "inference" and "-" for the backward columns
    assert [row[:3] for row in table] == [[NAME, "fp32", "ok"], [NAME, "bf16", "ok"]]
    assert [row[5:7] for row in table] == [["inference", "-"]] * 2
    assert all(row[7].endswith("x") for row in table)


def _wrong_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """npu_rms_norm off by a scale of 1.1 (the fix's kernel; the release's fused one stays right)."""
    y, rstd = doubles.npu_rms_norm(x, gamma, epsilon)
    return y * 1.1, rstd


def test_a_wrong_rms_norm_is_a_mismatch(layernorm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules["torch_npu"], "npu_rms_norm", _wrong_rms_norm)
    report = verified(VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert report["ok"] is False
    for row in rows(report).values():
        assert not row["passed"] and row["error"] is None, row
        # the scale is a 10 % error of the normed output (the new residual is right); rel divides
        # by the largest upstream magnitude of both outputs, the residual's where it is larger
        assert row["fwd_max_rel"] > 0.05 and row["fwd_max_rel"] <= 0.1 + 1e-6, row
    mismatch = "MISMATCH ascend.rms_norm_residual (float32): error above the fp32 tolerance 0.0001"
    assert mismatch in verify.render(report)


def test_a_raising_op_is_an_error_row(layernorm: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the double's add-rms-norm kernel refuses")

    monkeypatch.setattr(sys.modules["torch_npu"], "npu_add_rms_norm", refuse)
    report = verified(VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert report["ok"] is False and report["error"] is None
    for dtype, row in rows(report).items():
        assert not row["passed"] and row["error"] == "RuntimeError: the double's add-rms-norm kernel refuses", row
        assert (row["fwd_max_abs"], row["time_ratio"], row["tolerance"]) == (None, None, verify.TOLERANCE[dtype])


def test_not_run_when_the_patch_is_not_applied(layernorm: ModuleType) -> None:
    """Opt-in (group glm52) and not enabled: nothing runs, the report says why."""
    report = verified()
    assert (report["ok"], report["results"], report["device"]) == (True, [], None)
    (entry,) = report["not_run"]
    assert entry == {"name": NAME, "state": "disabled", "reason": "opt-in: enable with VERL_NPU_AUTOPATCH_ENABLE=glm52"}
    lines = verify.render(report)
    assert "checks not run (the patch is not applied here):" in lines
    assert any(line.startswith(f"  {NAME}: disabled (") for line in lines), lines


def test_not_run_without_vllm_ascend() -> None:
    """No vllm_ascend to import (no test doubles either): the patch is gated, nothing runs."""
    report = verified(VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert (report["ok"], report["results"]) == (True, [])
    (entry,) = report["not_run"]
    assert (entry["name"], entry["state"]) == (NAME, "gated") and "vllm_ascend" in entry["reason"], entry


# --------------------------------------------------------------------------- the console script
#: ``torch_npu`` made of the test doubles (the shim directory's ``torch_npu.py``).
EMULATION = (
    "from tests.ascend.doubles import npu_add_rms_norm, npu_format_cast, npu_rms_norm, npu_rotary_mul  # noqa: F401\n"
)
#: npu_rms_norm off by a scale of 1.1.
WRONG_RMS_NORM = EMULATION + (
    "\n\ndef npu_rms_norm(x, gamma, epsilon=1e-6):\n"
    "    from tests.ascend import doubles\n\n"
    "    y, rstd = doubles.npu_rms_norm(x, gamma, epsilon)\n"
    "    return y * 1.1, rstd\n"
)
#: vllm_ascend.ops, as the release's registers its custom ops when imported: the double of maybe_chunk_residual.
OPS_PACKAGE = "from tests.ascend import doubles\n\ndoubles.register_maybe_chunk_residual()\n"
#: A stub module of the shim: its names are the doubles of ``doubles.LAYERNORM_IMPORTS``.
STUB = "from tests.ascend import doubles\n\nglobals().update(doubles.LAYERNORM_IMPORTS[__name__])\n"


def shim(tmp_path: Path, release: Path, torch_npu: str) -> Path:
    """A directory holding ``torch_npu.py`` (``torch_npu``) and a ``vllm_ascend`` package: the
    release's ``ops/layernorm.py`` unchanged, its vllm-ascend imports stubbed."""
    root = tmp_path / "shim"
    package = root / "vllm_ascend"
    files = {
        "torch_npu.py": torch_npu,
        "vllm_ascend/__init__.py": '"""TEST DOUBLE: the vllm-ascend package."""\n',
        "vllm_ascend/device/__init__.py": "",
        "vllm_ascend/ops/__init__.py": OPS_PACKAGE,
        "vllm_ascend/ops/triton/__init__.py": "",
        "vllm_ascend/ops/layernorm.py": (release / "vllm_ascend/ops/layernorm.py").read_text(encoding="utf-8"),
        **{name.replace(".", "/") + ".py": STUB for name in doubles.LAYERNORM_IMPORTS},
    }
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text, encoding="utf-8")
    assert (package / "utils.py").exists()
    return root


def doctor(tmp_path: Path, releases: dict, torch_npu: str, *args: str) -> subprocess.CompletedProcess:
    """``doctor --verify --device npu --json``-style run with the glm52 group on (the
    transformers kernels off: their checks run in tests/hf)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_NPU_AUTOPATCH")}
    env["PYTHONPATH"] = os.pathsep.join([str(shim(tmp_path, releases["0.23.0"][0], torch_npu)), str(ROOT)])
    env["VERL_NPU_AUTOPATCH_ENABLE"] = "glm52"
    env["VERL_NPU_AUTOPATCH_DISABLE"] = "transformers"
    command = [str(SCRIPT), "doctor", "--verify", "--device", "npu", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_cli_shows_a_pass_row(tmp_path: Path, releases: dict) -> None:
    proc = doctor(tmp_path, releases, EMULATION, "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert {r["name"]: r["state"] for r in data["records"]}[NAME] == "applied"
    report = data["verify"]
    assert report["ok"] is True and report["torch_npu"] == str(tmp_path / "shim" / "torch_npu.py")
    found = rows(report)
    assert set(found) == set(DTYPES) and all(r["passed"] and r["backward"] is False for r in found.values())
    assert {r["name"] for r in report["results"]} == {NAME}
    # the transformers kernels (disabled here) are listed as not run, with their state
    assert {e["state"] for e in report["not_run"]} == {"disabled"} and len(report["not_run"]) > 20


def test_cli_exits_4_on_a_mismatch(tmp_path: Path, releases: dict) -> None:
    proc = doctor(tmp_path, releases, WRONG_RMS_NORM)
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 120, [line for line in lines if len(line) > 120]
    table = [line.split()[:3] for line in lines if line.startswith(NAME + " ")]
    assert table == [[NAME, "fp32", "FAIL"], [NAME, "bf16", "FAIL"]]
    assert "MISMATCH ascend.rms_norm_residual (bfloat16): error above the bf16 tolerance 0.02" in proc.stdout
    # the disabled transformers kernels: one line, named as a family
    kernels = sum(verify.has_check(p.name) for p in catalog.builtin() if p.name.startswith("transformers."))
    assert f"  transformers.* ({kernels}): disabled (turned off by VERL_NPU_AUTOPATCH_DISABLE)" in lines


def test_cli_reports_a_raising_op_without_crashing(tmp_path: Path, releases: dict) -> None:
    broken = EMULATION + "\n\ndef npu_add_rms_norm(*args, **kwargs):\n    raise RuntimeError('the shim refuses')\n"
    proc = doctor(tmp_path, releases, broken, "--json")
    assert proc.returncode == 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["status"] == "active" and data["verify"]["error"] is None
    for row in rows(data["verify"]).values():
        assert not row["passed"] and row["error"] == "RuntimeError: the shim refuses", row
