"""Round 5, in process: exceptions that cannot be printed met by the pipeline, the engine and the
catalog; ENABLE/DISABLE names in any case and separator; what ``status``, ``list``, ``doctor`` and
``doctor --ray`` print (control characters escaped, long reasons cut on screens). The same cases
in real child interpreters: tests/reliability/test_round5_errors.py."""

from __future__ import annotations

import types
from argparse import Namespace
from typing import Any

import pytest

from tests.unit.test_pipeline import decide, module, patch_on  # noqa: F401  (module: a fixture)
from verl_npu_autopatch.authoring.spec import Patch, Target
from verl_npu_autopatch.cli import doctor, ray_doctor
from verl_npu_autopatch.cli import main as cli
from verl_npu_autopatch.cli.summary import table
from verl_npu_autopatch.engine import catalog, decision
from verl_npu_autopatch.engine.config import Config, read_config
from verl_npu_autopatch.engine.lifecycle import Engine
from verl_npu_autopatch.engine.text import REASON_CHARS


class Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("cannot be printed")

    __repr__ = __str__


ESCAPES = "\x1b]0;pwned\x07\x1b[2J\u202egnp"
ESCAPED = "\\x1b]0;pwned\\x07\\x1b[2J\\u202egnp"


def raising(exc: BaseException):
    def fix(site):
        raise exc

    return fix


# ----------------------------------------------------------------------------- exceptions
def test_a_fix_raising_an_unprintable_exception_is_a_failed_outcome(module: types.ModuleType) -> None:  # noqa: F811
    patch = patch_on(f"{module.__name__}:Layer.forward")
    patch = Patch(patch.name, patch.summary, patch.targets, raising(Unprintable()), device="any")
    outcome = decide(patch, module)
    assert (outcome.state, outcome.reason) == ("failed", "fix raised Unprintable: <unprintable Unprintable object>")


def test_the_engine_records_an_unprintable_or_huge_fix_error_bounded(module_name: str) -> None:
    __import__(module_name)
    patches = [
        Patch("u.one", "s", (Target.parse(f"{module_name}:Box.value"),), raising(Unprintable()), device="any"),
        Patch("u.two", "s", (Target.parse(f"{module_name}:Box"),), raising(RuntimeError("y" * 219_000)), device="any"),
    ]
    engine = Engine(patches, Config(device="npu"))
    engine.activate()
    engine.settle()
    records = engine.report()
    assert records["u.one"].state == "failed" and "<unprintable Unprintable object>" in records["u.one"].reason
    assert records["u.two"].state == "failed" and len(records["u.two"].reason) <= REASON_CHARS + 100


def test_a_plugin_load_raising_an_unprintable_exception_is_its_record(monkeypatch: pytest.MonkeyPatch) -> None:
    class Point:
        name, value, group = "broken", "broken_plugin:patches", catalog.ENTRY_POINT_GROUP

        def load(self) -> Any:
            raise Unprintable()

    monkeypatch.setattr(catalog, "_entry_points", lambda found: [("broken-plugin", [Point()])])
    found = catalog.plugins()
    assert [(name, error) for name, error, _ in found.errors] == [
        (
            "entry-point:broken",
            "loading broken_plugin:patches (distribution broken-plugin) raised Unprintable: "
            "<unprintable Unprintable object>",
        )
    ]


# ----------------------------------------------------------------------------- names
def test_lists_split_on_commas_spaces_and_newlines() -> None:
    config = read_config(
        {"VERL_NPU_AUTOPATCH_ENABLE": "glm52 dsv4", "VERL_NPU_AUTOPATCH_DISABLE": "a\nb,\n  c\tfixture.x\n"}
    )
    assert config.enable == {"glm52", "dsv4"} and config.disable == {"a", "b", "c", "fixture.x"}


