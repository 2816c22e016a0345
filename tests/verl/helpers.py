"""Helpers of the tensordict / torch_npu / megatron-core patch tests."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import upstream
from verl_npu_autopatch.engine.config import Config
from verl_npu_autopatch.engine.lifecycle import Engine


def release_root(project: str, version: str) -> Path:
    """Source root of a release from the decision table's list (downloaded once, cached)."""
    script = upstream.matrix_script()
    (artifact,) = [a for a in script.RUNTIME_RELEASES if a.project == project and a.version == version]
    try:
        return script.extract(artifact, script.runtime_files(project))
    except OSError as exc:  # only when PyPI truly cannot be reached
        pytest.skip(f"cannot download {artifact.filename} from PyPI: {exc}")


def start(engines: list[Engine], patches: list) -> Engine:
    """An activated private engine over ``patches``, device forced to NPU, closed by the fixture."""
    engine = Engine(patches, Config(device="npu"))
    engines.append(engine)
    engine.activate()
    return engine


def record(engine: Engine, name: str) -> tuple[str, str]:
    """``(state, reason)`` of patch ``name``."""
    found = {r.name: r for r in engine.report().records}[name]
    return found.state, found.reason


def release_package(project: str, version: str) -> Path:
    """A folder holding every Python file of a release's wheel (the decision table's list; downloaded
    once, sha256-checked), to put on ``sys.path`` and import the release itself from."""
    script = upstream.matrix_script()
    (artifact,) = [a for a in script.RUNTIME_RELEASES if a.project == project and a.version == version]
    root = script.CACHE / "packages" / f"{project}-{version}"
    done = root / ".extracted"
    if done.exists():
        return root
    try:
        wheel = script.download(artifact)
    except OSError as exc:  # only when PyPI truly cannot be reached
        pytest.skip(f"cannot download {artifact.filename} from PyPI: {exc}")
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root, [n for n in archive.namelist() if n.endswith(".py")])
    done.write_text(artifact.filename + "\n")
    return root


def verl_files(version: str) -> Path:
    """Every ``verl/**.py`` of a verl release's wheel (downloaded once, sha256-checked)."""
    script = upstream.matrix_script()
    try:
        return script.verl_root(script.Artifact("verl", version, f"verl-{version}-py3-none-any.whl"))
    except OSError as exc:  # only when PyPI truly cannot be reached
        pytest.skip(f"cannot download verl {version} from PyPI: {exc}")


def forget_megatron() -> None:
    """Drop every ``megatron`` module from ``sys.modules`` (the next import reads another release)."""
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        del sys.modules[name]


def import_megatron(monkeypatch: pytest.MonkeyPatch, version: str, *names: str) -> list[ModuleType]:
    """Modules ``names`` of megatron-core ``version``, imported from its wheel's files (any megatron
    imported before is forgotten first)."""
    forget_megatron()
    monkeypatch.syspath_prepend(str(release_package("megatron-core", version)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        return [importlib.import_module(name) for name in names]
