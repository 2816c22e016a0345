"""The command line, run as users run it: the console script and ``python -m`` in venvs with the
built wheel."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.children import ROOT, clean_env, run, run_json

REAL_PLUGIN = ROOT / "tests" / "fixtures" / "real_plugin"


def cli(python: Path, *args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None):
    child_env = clean_env(**(env or {}))
    if pythonpath:
        child_env["PYTHONPATH"] = str(pythonpath)
    script = python.parent / "verl-npu-autopatch"
    return subprocess.run([str(script), *args], env=child_env, capture_output=True, text=True, check=False)


def test_status_json_shows_files_configuration_device_and_gates(base_python: Path) -> None:
    proc = cli(base_python, "status", "--json", env={"VERL_NPU_AUTOPATCH_DEVICE": "bogus"})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert {Path(p).name for p in data["install_files"]} == {"verl_npu_autopatch.pth", "verl_npu_autopatch.start"}
    assert data["observer_installed"] is True
    assert data["configuration"]["device"] == "auto"
    assert any("VERL_NPU_AUTOPATCH_DEVICE='bogus'" in w for w in data["warnings"])
    assert data["active"] is False and "torch_npu is not installed" in data["inactive_reason"]
    assert data["distributions"]["wrapt"]
    # no target was imported to decide
    assert all(p["state"] in ("inactive", "gated", "disabled") for p in data["patches"])


def test_status_does_not_import_targets(base_python: Path) -> None:
    code = """
import io, json, sys, contextlib
from verl_npu_autopatch.cli import main as cli
with contextlib.redirect_stdout(io.StringIO()):
    cli.main(["status"])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "transformers", "torch"))))
"""
    assert run_json(base_python, code, env={"VERL_NPU_AUTOPATCH_DEVICE": "npu"}) == []


def test_status_plans_fixture_patches_with_npu_forced(base_python: Path) -> None:
    proc = run(
        base_python,
        "from verl_npu_autopatch.cli.main import main; main(['status', '--json'])",
        env={"VERL_NPU_AUTOPATCH_DEVICE": "npu"},
    )
    plans = {p["name"]: p for p in json.loads(proc.stdout)["patches"]}
    assert plans["fixture.forward"]["state"] == "would apply"
    assert plans["fixture.optin"]["state"] == "disabled"
    assert plans["fixture.gated"]["state"] == "gated"
    assert plans["fixture.gated"]["reason"] == "needs vllm<0.24; found vllm 0.32.0"


def test_python_dash_m_and_console_script_agree(base_python: Path) -> None:
    module = run(
        base_python,
        "import runpy; runpy.run_module('verl_npu_autopatch', run_name='__main__')",
        check=False,
        fixtures=False,
    )
    assert module.returncode == 2 and "usage: verl-npu-autopatch" in module.stderr
    listing = subprocess.run(
        [str(base_python), "-m", "verl_npu_autopatch", "list", "--json"],
        capture_output=True,
        text=True,
        env=clean_env(),
        check=True,
    )
    assert json.loads(listing.stdout) == json.loads(cli(base_python, "list", "--json").stdout)


def test_docs_patches_md_is_generated_and_current(base_python: Path) -> None:
    generated = cli(base_python, "list", "--markdown").stdout
    assert generated.startswith("# Patch catalog")
    assert (ROOT / "docs" / "patches.md").read_text() == generated, (
        "docs/patches.md is stale: run `verl-npu-autopatch list --markdown > docs/patches.md`"
    )


def test_doctor_reports_applied_and_exits_zero(base_python: Path) -> None:
    proc = cli(base_python, "doctor", "--json", "--device", "npu", pythonpath=ROOT / "tests" / "fixtures" / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    states = {r["name"]: r["state"] for r in data["records"]}
    assert states["fixture.forward"] == "applied"
    assert states["fixture.early"] == "applied"  # doctor imports every target, watched or not
    assert states["fixture.missing"] == "unsupported"
    assert data["trigger"] == "doctor"


def test_doctor_exits_non_zero_on_failure_and_shows_why(base_python: Path) -> None:
    proc = cli(
        base_python,
        "doctor",
        "--device",
        "npu",
        env={"AUTOPATCH_FIXTURE_BROKEN": "1"},
        pythonpath=ROOT / "tests" / "fixtures" / "site",
    )
    assert proc.returncode == 1
    assert "FAILED: fixture.broken" in proc.stdout
    assert "RuntimeError: boom from the fixture fix" in proc.stdout


def test_doctor_exits_non_zero_on_superseded_and_names_the_live_owner(base_python: Path) -> None:
    site = ROOT / "tests" / "fixtures" / "site"
    env = {"AUTOPATCH_FIXTURE_USURPER": "1"}
    data = json.loads(cli(base_python, "doctor", "--json", "--device", "npu", env=env, pythonpath=site).stdout)
    record = next(r for r in data["records"] if r["name"] == "fixture.forward")
    assert (record["state"], record["reason"]) == ("superseded", "replaced by autopatch_usurper.usurped_forward")
    proc = cli(base_python, "doctor", "--device", "npu", env=env, pythonpath=site)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "SUPERSEDED: fixture.forward: the fix was installed, but something else runs there now" in proc.stdout


def test_doctor_on_inactive_host(base_python: Path) -> None:
    proc = cli(base_python, "doctor", "--json")
    data = json.loads(proc.stdout)
    assert proc.returncode == 0 and data["status"] == "inactive" and data["records"] == []
    assert "doctor --device npu` is a dry run" in cli(base_python, "doctor").stdout


def test_real_transformers_module_patched_by_entry_point_plugin(hf_python: Path) -> None:
    """A test-only plugin registered through the entry-point group patches the real
    ``transformers.models.qwen2.modeling_qwen2`` on import, and ``doctor --json`` from a fresh
    interpreter reports it applied."""
    code = """
