"""``fleet``'s command line: ``--ray [ADDRESS] DIR`` as documented, the report directory variable
when no DIR is named, flags that conflict refused, the help, and the hint for nodes without the
package (the Ray side stubbed; against a real cluster: ``tests/ray/test_fleet_ray.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from verl_npu_autopatch.cli import fleet_ray, fleet_view
from verl_npu_autopatch.cli import main as cli

CLUSTER = {"address": "10.0.0.1:6379", "session": "session_1", "found_by": "RAY_ADDRESS", "others": []}


def parse(*argv: str) -> Any:
    return cli.build_parser().parse_args(["fleet", *argv])


def test_ray_takes_an_address_only_when_it_looks_like_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job").mkdir()
    (tmp_path / "head:6379").mkdir()  # a directory that looks like an address: a directory
    cases = {
        ("--ray", "job"): ("auto", ["job"]),
        ("--ray", "~/autopatch/JOB"): ("auto", ["~/autopatch/JOB"]),  # node-local, absent here: still a DIR
        ("--ray", "JOB42"): ("auto", ["JOB42"]),
        ("--ray", "head:6379"): ("auto", ["head:6379"]),
        ("--ray", "10.0.0.1:6379", "job"): ("10.0.0.1:6379", ["job"]),
        ("--ray", "head.example:6379", "job"): ("head.example:6379", ["job"]),
        ("--ray", "ray://head:10001", "job"): ("ray://head:10001", ["job"]),
        ("--ray", "[fe80::1]:6379", "job"): ("[fe80::1]:6379", ["job"]),
        ("--ray", "auto", "job"): ("auto", ["job"]),
        ("job", "--ray"): ("auto", ["job"]),
        ("--ray",): ("auto", []),
        ("job", "other"): (None, ["job", "other"]),
    }
    for argv, (address, directories) in cases.items():
        args = parse(*argv)
        assert (args.ray, [*args.ray_directories, *args.directories]) == (address, directories), argv


def _gathered(
    monkeypatch: pytest.MonkeyPatch, read: dict[str, Any] | None = None, **extra: Any
) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []
    answer = read or {"processes": [], "stale": [], "unreadable": [], "without_package": []}

    def gather(*args: Any) -> dict[str, Any]:
        calls.append(args)
        return {**answer, "cluster": {**CLUSTER, **extra}}

    monkeypatch.setattr(fleet_ray, "gather", gather)
    return calls


def test_ray_dir_reads_dir_on_the_cluster_auto_finds_and_names_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _gathered(monkeypatch)
    assert cli.main(["fleet", "--ray", "/reports/job", "--timeout", "5"]) == 2  # nothing found: 2
    assert calls == [("auto", ["/reports/job"], 24 * 3600, 5.0, None)]
    words = " ".join(capsys.readouterr().out.split())  # the first line, wrapped at 120 columns
    assert words.startswith(
        "verl-npu-autopatch fleet: 0 live processes in /reports/job on every node of the Ray cluster at "
        "10.0.0.1:6379 (auto: RAY_ADDRESS), session session_1 no live process report found"
    )
    assert cli.main(["fleet", "--ray", "/reports/job", "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"] == CLUSTER and data["directories_from"] == "command line"


def test_nodes_without_the_package_are_named_with_how_to_ship_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    where = "node cdcdcdcd (10.0.0.2)"
    unreadable = [{"file": where, "error": "verl_npu_autopatch cannot be imported on this node (No module)"}]
    _gathered(monkeypatch, {"processes": [], "stale": [], "unreadable": unreadable, "without_package": [where]})
    assert cli.main(["fleet", "--ray", "10.0.0.1:6379", "/reports/job"]) == 2
    out = capsys.readouterr().out
    assert "verl-npu-autopatch is missing on 1 node(s): node cdcdcdcd (10.0.0.2)." in out
    assert """--runtime-env '{"pip": ["/path/to/verl_npu_autopatch-0.1.0-py3-none-any.whl"]}'""" in out
    assert "docs/installing.md" in out
    assert "is VERL_NPU_AUTOPATCH_REPORT_DIR set" not in out  # the cause is the package, not the variable


def test_no_dir_reads_the_report_directory_variable_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("VERL_NPU_AUTOPATCH_REPORT_DIR", str(tmp_path))
    assert cli.main(["fleet"]) == 2  # an empty directory: no live process
    words = " ".join(capsys.readouterr().out.split())  # the first line, wrapped at 120 columns
    assert words.startswith(
        f"verl-npu-autopatch fleet: 0 live processes in {tmp_path} (from $VERL_NPU_AUTOPATCH_REPORT_DIR) no live"
    )
    assert cli.main(["fleet", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["directories_from"] == "VERL_NPU_AUTOPATCH_REPORT_DIR"
    monkeypatch.setenv("VERL_NPU_AUTOPATCH_REPORT_DIR", "relative/dir")
    assert cli.main(["fleet"]) == 2
    assert capsys.readouterr().out == (
        "fleet: name at least one DIR (the VERL_NPU_AUTOPATCH_REPORT_DIR of the job); "
        "VERL_NPU_AUTOPATCH_REPORT_DIR=relative/dir is not an absolute path (nor ~/...)\n"
    )
    monkeypatch.delenv("VERL_NPU_AUTOPATCH_REPORT_DIR")
    assert cli.main(["fleet"]) == 2
    assert "VERL_NPU_AUTOPATCH_REPORT_DIR is unset" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--json", "--all", "d"], "--json holds everything (the matrix, the stale files)"),
        (["--stale", "--json", "d"], "--json holds everything"),
        (["--timeout", "5", "d"], "--runtime-env and --timeout need --ray"),
        (["--runtime-env", "{}", "d"], "--runtime-env and --timeout need --ray"),
        (["--ray", "--runtime-env", "[1]", "d"], "argument --runtime-env: must be a JSON object"),
        (["--ray", "--runtime-env", "{", "d"], "argument --runtime-env: not valid JSON"),
        (["--ray", "--timeout", "0", "d"], "argument --timeout: expected a positive number of seconds"),
    ],
)
def test_conflicting_or_bad_flags_are_refused_by_argparse(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["fleet", *argv])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "usage: verl-npu-autopatch fleet" in captured.err and error in captured.err


def test_help_has_a_description_exit_codes_and_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["fleet", "--help"])
    text = capsys.readouterr().out
    for needle in (
        "What every live process of a job decided",
        "exit status:\n  0  no live process has a failed",
        "  2  no live process report found",
        "environment:\n  VERL_NPU_AUTOPATCH_REPORT_DIR  the DIR read when none is named",
        "RAY_ADDRESS",
        "--json               everything as one JSON object",
        "--ray [ADDRESS]: ADDRESS is host:port",
    ):
        assert needle in text, needle
    assert max(len(line) for line in fleet_view.EPILOG.splitlines() + fleet_view.DESCRIPTION.splitlines()) < 80


def test_fleet_json_carries_the_environment_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["fleet", str(tmp_path), "--json"]) == 2  # nothing to judge in an empty directory
    data = json.loads(capsys.readouterr().out)
    assert data["environment"]["verl_npu_autopatch"] and "packages" in data["environment"]
