"""``verl.npu_version_probe`` on verl's real ``verl.utils.device.get_npu_versions`` (0.8.0 and
0.9.1, run from the release files), with a fake ``npu-smi`` executable on ``PATH`` that answers like
the tool in a container mounting cards 4 and 5 only: ``info -m`` lists them (and their MCU chips),
``info -t board -i N`` answers for 4 and 5 and exits 215 for any other card."""

from __future__ import annotations

import importlib
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import release_loaders, verl_upstream
from tests.verl.helpers import record, start
from verl_npu_autopatch.patches import verl_npu_version_probe as probe

NAME = "verl.npu_version_probe"
FAKE_NPU_SMI = """#!/bin/sh
echo "$@" >> "{log}"
if [ "$1 $2" = "info -m" ]; then
    printf '\\tNPU ID  Chip ID  Chip Logic ID  Chip Name\\n'
    printf '\\t4       0        0              Ascend 910B1\\n\\t4       1        -              Mcu\\n'
    printf '\\t5       0        1              Ascend 910B1\\n\\t5       1        -              Mcu\\n'
    exit 0
fi
if [ "$1 $2 $3 $4" = "info -t board -i" ] && {{ [ "$5" = 4 ] || [ "$5" = 5 ]; }}; then
    printf 'NPU ID : %s\\nSoftware Version : 25.3.RC1\\n' "$5"
    exit 0
fi
echo "Error: the device $5 does not exist" >&2
exit 215
"""


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake ``npu-smi`` first on ``PATH`` and a CANN toolkit info file; returns the call log."""
    log = tmp_path / "npu-smi.log"
    tool = tmp_path / "bin" / "npu-smi"
    tool.parent.mkdir()
    tool.write_text(FAKE_NPU_SMI.format(log=log))
    tool.chmod(0o755)
    cann = tmp_path / "cann" / f"{platform.machine()}-linux"
    cann.mkdir(parents=True)
    (cann / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.3.RC1\n")
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "cann"))
    monkeypatch.delenv(probe.VARIABLE, raising=False)
    return log


@release_loaders.loads(probe, "verl", ("0.8.0", "0.9.1"), sites={"0.9.1": {f"{probe.MODULE}:get_npu_versions"}})
@pytest.fixture
def verl_device() -> Iterator[Any]:
    """A loader ``version -> verl.utils.device`` of that release (bare ``verl`` packages; every
    verl module is dropped afterwards)."""
    opened: list[Any] = []

    def load(version: str) -> Any:
        context = verl_upstream.packages(verl_upstream.root(version))
        context.__enter__()
        opened.append(context)
        return importlib.import_module(probe.MODULE)

    yield load
    for context in opened:
        context.__exit__(None, None, None)


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_the_real_function_fails_without_card_1(verl_device: Any, host: Path, version: str) -> None:
    import subprocess

    device = verl_device(version)
    with pytest.raises(subprocess.CalledProcessError) as raised:
        device.get_npu_versions()
    assert raised.value.returncode == 215
    assert _calls(host) == ["info -t board -i 1"]


@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_with_the_patch_it_probes_the_first_visible_card(
    verl_device: Any, host: Path, engines: list, version: str
) -> None:
    device = verl_device(version)
    engine = start(engines, probe.PATCHES)
    assert record(engine, NAME) == ("applied", "fix installed")

    versions = device.get_npu_versions()
    assert tuple(versions)[-2:] == ("25.3.rc1", "8.3.rc1")  # 0.9.1 also returns the chip generation first
    assert _calls(host) == ["info -t board -i 1", "info -m", "info -t board -i 1", "info -t board -i 4"]
    assert probe.VARIABLE not in os.environ, "restored"

    engine.revert()
    with pytest.raises(Exception, match="215"):
        device.get_npu_versions()


def test_a_set_variable_is_restored_and_a_host_without_cards_keeps_the_error(
    verl_device: Any, host: Path, engines: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    device = verl_device("0.9.1")
    start(engines, probe.PATCHES)
    monkeypatch.setenv(probe.VARIABLE, "0,1")  # logical ids: not what npu-smi -i takes
    assert tuple(device.get_npu_versions())[-2:] == ("25.3.rc1", "8.3.rc1")
    assert os.environ[probe.VARIABLE] == "0,1"

    (host.parent / "bin" / "npu-smi").write_text("#!/bin/sh\nexit 215\n")  # npu-smi sees no card at all
    with pytest.raises(subprocess.CalledProcessError):
        device.get_npu_versions()