import json, torch
from transformers.models.qwen2 import modeling_qwen2
import autopatch_real_plugin, verl_npu_autopatch
norm = modeling_qwen2.Qwen2RMSNorm(8)
norm(torch.ones(2, 8))
print(json.dumps([verl_npu_autopatch.report()["plugin.qwen2_rms_norm_counter"].state, autopatch_real_plugin.CALLS[0]]))
"""
    # the built-in transformers kernels need torch_npu to run: keep them out of this engine test
    off = {"VERL_NPU_AUTOPATCH_DISABLE": "transformers"}
    env = {"VERL_NPU_AUTOPATCH_DEVICE": "npu", "PYTHONPATH": str(REAL_PLUGIN), **off}
    assert run_json(hf_python, code, env=env, fixtures=False) == ["applied", 1]
    proc = cli(hf_python, "doctor", "--json", "--device", "npu", env=off, pythonpath=REAL_PLUGIN)
    data = json.loads(proc.stdout)
    (record,) = [r for r in data["records"] if r["name"] == "plugin.qwen2_rms_norm_counter"]
    assert record["state"] == "applied"
    assert record["target"] == "transformers.models.qwen2.modeling_qwen2:Qwen2RMSNorm.forward"
    assert data["pid"] != 0 and proc.returncode in (0, 1)
    assert proc.returncode == (1 if any(r["state"] == "failed" for r in data["records"]) else 0)


def test_doctor_child_is_a_module_announcing_each_step(base_python: Path) -> None:
    """What ``doctor`` runs in its fresh interpreter, run directly: step marks before the import of
    each pending target, then the report after the doctor mark."""
    proc = subprocess.run(
        [str(base_python), "-m", "verl_npu_autopatch.cli.doctor_child"],
        env={**clean_env(VERL_NPU_AUTOPATCH_DEVICE="npu"), "PYTHONPATH": str(ROOT / "tests" / "fixtures" / "site")},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    before, _, report = proc.stdout.partition("@@verl-npu-autopatch-doctor@@")
    mark = "@@verl-npu-autopatch-step@@"
    steps = [line.split(mark, 1)[1] for line in before.splitlines() if mark in line]
    (count,) = [line.split("@@verl-npu-autopatch-targets@@")[1] for line in before.splitlines() if "-targets@@" in line]
    assert int(count) == sum(step.startswith("import ") for step in steps)  # announced before the first import
    assert steps[0] == "activation (loading the catalog and the plugins)" and steps[-1] == "settling the records"
    assert "import vllm.model" in steps
    data = json.loads(report)
    assert {r["name"]: r["state"] for r in data["records"]}["fixture.forward"] == "applied"
    assert (data["trigger"], data["strict"], data["import_errors"]) == ("doctor", False, {})


# --------------------------------------------------------------------------- the first screen (issue 22)
def assert_fits(text: str) -> list[str]:
    lines = text.splitlines()
    assert [line for line in lines if len(line) > 120] == []
    return lines


def test_status_first_screen_is_a_summary_that_fits_120_columns(base_python: Path) -> None:
    """A newcomer on a CPU host: one line per (state, reason), the patches named compactly, what
    needs attention; not one row per patch."""
    data = json.loads(cli(base_python, "status", "--json").stdout)
    lines = assert_fits(cli(base_python, "status").stdout)
    counts: dict[str, int] = {}
    groups: dict[tuple[str, str], int] = {}
    for plan in data["patches"]:
        counts[plan["state"]] = counts.get(plan["state"], 0) + 1
        groups[plan["state"], plan["reason"]] = groups.get((plan["state"], plan["reason"]), 0) + 1
    assert set(counts) <= {"gated", "disabled", "inactive"}  # no NPU stack here: nothing would apply
    expected = ", ".join(f"{counts[s]} {s}" for s in ("gated", "disabled", "inactive") if s in counts)
    assert f"summary: {len(data['patches'])} patches: {expected}" in lines
    for (state, reason), count in groups.items():
        assert f"  {state} ({count}): {reason}" in lines
    qwen3 = [p["name"] for p in data["patches"] if p["name"].startswith("transformers.qwen3.")]
    assert f"transformers.qwen3.* ({len(qwen3)})" in "\n".join(lines)  # a family gated alike: named once
    assert not any(line.startswith("transformers.qwen3.mlp") for line in lines)  # no per-patch table
    assert "nothing needs attention" in lines
    assert lines[-1] == "every patch, its reason and what it touches: verl-npu-autopatch status --all"
    assert len(lines) < len(data["patches"])


def test_status_all_lists_every_patch_within_120_columns(base_python: Path) -> None:
    data = json.loads(cli(base_python, "status", "--json", pythonpath=ROOT / "tests" / "fixtures" / "site").stdout)
    lines = assert_fits(cli(base_python, "status", "--all", pythonpath=ROOT / "tests" / "fixtures" / "site").stdout)
    header = next(i for i, line in enumerate(lines) if line.split() == ["patch", "decision", "why"])
    starts = {line.split()[0] for line in lines[header + 2 :] if line and not line.startswith(" ")}
    assert {p["name"] for p in data["patches"]} <= starts
    assert "what each patch touches:" in lines
    assert "  also changes vllm.v1.engine.core:DPEngineCoreProc.execute_dummy_batch" not in lines
    assert "    also changes vllm.v1.engine.core:DPEngineCoreProc.execute_dummy_batch" in lines


def test_status_summary_names_what_needs_attention(base_python: Path) -> None:
    lines = assert_fits(cli(base_python, "status", env={"VERL_NPU_AUTOPATCH_DEVICE": "bogus"}).stdout)
    attention = lines.index("needs attention:")
    assert lines[attention + 1].startswith("  WARNING: VERL_NPU_AUTOPATCH_DEVICE='bogus'")
    assert "inactive: no NPU stack: torch_npu is not installed (VERL_NPU_AUTOPATCH_DEVICE=auto)" in lines


def test_doctor_first_screen_summarises_and_lists_what_needs_attention(base_python: Path) -> None:
    site = ROOT / "tests" / "fixtures" / "site"
    env = {"AUTOPATCH_FIXTURE_USURPER": "1"}
    data = json.loads(cli(base_python, "doctor", "--json", "--device", "npu", env=env, pythonpath=site).stdout)
    proc = cli(base_python, "doctor", "--device", "npu", env=env, pythonpath=site)
    lines = assert_fits(proc.stdout)
    records = {r["name"]: r for r in data["records"]}
    applied = [name for name, r in records.items() if r["state"] == "applied"]
    assert lines[0] == "verl-npu-autopatch 0.1.0: device npu (forced)"
    assert lines[1].startswith("engine active: activated by doctor (pid ")
    assert lines[2].startswith(f"summary: {len(records)} patches: {len(applied)} applied, ")
    assert f"  applied ({len(applied)})" in lines and "  superseded (1)" in lines
    attention = lines[lines.index("needs attention:") + 1 :]
    assert "  superseded: fixture.forward: replaced by autopatch_usurper.usurped_forward" in attention
    assert any(line.startswith("  unsupported: fixture.missing: expected vllm.old_layout") for line in attention)
    assert "every patch with its target and reason: verl-npu-autopatch doctor --all" in lines
    full = assert_fits(cli(base_python, "doctor", "--all", "--device", "npu", env=env, pythonpath=site).stdout)
    rows = {}  # a target too long for the row's line is on the next one, indented
    for line, after in zip(full, [*full[1:], ""], strict=True):
        if line and not line.startswith(" "):
            cells = line.split()
            wrapped = after.strip().partition(" |")[0]  # the first target, the next variants after " | "
            rows[cells[0]] = cells[1:3] if len(cells) > 2 else [*cells[1:], wrapped]
    for name, record in records.items():  # state, then the first target without its package path
        module, _, qualname = record["target"].split(" | ")[0].partition(":")
        shown = module if qualname == "__file__" else f"{module.rsplit('.', 1)[-1]}:{qualname}"  # a trigger: whole
        assert rows[name] == [record["state"], shown]


# --------------------------------------------------------------------------- issue 39
SITE = ROOT / "tests" / "fixtures" / "site"


def test_bug_report_is_one_paste_ready_dump(base_python: Path) -> None:
    env = {"VERL_NPU_AUTOPATCH_DISABLED": "liger", "VERL_NPU_AUTOPATCH_ENABLE": "glm52\x1b[2J" + "x" * 400}
    proc = cli(base_python, "bug-report", "--timeout", "120", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "## verl-npu-autopatch bug report" and "\x1b" not in proc.stdout
    for label in ("Python", "platform", "torch", "torch_npu", "CANN", "vLLM", "vllm-ascend", "transformers"):
        assert any(line.startswith(label + " ") for line in lines), label
    assert any(line.startswith(("verl ", "Megatron-Core ", "Ray ")) for line in lines)
    assert any(line.startswith("wrapt ") and "not installed" not in line for line in lines)
    assert "VERL_NPU_AUTOPATCH_DISABLED=liger" in lines
    assert any(line.startswith("VERL_NPU_AUTOPATCH_ENABLE=glm52\\x1b[2Jxxx") for line in lines)
    assert "**doctor** (exit code 0)" in lines and "engine inactive: no NPU stack" in proc.stdout
    assert "did you mean VERL_NPU_AUTOPATCH_DISABLE?" in " ".join(proc.stdout.split())
    assert "https://github.com/verl-project/verl-npu-autopatch/issues" in proc.stdout
    data = json.loads(cli(base_python, "bug-report", "--json", env=env).stdout)
    assert set(data) == {"environment", "doctor", "doctor_exit_code", "issues"}
    assert data["environment"]["packages"]["wrapt"] and data["environment"]["packages"]["torch"] is None
    assert data["doctor"]["status"] == "inactive" and data["doctor_exit_code"] == 0


def test_every_json_carries_the_environment_block(base_python: Path) -> None:
    status = json.loads(cli(base_python, "status", "--json").stdout)
    found = json.loads(cli(base_python, "doctor", "--json", "--device", "npu", pythonpath=SITE).stdout)
    for data in (status, found):
        assert data["environment"]["verl_npu_autopatch"] == status["version"]
        assert data["environment"]["packages"]["vllm"] == ("0.32.0" if data is found else None)  # the fixture's
    assert {"records", "status", "warnings", "device"} <= set(found)  # the old fields stay


@pytest.mark.parametrize("columns", [80, 200])
def test_every_screen_fits_the_width(base_python: Path, columns: int) -> None:
    commands = [
        ("status",),
        ("status", "--all"),
        ("list",),
        ("list", "--all"),
        ("doctor", "--device", "npu"),
        ("doctor", "--device", "npu", "--all"),
        ("bug-report",),
        *((command, "--help") for command in ("status", "list", "doctor", "bug-report")),
        ("--help",),
    ]
    env = {"COLUMNS": str(columns), "AUTOPATCH_FIXTURE_BROKEN": "1"}  # a failed record: its traceback too
    longest = {}
    for argv in commands:
        proc = cli(base_python, *argv, env=env, pythonpath=SITE)
        assert proc.stdout and "Traceback (most recent call last):\n  File" not in proc.stderr, argv
        longest[argv] = max(map(len, proc.stdout.splitlines()))
    assert {argv: n for argv, n in longest.items() if n > columns} == {}
    assert columns == 80 or longest["list",] > 120  # the room is used


def test_doctor_never_writes_into_the_jobs_report_directory(base_python: Path, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    reports.mkdir(mode=0o700)
    env = {"VERL_NPU_AUTOPATCH_REPORT_DIR": str(reports)}
    proc = cli(base_python, "doctor", "--device", "npu", env=env, pythonpath=SITE)
    assert proc.returncode == 0 and "engine active" in proc.stdout, proc.stdout + proc.stderr
    assert list(reports.iterdir()) == []


def test_misspelt_variables_are_warned_in_status_and_doctor_only(base_python: Path) -> None:
    env = {"VERL_NPU_AUTOPACH_DISABLE": "liger", "VERL_NPU_AUTOPATCH_DEVICE": "npu", "VERL_NPU_AUTOPATCH_LOG": "INFO"}
    for argv in (("status",), ("doctor",)):
        text = " ".join(cli(base_python, *argv, env=env, pythonpath=SITE).stdout.split())
        assert "WARNING: 'VERL_NPU_AUTOPACH_DISABLE' is set but is not a variable" in text, argv
        assert "did you mean VERL_NPU_AUTOPATCH_DISABLE?" in text
    started = run(base_python, "import vllm.model, verl_npu_autopatch as v; print(v.report().status)", env=env)
    assert started.stdout.split() == ["active"] and "AUTOPACH" not in started.stderr  # start-up says nothing


def test_doctor_shows_progress_on_a_terminal_only(base_python: Path) -> None:
    import os
    import pty

    env = {**clean_env(VERL_NPU_AUTOPATCH_DEVICE="npu", AUTOPATCH_FIXTURE_HANG="1"), "PYTHONPATH": str(SITE)}
    script = str(base_python.parent / "verl-npu-autopatch")
    for argv in (["doctor", "--timeout", "4"], ["doctor", "--json", "--timeout", "4"]):
        main, child = pty.openpty()
        proc = subprocess.run([script, *argv], env=env, stdout=subprocess.PIPE, stderr=child, check=False)
        os.close(child)
        seen = b""
        try:
            while chunk := os.read(main, 65536):
                seen += chunk
        except OSError:  # the terminal's other end is closed: all was read
            pass
        os.close(main)
        assert proc.returncode == 3
        if "--json" in argv:
            assert b"targets imported" not in seen and b"targets imported" not in proc.stdout
        else:
            assert b"\rdoctor: targets imported " in seen and b"now: import vllm.hang" in seen
            assert seen.endswith(b"\r") and b"targets imported" not in proc.stdout
    hang = {"AUTOPATCH_FIXTURE_HANG": "1", "VERL_NPU_AUTOPATCH_DEVICE": "npu"}
    piped = cli(base_python, "doctor", "--timeout", "4", env=hang, pythonpath=SITE)
    assert piped.returncode == 3 and "targets imported" not in piped.stderr  # not a terminal: no progress line


def test_help_and_the_bare_command(base_python: Path) -> None:
    bare = cli(base_python)
    assert bare.returncode == 2 and bare.stdout == "" and "error:" not in bare.stderr
    assert "exit codes:" in bare.stderr and "bug-report" in bare.stderr
    for command in ("status", "list", "doctor", "bug-report"):
        text = cli(base_python, command, "--help").stdout
        assert "exit codes:" in text and "VERL_NPU_AUTOPATCH_REPORT_DIR" in text and "print JSON" in text, command
    refused = cli(base_python, "list", "--json", "--markdown")
    assert refused.returncode == 2 and "not allowed with argument --json" in refused.stderr