def test_names_match_patches_and_groups_in_any_case(module: types.ModuleType) -> None:  # noqa: F811
    patch = patch_on(f"{module.__name__}:Layer.forward", groups=("glm52",), default=False)
    assert decision.plan(patch, Config(device="npu")).state == "disabled"
    assert decision.plan(patch, Config(device="npu", enable=frozenset({"GLM52"}))).state == "pending"
    off = Config(device="npu", enable=frozenset({"glm52"}), disable=frozenset({"PIPE.Test"}))
    assert decision.plan(patch, off).reason == "turned off by VERL_NPU_AUTOPATCH_DISABLE"


def test_unknown_names_ignore_case_and_suggest_in_any_case() -> None:
    config = Config(enable=frozenset({"GLM52", "GLM5"}), disable=frozenset({"Entry-Point:Fixtures"}))
    warnings = config.unknown_names({"glm52", "fixture", "entry-point:fixtures"})
    assert len(warnings) == 1 and "'GLM5'; did you mean 'glm52'?" in warnings[0]


# ----------------------------------------------------------------------------- screens
def test_table_and_wrap_escape_control_characters() -> None:
    text = table([["name", ESCAPES]], ["patch", "why"], width=120)
    assert ESCAPED in text and "\x1b" not in text and "\u202e" not in text


def test_status_escapes_the_report_dir_and_plugin_names(capsys: pytest.CaptureFixture[str]) -> None:
    data = cli.status_data()
    data["configuration"]["report_dir"] = f"/tmp/{ESCAPES}"
    error = f"loading raised {ESCAPES}" + "z" * (REASON_CHARS - 20)  # as bounded by _text.describe
    data["load_errors"] = [{"name": f"entry-point:{ESCAPES}", "error": error}]
    data["warnings"] = [f"warned {ESCAPES}"]
    for full in (False, True):
        cli.print_status(data, full=full)
        out = capsys.readouterr().out
        assert f"report_dir=/tmp/{ESCAPED}" in out and f"entry-point:{ESCAPED}" in out
        assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
        assert max(map(len, out.splitlines())) <= 120
        assert ("z" * 1900 in out.replace("\n", "").replace(" ", "")) is full  # cut on the first screen only


def test_list_escapes_a_plugins_summary(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    entry = {"name": "x", "groups": ["g"], "default": "on", "device": "any", "summary": ESCAPES}
    entry.update(requires=[], touches=[], reference="")
    monkeypatch.setattr(cli, "catalog_data", lambda: [entry])
    for argv in (["list"], ["list", "--markdown"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert ESCAPED in out and "\x1b" not in out


def test_doctor_escapes_and_cuts_what_it_prints(capsys: pytest.CaptureFixture[str]) -> None:
    huge = "\n".join(f"line {i}: " + "y" * 80 for i in range(2500))
    reason = f"fix raised RuntimeError: {ESCAPES} {huge}"[:REASON_CHARS]  # as bounded at record time
    record = {"name": f"fixture.{ESCAPES}", "state": "failed", "target": "m:T.f", "reason": reason}
    data = {"status": "active", "reason": "activated by doctor", "device": "npu", "pid": 1, "warnings": [ESCAPES]}
    data.update(records=[record], stderr=f"log {ESCAPES}\n", import_errors={"m": f"RuntimeError: {ESCAPES}"})
    for full in (False, True):
        doctor.print_doctor(data, full=full)
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert ESCAPED in out and "\x1b" not in out and "\x07" not in out and "\u202e" not in out
        assert max(map(len, lines)) <= 120
        assert len(lines) < 40 if not full else "line 20:" in out  # --all: the record as bounded
    for status in ("timed-out", "crashed"):
        doctor.print_doctor({"status": status, "reason": ESCAPES, "stderr": ESCAPES})
        assert "\x1b" not in capsys.readouterr().out


def test_ray_doctor_escapes_what_nodes_said(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ray_doctor, "probe_cluster", lambda *args: {"address": "x", "error": ESCAPES})
    args = Namespace(ray="auto", runtime_env=None, device=None, json=False, timeout=None)
    assert ray_doctor.main(args, "m:f") == ray_doctor.UNUSABLE
    out = capsys.readouterr().out
    assert ESCAPED in out and "\x1b" not in out
