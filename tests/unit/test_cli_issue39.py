"""Issue 39, the general command line, in process: the environment block and the bug-report dump
(fake metadata, a fake CANN install), screens that fit ``COLUMNS``, misspelt variables and
``revert()`` names, the opt-in hint, doctor's progress line and wording, the help texts. The same
through the installed command: tests/engine/test_cli.py."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import tomllib

from verl_npu_autopatch.authoring.spec import Patch, Target
from verl_npu_autopatch.cli import bug_report, doctor, help_text, summary
from verl_npu_autopatch.cli import main as cli
from verl_npu_autopatch.cli.doctor_child import COUNT_MARK, STEP_MARK
from verl_npu_autopatch.engine import catalog, decision
from verl_npu_autopatch.engine.config import VARIABLES, Config, unknown_variables, variable_warnings
from verl_npu_autopatch.engine.lifecycle import Engine

ROOT = Path(__file__).resolve().parents[2]
ESCAPES = "\x1b]0;pwned\x07\u202e"


# ----------------------------------------------------------------------------- 5: bug-report
def fake_cann(tmp_path: Path) -> Path:
    home = tmp_path / "ascend-toolkit" / "latest"
    (home / "aarch64-linux").mkdir(parents=True)
    (home / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.2.RC1\ninnerversion=V100R001C22B800\narch=aarch64\nos=linux\n"
    )
    return home


def test_the_environment_block_reads_metadata_cann_and_variables(tmp_path: Path) -> None:
    home = fake_cann(tmp_path)
    driver = tmp_path / "version.info"
    driver.write_text("Version=25.0.rc1\n")
    versions = {"torch": "2.7.1", "torch-npu": "2.7.1.post1", "vllm": "0.11.0", "megatron-core": "0.14.0"}
    env = {
        "ASCEND_TOOLKIT_HOME": str(home),
        "VERL_NPU_AUTOPATCH_ENABLE": "glm52" + ESCAPES + "x" * 500,
        "VERL_NPU_AUTOPACH_DISABLE": "liger",  # a near miss: shown too
        "VERL_VLLM_ASCEND_GLM52_PATCH": "1",
        "HOME": "/nowhere",
    }
    block = bug_report.environment(env, versions.get, directories=(), driver_file=str(driver))
    assert block["packages"]["torch-npu"] == "2.7.1.post1" and block["packages"]["verl"] is None
    assert set(block["packages"]) >= {"torch", "torch-npu", "vllm", "vllm-ascend", "transformers", "verl", "ray"}
    assert block["packages"]["megatron-core"] == "0.14.0"
    assert block["cann"] == {"version": "8.2.RC1", "file": str(home / "aarch64-linux" / "ascend_toolkit_install.info")}
    assert block["npu_driver"]["version"] == "25.0.rc1"
    shown = block["variables"]["VERL_NPU_AUTOPATCH_ENABLE"]
    assert shown.startswith("glm52\\x1b]0;pwned\\x07\\u202e") and "(516 characters)" in shown and len(shown) < 260
    assert set(block["variables"]) == {
        "VERL_NPU_AUTOPATCH_ENABLE",
        "VERL_NPU_AUTOPACH_DISABLE",
        "VERL_VLLM_ASCEND_GLM52_PATCH",
    }
    assert json.loads(json.dumps(block)) == block


def test_cann_is_found_in_the_default_directories_or_not_at_all(tmp_path: Path) -> None:
    home = fake_cann(tmp_path)
    assert bug_report.cann({}, directories=(str(tmp_path / "missing"), str(home)))["version"] == "8.2.RC1"
    assert bug_report.cann({}, directories=(str(tmp_path / "missing"),)) is None
    (home / "aarch64-linux" / "ascend_toolkit_install.info").write_text("no version here\n")
    assert bug_report.cann({"ASCEND_HOME_PATH": str(home)}, directories=()) is None


def test_the_issues_url_is_pyprojects() -> None:
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert bug_report.ISSUES_URL == urls["Issues"] == bug_report.issues_url()


def test_the_dump_is_markdown_with_the_doctor_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    block = bug_report.environment({"VERL_NPU_AUTOPATCH_DEVICE": "npu```"}, {"torch": "2.7.1"}.get, ())
    data = {"status": "inactive", "reason": "no NPU stack", "device": "none", "pid": 7, "warnings": []}
    data.update(records=[], stderr="", import_errors={})
    text = bug_report.markdown(
        {"environment": block, "doctor": data, "doctor_exit_code": 0, "issues": bug_report.ISSUES_URL}
    )
    lines = text.splitlines()
    assert lines[0] == "## verl-npu-autopatch bug report"
    assert "torch               2.7.1" in lines and "vllm-ascend         not installed" in lines
    assert "VERL_NPU_AUTOPATCH_DEVICE=npu```" in lines
    assert bug_report._fenced(["```", "x"])[0] == "````text"  # a fence no line closes
    assert "**doctor** (exit code 0)" in lines and "engine inactive: no NPU stack (pid 7)" in lines
    assert bug_report.ISSUES_URL in text and max(map(len, lines)) <= 80


# ----------------------------------------------------------------------------- 6: screens fit
@pytest.mark.parametrize("columns", [80, 200])
def test_status_and_list_fit_the_width(columns: int, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    data = cli.status_data()
    for full in (False, True):
        cli.print_status(data, full=full)
        lines = capsys.readouterr().out.splitlines()
        assert max(map(len, lines)) <= columns
    for argv in (["list"], ["list", "--all"]):
        assert cli.main(argv) == 0
        lines = capsys.readouterr().out.splitlines()
        assert max(map(len, lines)) <= columns and len(lines) > 60
        assert columns == 80 or max(map(len, lines)) > 120  # the room is used


def test_the_width_follows_columns_then_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "97")
    assert summary.width() == 97
    monkeypatch.setenv("COLUMNS", "7")
    assert summary.width() == summary.MIN_WIDTH
    monkeypatch.delenv("COLUMNS")
    assert summary.width() == 120  # stdout is not a terminal here


def test_list_cuts_summaries_and_all_shows_them_whole(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    entry = {"name": "x.y", "groups": ["g", "h"], "default": "opt-in", "device": "any", "summary": "word " * 100}
    entry.update(requires=[], reference="", touches=["x:T.f", "triggered by pkg.mod:__file__"])
    monkeypatch.setattr(cli, "catalog_data", lambda: [entry])
    cli.main(["list"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].endswith("...") and len(lines[2]) == 120
    assert lines[-1] == "groups, whole summaries and what each patch touches: verl-npu-autopatch list --all"
    cli.main(["list", "--all"])
    out = capsys.readouterr().out
    assert out.count("word") == 100 and "x.y (opt-in; device any; groups g, h)" in out
    assert "    triggered by the import of pkg.mod" in out


# ----------------------------------------------------------------------------- 8: misspelt names
def test_unknown_and_misspelt_variables_are_named_with_a_did_you_mean() -> None:
    env = {
        "VERL_NPU_AUTOPATCH_DISABLED": "x",
        "VERL_NPU_AUTOPACH_DISABLE": "x",
        "VERL_NPU_AUTOPATCH_XYZ": "1",
        "VERL_NPU_AUTOPATCH_UPSTREAM_CACHE": "/c",  # the compatibility script's: not warned
        "VLLM_ASCEND_ENABLE_MLP_OPTIMIZE": "1",
        "AUTOPATCH_FIXTURE_BROKEN": "1",
        "PATH": "/bin",
        **dict.fromkeys(VARIABLES, "1"),
    }
    assert dict(unknown_variables(env)) == {
        "VERL_NPU_AUTOPACH_DISABLE": "VERL_NPU_AUTOPATCH_DISABLE",
        "VERL_NPU_AUTOPATCH_DISABLED": "VERL_NPU_AUTOPATCH_DISABLE",
        "VERL_NPU_AUTOPATCH_XYZ": "",
    }
    (warning,) = variable_warnings({"VERL_NPU_AUTOPATCH_DISABLED": "x"})
    assert "'VERL_NPU_AUTOPATCH_DISABLED' is set but is not a variable" in warning
    assert "did you mean VERL_NPU_AUTOPATCH_DISABLE?" in warning


def test_status_warns_about_misspelt_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_NPU_AUTOPACH_DISABLE", "liger")
    data = cli.status_data()
    assert any("did you mean VERL_NPU_AUTOPATCH_DISABLE?" in w for w in data["warnings"])
    assert "VERL_NPU_AUTOPACH_DISABLE" in data["environment"]["variables"]


def test_doctor_adds_the_variable_warnings_to_the_childs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_NPU_AUTOPATCH_DISABLED", "liger")
    data: dict[str, Any] = {"status": "inactive", "warnings": ["the child's"]}
    doctor.add_warnings(data)
    assert data["warnings"][0] == "the child's" and "VERL_NPU_AUTOPATCH_DISABLE?" in data["warnings"][1]


def test_revert_of_an_unknown_name_warns_once_and_reverts_nothing(
    module_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    __import__(module_name)
    fix = lambda site: lambda: None  # noqa: E731
    patch = Patch("fam.mlp", "s", (Target.parse(f"{module_name}:Box.value"),), fix, groups=("fam",), device="any")
    engine = Engine([patch], Config(device="npu"))
    engine.activate()
    with caplog.at_level(logging.WARNING, logger="verl_npu_autopatch"):
        assert engine.revert("fam.mpl") == []
    (record,) = caplog.records
    assert record.getMessage() == (
        "revert('fam.mpl'): no patch or group has this name; did you mean 'fam.mlp' or 'fam'? nothing reverted"
    )
    caplog.clear()
    assert engine.revert("fam") == ["fam.mlp"] and caplog.records == []


def test_revert_on_an_engine_not_active_checks_the_catalogs_names(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine()
    with caplog.at_level(logging.WARNING, logger="verl_npu_autopatch"):
        assert engine.revert("transformers.qwen3.mlp") == [] and caplog.records == []
        assert engine.revert("transformers.qwen3.mpl") == []
    assert "did you mean 'transformers.qwen3.mlp'" in caplog.records[0].getMessage()


def test_the_opt_in_hint_names_the_group_and_the_value() -> None:
    fix = lambda site: lambda: None  # noqa: E731
    target = (Target.parse("m:T.f"),)
    grouped = Patch("a.b", "s", target, fix, groups=("glm52", "ascend"), default=False, device="any")
    alone = Patch("c.d", "s", target, fix, groups=(), default=False, device="any")
    assert decision.plan(grouped, Config()).reason == "opt-in: enable with VERL_NPU_AUTOPATCH_ENABLE=glm52"
    assert decision.plan(alone, Config()).reason == "opt-in: enable with VERL_NPU_AUTOPATCH_ENABLE=c.d"
    for declared in catalog.declared():  # every built-in opt-in patch names a group that turns it on alone
        if not declared.default:
            group = decision.plan(declared, Config()).reason.rpartition("=")[2]
            assert all(not p.default for p in catalog.declared() if group in p.groups), declared.name


# ----------------------------------------------------------------------------- 9: progress
def test_progress_shows_targets_imported_after_a_delay_and_erases_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    stream = io.StringIO()
    progress = doctor.Progress(stream)
    output = f"\n{STEP_MARK}activation\n{COUNT_MARK}3\n{STEP_MARK}import a.b\n{STEP_MARK}import c.d\n"
    progress(output)
    assert stream.getvalue() == ""  # the first second and a half: nothing
    progress.start -= 5
    progress(output)
    assert stream.getvalue() == "\rdoctor: targets imported 1/3, 5 s; now: import c.d"
    progress.clear()
    assert stream.getvalue().endswith("\r" + " " * 50 + "\r")
    assert doctor.progress_for(io.StringIO()) is None  # not a terminal: no progress line


# ----------------------------------------------------------------------------- 10: wording
def test_plurals_and_triggers() -> None:
    assert (summary.count(1, "patch"), summary.count(2, "patch"), summary.count(1, "more line")) == (
        "1 patch",
        "2 patches",
        "1 more line",
    )
    assert summary.groups([("a", "applied", "")], ["a"], "doctor --all")[0] == "summary: 1 patch: 1 applied"
    assert summary.short_target("vllm_ascend.patch.worker:__file__") == "vllm_ascend.patch.worker (import trigger)"
    assert summary.site("triggered by vllm_ascend.patch.worker:__file__") == (
        "triggered by the import of vllm_ascend.patch.worker"
    )


def test_doctor_all_names_every_patch_without_pointing_at_all(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    records = [{"name": f"fam.p{i}", "state": "applied", "target": "m:T.f", "reason": "applied"} for i in range(40)]
    data = {"status": "active", "reason": "activated by doctor", "device": "npu (forced)", "pid": 3, "warnings": []}
    data.update(records=records, stderr="", import_errors={})
    doctor.print_doctor(data, full=True)
    out = capsys.readouterr().out
    assert "--all" not in out
    assert out.splitlines()[:2] == [
        "verl-npu-autopatch 0.1.0: device npu (forced)",
        "engine active: activated by doctor (pid 3)",
    ]


def test_status_gives_one_label_to_the_missing_npu_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli.environment, "device_decision", lambda config: ("none", "no NPU stack: ..."))
    monkeypatch.setattr(decision.environment, "npu_stack_installed", lambda: False)
    plans = cli.status_data()["patches"]
    assert not [p for p in plans if p["reason"] == cli.NPU_STACK_GATE]
    assert {p["reason"] for p in plans if p["state"] == "inactive"} == {"no NPU stack: ..."}


def test_the_npu_stack_gate_is_the_pipelines() -> None:
    fix = lambda site: lambda: None  # noqa: E731
    patch = Patch("a.b", "s", (Target.parse("m:T.f"),), fix, device="npu-stack")
    if not decision.environment.npu_stack_installed():
        assert decision.plan(patch, Config()).reason == cli.NPU_STACK_GATE


def test_status_says_what_the_switched_off_hook_does() -> None:
    data = {"configuration": {"enabled": False}, "observer_installed": True, "observer": "placeholder"}
    assert cli.hook_state(data).startswith("in place but idle: VERL_NPU_AUTOPATCH is off")
    data["configuration"]["enabled"] = True
    assert cli.hook_state(data) == "in place (placeholder)"


# ----------------------------------------------------------------------------- 12: help
def test_every_command_has_a_description_exit_codes_and_variables(capsys: Any) -> None:
    for command in ("status", "list", "doctor", "bug-report"):
        with pytest.raises(SystemExit) as done:
            cli.main([command, "--help"])
        out = capsys.readouterr().out
        assert done.value.code == 0
        assert help_text.COMMANDS[command][0].split()[0] in out and "exit codes:" in out
        assert all(name in out for name in VARIABLES) and "--json" in out
        assert help_text.JSON_HELP.split(":")[0] in out.replace("\n", " ").replace("  ", " ") or command == "x"
    assert set(help_text.VARIABLE_HELP) == set(VARIABLES)


def test_the_bare_command_prints_the_help(capsys: Any) -> None:
    assert cli.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "exit codes:" in captured.err and "bug-report" in captured.err
    assert "error:" not in captured.err


def test_conflicting_list_flags_are_refused(capsys: Any) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["list", "--json", "--markdown"])
    assert done.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_doctor_runtime_env_must_be_a_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    for value, said in (("[1]", "must be a JSON object"), ("{", "not valid JSON")):
        with pytest.raises(SystemExit) as exit_:
            cli.build_parser().parse_args(["doctor", "--ray", "--runtime-env", value])
        assert exit_.value.code == 2 and f"argument --runtime-env: {said}" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["doctor", "--ray", "--runtime-env", '{"pip": []}']).runtime_env == {"pip": []}
