"""Version gates (``environment.check_requirement``): a bare name is decided without importing
``packaging.requirements``; a specifier is decided by packaging, pre-releases included."""

from __future__ import annotations

import json
import subprocess
import sys

from verl_npu_autopatch.engine.environment import check_requirement

VERSIONS = {"vllm": "0.30.0rc2", "transformers": "5.24.0"}


def test_a_bare_name_holds_when_installed() -> None:
    assert check_requirement("transformers", VERSIONS.get) == (True, "transformers", "5.24.0")
    assert check_requirement(" liger-kernel ", VERSIONS.get) == (False, "liger-kernel", None)


def test_a_specifier_is_decided_by_packaging_with_prereleases() -> None:
    assert check_requirement("vllm>=0.29", VERSIONS.get) == (True, "vllm", "0.30.0rc2")  # a pre-release counts
    assert check_requirement("vllm>=0.30", VERSIONS.get) == (False, "vllm", "0.30.0rc2")  # it comes before 0.30
    assert check_requirement("transformers<5", VERSIONS.get) == (False, "transformers", "5.24.0")
    assert check_requirement("vllm>=0.1", lambda name: None) == (False, "vllm", None)


def test_a_bare_name_imports_no_requirement_parser() -> None:
    code = (
        "import json, sys; from verl_npu_autopatch.engine.environment import check_requirement; "
        "check_requirement('transformers', lambda n: '5.0'); "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('packaging'))))"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert "packaging.requirements" not in loaded and "packaging.specifiers" not in loaded
