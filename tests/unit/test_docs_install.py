"""The installing-before-a-release docs show what works: every Ray ``runtime_env`` example that
ships a wheel is the form ``tests/ray/test_ray_runtime_env.py`` ships the freshly built wheel in
(``{"pip": [<path to the .whl>], "env_vars": {...}}``), named as the build names the wheel."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from verl_npu_autopatch import __version__

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: What ``pip wheel`` / ``python -m build`` name the wheel: pure Python, any platform.
WHEEL = re.compile(rf"(?:^|/)verl_npu_autopatch-{re.escape(__version__)}-py3-none-any\.whl$")


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)


def _runtime_envs(source: str) -> list[dict[str, Any]]:
    """Every ``runtime_env=`` keyword and ``runtime_env = {...}`` assignment in ``source`` that
    names a wheel, as a literal (one that is not a literal must not name a wheel)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        keyword = isinstance(node, ast.keyword) and node.arg == "runtime_env"
        assigned = isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "runtime_env" for t in node.targets)
        if not (keyword or assigned):
            continue
        value = node.value  # type: ignore[attr-defined]
        if ".whl" not in (ast.get_source_segment(source, value) or ""):
            continue
        found.append(ast.literal_eval(value))  # a wheel example is a literal, as the docs show it
    return found


def test_the_ray_wheel_examples_are_the_tested_form() -> None:
    wheels = []
    for page in PAGES:
        for block in _python_blocks(page):
            for env in _runtime_envs(block):
                assert isinstance(env, dict) and isinstance(env.get("pip"), list), (page.name, env)
                wheels.append(page.name)
                assert set(env) <= {"pip", "env_vars"}, (page.name, env)  # as tests/ray's runtime_env() builds it
                (path,) = env["pip"]
                assert isinstance(path, str) and path.startswith("/") and WHEEL.search(path), (page.name, path)
                variables = env.get("env_vars", {})
                assert isinstance(variables, dict)
                assert all(isinstance(k, str) and isinstance(v, str) for k, v in variables.items()), page.name
    assert "installing.md" in wheels and "ray.md" in wheels


def test_installing_cites_the_ray_test_that_ships_the_wheel() -> None:
    text = (ROOT / "docs" / "installing.md").read_text(encoding="utf-8")
    test = (ROOT / "tests" / "ray" / "test_ray_runtime_env.py").read_text(encoding="utf-8")
    cited = set(re.findall(r"`(test_\w+)`", text))
    assert cited and all(f"def {name}(" in test for name in cited)
    assert 'env["pip"] = [str(wheel)]' in test  # the form the docs show
    assert "pip wheel --no-deps -w dist ." in text
    urls = re.search(r'^Homepage = "(.+)"$', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert urls and f'"verl-npu-autopatch @ git+{urls.group(1)}"' in text
