"""The decision table's transformers and Liger-Kernel columns for the installed releases are what
really happens: the live checks on the imported modeling modules, and what the real
``apply_liger_kernel_to_<family>`` rebinds when called (in a child interpreter: Liger's
rebinding is for good)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.matrix import live_sites, matrix_script
from verl_npu_autopatch.authoring.fingerprints import ModuleSource
from verl_npu_autopatch.patches import transformers_deepstack, transformers_npu

STATE = {"apply": "applies"}


@pytest.fixture(scope="module")
def script():
    return matrix_script()


def live_state(patch) -> str:
    """What the engine records for ``patch`` here: the first variant that applies, else the first
    variant found decides; ``absent`` without the modeling module."""
    sites = live_sites(patch)
    if not sites:
        return "absent"
    verdicts = [patch.check(site) for site in sites]
    chosen = next((v for v in verdicts if v.action == "apply"), verdicts[0])
    return STATE.get(chosen.action, chosen.action)


def test_transformers_column_matches_the_live_checks(script):
    version = importlib.metadata.version("transformers")
    if version not in script.TRANSFORMERS_VERSIONS:
        pytest.skip(f"transformers {version} is not a column of the table")
    try:
        rows = script.TRANSFORMERS.compute()
    except OSError as exc:  # only when PyPI truly cannot be reached
        pytest.skip(f"cannot download the transformers releases of the table from PyPI: {exc}")
    table = {name: cells[version][0] for name, _, cells in rows}
    live = {patch.name: live_state(patch) for patch in [*transformers_npu.PATCHES, *transformers_deepstack.PATCHES]}
    assert live == table
    assert "applies" in set(live.values())


#: A record's state -> the table's word for it.
RECORDED = {"applied": "applies", "pending": "absent"}


def test_every_live_record_equals_its_column(script, make_engine, npu):
    """What a private engine really records for every transformers kernel patch, each modeling
    module imported, equals the installed release's column (so the table cannot say *applies*
    where the record says *unsupported*, as it did for the rotary on 5.25.0's hub-kernel form)."""
    version = importlib.metadata.version("transformers")
    assert version in script.TRANSFORMERS_VERSIONS, f"transformers {version} (a test env) is not a column of the table"
    try:
        rows = script.TRANSFORMERS.compute()
    except OSError as exc:  # only when PyPI truly cannot be reached
        pytest.skip(f"cannot download the transformers releases of the table from PyPI: {exc}")
    patches = [*transformers_npu.PATCHES, *transformers_deepstack.PATCHES]
    engine = make_engine(patches)
    for family in transformers_npu.MODELS:
        try:
            importlib.import_module(transformers_npu.module_name(family))
        except ImportError:  # a family this release lacks: its records stay pending, the column says absent
            continue
    table = {name: cells[version][0] for name, _, cells in rows}
    records = {p.name: engine.records[p.name] for p in patches}
    live = {name: RECORDED.get(record.state, record.state) for name, record in records.items()}
    for name, record in records.items():
        # A class two families share (4.57's qwen2_5_vl imports Qwen2RMSNorm): the same kernel is
        # installed on it by the family that patched it first; the check applies for both.
        owner = record.reason.removeprefix("target owned by ").split(" ")[0]
        if record.state == "yielded" and owner in records and "(shared class " in record.reason:
            assert records[owner].state == "applied", (name, owner)
            live[name] = "applies"
    assert live == table, {n: (records[n].state, records[n].reason) for n in live if live[n] != table[n]}


CHILD = textwrap.dedent(
    """
    import importlib, inspect, json, sys
    from liger_kernel.transformers import monkey_patch
    from verl_npu_autopatch.patches import transformers_npu

    found, failed = {}, {}
    for family in transformers_npu.MODELS:
        apply = getattr(monkey_patch, f"apply_liger_kernel_to_{family}", None)
        if apply is None:
            continue
        module = importlib.import_module(transformers_npu.module_name(family))
        params = inspect.signature(apply).parameters
        switches = [s for s in params if s != "model" and isinstance(params[s].default, bool)]
        before = dict(vars(module))
        try:
            apply(**{s: s in ("rope", "rms_norm", "swiglu") for s in switches})
        except Exception as exc:  # e.g. a Liger model module that does not import with this transformers
            failed[family] = f"{type(exc).__name__}: {exc}"
            continue
        found[family] = sorted(k for k, v in vars(module).items() if before.get(k) is not v)
    print(json.dumps({"found": found, "failed": failed}))
    """
)


def _transformers_major() -> int:
    return int(importlib.metadata.version("transformers").split(".")[0])


def test_liger_column_is_what_liger_really_rebinds(script):
    """The table's Liger rule (``liger_replacements``) read from the installed release's source (the
    table's own download when it is a column; liger-kernel 0.7.0 under transformers 4.57 is not)
    names exactly what calling each ``apply_liger_kernel_to_*`` rebinds."""
    version = importlib.metadata.version("liger-kernel")
    columns = [a for a in script.LIGER.columns if a.version == version]
    if columns:
        try:
            tree = script.LIGER.tree(columns[0], script.CACHE)
        except OSError as exc:  # only when PyPI truly cannot be reached
            pytest.skip(f"cannot download liger-kernel {version} from PyPI: {exc}")
        monkey_patch = tree.module(script.LIGER_FILE[: -len(".py")].replace("/", "."))
    else:
        installed = importlib.metadata.distribution("liger-kernel").locate_file(script.LIGER_FILE)
        monkey_patch = ModuleSource(Path(installed).read_text(encoding="utf-8"))
    # Branches taken on this transformers: liger tests IS_TRANSFORMERS_V5_OR_LATER.
    skipped_branch = (
        "not IS_TRANSFORMERS_V5_OR_LATER" if _transformers_major() >= 5 else "[IS_TRANSFORMERS_V5_OR_LATER]"
    )
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rebound = result["found"]
    assert {"qwen2", "qwen3", "qwen3_moe"} <= set(rebound), result["failed"]
    for family, names in rebound.items():
        replaced = script.liger_replacements(monkey_patch.function_node(f"apply_liger_kernel_to_{family}"))
        expected = {
            entry.split(" ")[0]
            for switch in ("rope", "rms_norm", "swiglu")
            for entry in replaced.get(switch, [])
            if skipped_branch not in entry and "." not in entry.split(" ")[0] and entry[0] != "!"
        }
        assert set(names) == expected, family
