"""The patch contract (``tests/support/contract.py``) for every built-in patch whose target imports
in this suite's environment, on the real upstream modules. Liger's arbitration runs in a child
interpreter: importing Liger here would wake ``liger.arbitration`` in every later test's engine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support import contract
from tests.support.children import ROOT
from verl_npu_autopatch.authoring.spec import Patch
from verl_npu_autopatch.engine import catalog

LIGER = "liger.arbitration"
LIVE = contract.live_patches(p for p in catalog.builtin() if p.name != LIGER)


@pytest.mark.parametrize("patch", LIVE, ids=lambda patch: patch.name)
def test_the_patch_keeps_its_contract(patch: Patch) -> None:
    contract.check_contract(patch)


def _release_has(patch: Patch) -> bool:
    """Whether this transformers release ships a module one of the patch's variants targets."""
    for target in patch.targets:
        try:
            if importlib.util.find_spec(target.module) is not None:
                return True
        except ModuleNotFoundError:  # its model package is not in this release
            continue
    return False


def test_every_transformers_patch_is_live_here() -> None:
    """Every transformers patch whose model this release ships is live here (4.57.6 has no
    Qwen3.5 nor Qwen3-Next, for one)."""
    ours = [p for p in catalog.builtin() if "transformers" in p.groups and p.name != LIGER]
    assert {p.name for p in LIVE} == {p.name for p in ours if _release_has(p)}
    assert len(LIVE) >= 20, [p.name for p in LIVE]  # 27 on 4.57.6, more on 5.x


CHILD = textwrap.dedent(
    """
    import dataclasses, json
    from tests.support import contract
    from verl_npu_autopatch.patches import liger_arbitration

    (patch,) = contract.live_patches(liger_arbitration.PATCHES)
    finding = contract.check_contract(patch)
    try:
        contract.check_contract(dataclasses.replace(patch, reach=dataclasses.replace(patch.reach, computed=())))
        undeclared = "passed"
    except AssertionError as exc:
        undeclared = str(exc)
    print(json.dumps({"state": finding.state, "changed": sorted(finding.changed), "undeclared": undeclared}))
    """
)


def test_liger_declares_every_attribute_it_rebinds() -> None:
    """Liger's arbitration rebinds, besides its target, ``_apply_liger_kernel`` and, found in the
    live module, the apply function of each of our families and each dispatch-table entry
    holding one; without that declaration the contract fails."""
    from verl_npu_autopatch.patches import liger_arbitration

    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    (patch,) = liger_arbitration.PATCHES
    computed = [
        site for site in found["changed"] if "apply_liger_kernel_to_" in site or liger_arbitration.TABLE in site
    ]
    functions = {site.rpartition(":")[2] for site in computed if "apply_liger_kernel_to_" in site}
    entries = {site.rpartition("[")[2].rstrip("]") for site in computed if liger_arbitration.TABLE in site}
    assert found["state"] == "applied" and "apply_liger_kernel_to_qwen3_moe" in functions, found["changed"]
    assert {"qwen2", "qwen3", "qwen3_moe"} <= entries and len(entries) >= len(functions) - 1, found["changed"]
    assert set(found["changed"]) == {str(patch.targets[0]), str(patch.reach.secondary[0]), *computed}
    assert found["undeclared"].startswith(f"{LIGER}: changed"), found["undeclared"]
