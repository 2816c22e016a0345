"""Session fixtures: the built wheel and venvs with it installed, one per Python version."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import venvs

PYTHONS = ("3.10", "3.11", "3.12", "3.13")


@pytest.fixture(scope="session")
def wheel() -> Path:
    return venvs.build_wheel()


@pytest.fixture(scope="session")
def base_python(wheel: Path) -> Path:
    """Python 3.11 venv with wrapt, packaging and the wheel."""
    return venvs.env_python(venvs.ensure_env("base", wheel))


@pytest.fixture(scope="session", params=PYTHONS)
def any_python(request: pytest.FixtureRequest, wheel: Path) -> Path:
    """A venv with the wheel for each Python version from 3.10 to 3.13 on this machine."""
    if venvs.pyenv_python(request.param) is None:
        pytest.skip(f"Python {request.param} is not installed on this machine")
    return venvs.env_python(venvs.ensure_env("base", wheel, python=request.param))


@pytest.fixture(scope="session")
def hf_python(wheel: Path) -> Path:
    """Python 3.11 venv with CPU torch, the real transformers and Liger-Kernel, and the wheel."""
    return venvs.env_python(venvs.ensure_env("hf", wheel))
