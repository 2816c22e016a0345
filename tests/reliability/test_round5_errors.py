"""Round 5, errors that cannot be printed and what the CLI prints, in real child interpreters
(Python 3.11 venvs with the built wheel and the fixture packages): a fix, check, undo or plugin
raising an exception whose ``__str__`` raises, a 219 kB message or one holding terminal escape
sequences (``AUTOPATCH_FIXTURE_ERROR``); a target that leaves a non-daemon thread behind
(``doctor``); names in any case and with any separator."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.reliability.test_faults import NPU, STRICT, assert_silent_startup, doctor
from tests.support.children import FIXTURE_SITE, clean_env
from verl_npu_autopatch.engine.text import REASON_CHARS

#: Imports the fixture target, reverts everything, and says what happened (also when the import raised).
IMPORT_AND_REVERT = """
import json, sys
out = {}
try:
    import vllm.model
    out.update(imported=True, forward=vllm.model.Layer().forward(1))
except Exception as exc:
    out.update(imported=False, error=type(exc).__name__)
import verl_npu_autopatch
out["reverted"] = verl_npu_autopatch.revert() if "revert" in sys.argv else None
r = verl_npu_autopatch.report()
out.update(status=r.status, records={x.name: [x.state, x.reason] for x in r.records})
print(json.dumps(out))
"""

#: What an unprintable exception's reason stands in for it with.
STAND_IN = "<unprintable Unprintable object>"

#: The fixture's escape-sequence message, as raw text (kept in records) and as shown on a screen.
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[8mhidden\u202egnp.exe"
ESCAPES_SHOWN = "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[8mhidden\\u202egnp.exe"

#: (fault, its knob, the record it shows in)
FAULTS = [
    ("fix", {"AUTOPATCH_FIXTURE_BROKEN": "1"}, "fixture.broken"),
    ("check", {"AUTOPATCH_FIXTURE_CHECK": "raise"}, "fixture.other"),
    ("load", {"AUTOPATCH_FIXTURE_LOAD": "raise"}, "entry-point:fixtures"),
]


def seen(python: Path, env: dict[str, str], *argv: str) -> tuple[dict, str]:
    """What :data:`IMPORT_AND_REVERT` saw (``argv``: ``revert``), and the child's stderr."""
    proc = subprocess.run(
        [str(python), "-c", IMPORT_AND_REVERT, *argv],
        env=clean_env(PYTHONPATH=str(FIXTURE_SITE), **env),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def cli(python: Path, env: dict[str, str], *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "verl_npu_autopatch", *argv],
        env=clean_env(PYTHONPATH=str(FIXTURE_SITE), **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# ----------------------------------------------------------------------------- 17, 18: unprintable
@pytest.mark.parametrize(("fault", "env", "record"), FAULTS, ids=[f[0] for f in FAULTS])
def test_unprintable_exception_is_a_failed_record(base_python: Path, fault: str, env: dict, record: str) -> None:
    env = {**NPU, **env, "AUTOPATCH_FIXTURE_ERROR": "unprintable"}
    assert_silent_startup(base_python, env)
    found, stderr = seen(base_python, env)
    assert found["imported"] is True and found["status"] == "active"
    state, reason = found["records"][record]
    assert state == "failed" and STAND_IN in reason, reason
    assert "--- Logging error ---" not in stderr
    if fault == "load":  # the plugin is its record; the built-in patches are planned as ever
        assert [name for name in found["records"] if name.startswith("fixture.")] == []
        assert len(found["records"]) > 1


@pytest.mark.parametrize(("fault", "env", "record"), FAULTS, ids=[f[0] for f in FAULTS])
def test_unprintable_exception_strict_raises_patch_error(base_python: Path, fault: str, env: dict, record: str) -> None:
    env = {**NPU, **env, **STRICT, "AUTOPATCH_FIXTURE_ERROR": "unprintable"}
    found, _ = seen(base_python, env)
    assert (found["imported"], found["error"]) == (False, "PatchError")
    assert found["records"][record][0] == "failed"


def test_unprintable_undo_is_a_failed_revert(base_python: Path) -> None:
    env = {**NPU, "AUTOPATCH_FIXTURE_UNDO": "raise", "AUTOPATCH_FIXTURE_ERROR": "unprintable"}
    found, stderr = seen(base_python, env, "revert")
    assert found["imported"] is True and found["forward"] == 12
    state, reason = found["records"]["fixture.forward"]
    assert state == "failed" and reason == f"revert raised Unprintable: {STAND_IN}"
    assert "fixture.forward" not in found["reverted"] and "fixture.trigger" in found["reverted"]
    assert "--- Logging error ---" not in stderr


def test_plugin_load_unprintable_status_has_no_traceback(base_python: Path) -> None:
    env = {**NPU, "AUTOPATCH_FIXTURE_LOAD": "raise", "AUTOPATCH_FIXTURE_ERROR": "unprintable"}
    proc = cli(base_python, env, "status")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert "plugin entry-point:fixtures failed to load: loading autopatch_test_plugin:patches" in proc.stdout
    assert STAND_IN in proc.stdout
    data = json.loads(cli(base_python, env, "status", "--json").stdout)
    assert [e["name"] for e in data["load_errors"]] == ["entry-point:fixtures"]


# ----------------------------------------------------------------------------- 8: megabytes
def test_huge_message_is_bounded_in_the_record(base_python: Path) -> None:
    env = {**NPU, "AUTOPATCH_FIXTURE_BROKEN": "1", "AUTOPATCH_FIXTURE_ERROR": "huge"}
    found, _ = seen(base_python, env)
    state, reason = found["records"]["fixture.broken"]
    assert found["imported"] is True and state == "failed"
    assert reason.startswith("fix raised RuntimeError: line 0: yyy") and len(reason) <= REASON_CHARS + 100


def test_huge_message_doctor_first_screen_is_short(base_python: Path) -> None:
    env = {**NPU, "AUTOPATCH_FIXTURE_BROKEN": "1", "AUTOPATCH_FIXTURE_ERROR": "huge"}
    code, out = doctor(base_python, env)
    lines = out.splitlines()
    assert code == 1 and "fixture.broken" in out
    assert len(lines) < 100, len(lines)  # not the 2,500 lines of the log (each opt-in group: a block of its own)
    assert max(map(len, lines)) <= 120
    data = json.loads(doctor(base_python, env, "--json")[1])
    reason = next(r["reason"] for r in data["records"] if r["name"] == "fixture.broken")
    assert 1000 < len(reason) <= REASON_CHARS + 100


# ----------------------------------------------------------------------------- 9: escape sequences
def test_escape_sequences_are_escaped_by_doctor_and_status(base_python: Path) -> None:
    env = {**NPU, "AUTOPATCH_FIXTURE_BROKEN": "1", "AUTOPATCH_FIXTURE_ERROR": "escape"}
    found, _ = seen(base_python, env)
    assert found["records"]["fixture.broken"] == ["failed", f"fix raised RuntimeError: {ESCAPES}"]
    for argv in (("doctor",), ("doctor", "--all")):
        out = cli(base_python, env, *argv).stdout
        assert ESCAPES_SHOWN in out and "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    data = json.loads(cli(base_python, env, "doctor", "--json").stdout)  # JSON escapes it; the text is whole
    assert next(r["reason"] for r in data["records"] if r["name"] == "fixture.broken").endswith(ESCAPES)
    loading = {**NPU, "AUTOPATCH_FIXTURE_LOAD": "raise", "AUTOPATCH_FIXTURE_ERROR": "escape"}
    for argv in (("status",), ("status", "--all")):
        proc = cli(base_python, loading, *argv)
        assert proc.returncode == 0 and ESCAPES_SHOWN in proc.stdout and "\x1b" not in proc.stdout


# ----------------------------------------------------------------------------- 19: threads left behind
def test_doctor_child_ends_despite_a_non_daemon_thread(base_python: Path) -> None:
    env = {**NPU, "AUTOPATCH_FIXTURE_THREAD": "1"}
    proc = cli(base_python, env, "doctor", "--timeout", "30")
    assert "TIMED OUT" not in proc.stdout, proc.stdout
    assert proc.returncode == 0, proc.stdout
    assert "engine active" in proc.stdout and "applied" in proc.stdout
    data = json.loads(cli(base_python, env, "doctor", "--json", "--timeout", "30").stdout)
    assert next(r["state"] for r in data["records"] if r["name"] == "fixture.thread") == "applied"


# ----------------------------------------------------------------------------- 20, 21: names
@pytest.mark.parametrize(
    ("variable", "value", "on", "off"),
    [
        ("VERL_NPU_AUTOPATCH_ENABLE", "GLM52", ["fixture.glm"], []),
        ("VERL_NPU_AUTOPATCH_ENABLE", "Extra\nGLM52", ["fixture.glm", "fixture.optin"], []),
        ("VERL_NPU_AUTOPATCH_DISABLE", "FIXTURE", [], ["fixture.forward", "fixture.early"]),
        ("VERL_NPU_AUTOPATCH_DISABLE", "Fixture.Forward fixture.EARLY", [], ["fixture.forward", "fixture.early"]),
    ],
    ids=["enable-upper", "enable-lines", "disable-upper", "disable-spaces"],
)
def test_names_in_any_case_and_separator(
    base_python: Path, variable: str, value: str, on: list[str], off: list[str]
) -> None:
    env = {**NPU, variable: value}
    found, stderr = seen(base_python, env)
    assert found["imported"] is True and "unknown patch or group" not in stderr, stderr
    for name in on:
        assert found["records"][name][0] == "applied", found["records"][name]
    for name in off:
        assert found["records"][name] == ["disabled", "turned off by VERL_NPU_AUTOPATCH_DISABLE"]


def test_entry_point_disabled_in_any_case_is_not_imported(base_python: Path) -> None:
    env = {**NPU, "VERL_NPU_AUTOPATCH_DISABLE": "ENTRY-POINT:Fixtures", "AUTOPATCH_FIXTURE_LOAD": "raise"}
    found, _ = seen(base_python, env)
    assert found["records"]["entry-point:fixtures"][0] == "disabled"
