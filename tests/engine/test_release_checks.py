"""``scripts/check-wheel`` (run by .github/workflows/release.yml) on the real wheel and a broken one."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check-wheel"


def run(*wheels: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, wheels)], capture_output=True, text=True)


def test_the_built_wheel_passes(wheel: Path) -> None:
    result = run(wheel)
    assert result.returncode == 0, result.stderr
    assert "verl_npu_autopatch.pth, verl_npu_autopatch.start at the root of 1 wheel" in result.stdout


def test_a_wheel_with_the_pth_in_a_package_folder_fails(wheel: Path, tmp_path: Path) -> None:
    broken = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(broken, "w") as target:
        for name in source.namelist():
            moved = f"verl_npu_autopatch/{name}" if name == "verl_npu_autopatch.pth" else name
            if name != "verl_npu_autopatch.start":  # and the .start is missing altogether
                target.writestr(moved, source.read(name))
    result = run(broken)
    assert result.returncode == 1
    assert "verl_npu_autopatch.pth is not at the wheel root (found at verl_npu_autopatch/verl_npu_autopatch.pth)" in (
        result.stderr
    )
    assert "verl_npu_autopatch.start is not at the wheel root" in result.stderr


def test_a_wheel_without_the_startup_module_at_its_root_fails(wheel: Path, tmp_path: Path) -> None:
    broken = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(broken, "w") as target:
        for name in source.namelist():
            if name != "_verl_npu_autopatch_startup.py":
                target.writestr(name, source.read(name))
    result = run(broken)
    assert result.returncode == 1
    assert "_verl_npu_autopatch_startup.py is not at the wheel root" in result.stderr
