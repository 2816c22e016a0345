"""``verl-npu-autopatch doctor``: run the doctor child (:mod:`verl_npu_autopatch._doctor_child`) in
a fresh interpreter of this environment, read its report, print it and choose the exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from verl_npu_autopatch import _summary
from verl_npu_autopatch._doctor_child import DOCTOR_MARK, STEP_MARK
from verl_npu_autopatch._text import printable

#: Seconds the doctor child may run (a cold vLLM import takes about a minute on a slow disk).
DOCTOR_TIMEOUT_S = 600.0

#: ``doctor`` exit codes: all well / a patch failed / the child crashed or activation failed /
#: the child did not finish within ``--timeout`` / ``--verify`` found a kernel that disagrees with
#: upstream (or could not run it).
OK, PATCH_FAILED, CRASHED, TIMED_OUT, MISMATCH = 0, 1, 2, 3, 4

#: The command line of the doctor child, after the interpreter.
CHILD = ("-m", "verl_npu_autopatch._doctor_child")


def run_doctor(device: str | None, timeout: float = DOCTOR_TIMEOUT_S, verify: bool = False) -> dict[str, Any]:
    """Run the doctor child: a fresh interpreter of this environment imports every target (and
    with ``verify`` checks the kernels against upstream). It runs in its own session, so a timeout
    ends it and anything it started there; what it leaves behind elsewhere (a grandchild in a
    session of its own holding the pipe) is waited for :data:`GRACE_S` at most. Its output is
    UTF-8 whatever the locale."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    if device:
        env["VERL_NPU_AUTOPATCH_DEVICE"] = device
    proc = subprocess.Popen(
        [sys.executable, *CHILD, *(["--verify"] if verify else [])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        encoding="utf-8",
        errors="replace",
        start_new_session=True,
    )
    try:
        stdout, stderr = _communicate(proc, timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _end(proc)
        steps = [line.split(STEP_MARK, 1)[1] for line in stdout.splitlines() if STEP_MARK in line]
        running = steps[-1] if steps else "interpreter start-up"
        return {
            "status": "timed-out",
            "reason": f"the doctor child did not finish within {timeout:g} s; still running: {running}",
            "running": running,
            "stderr": stderr,
        }
    if DOCTOR_MARK not in stdout:
        return {"status": "crashed", "reason": f"doctor child exited {proc.returncode}", "stderr": stderr}
    data = json.loads(stdout.rsplit(DOCTOR_MARK, 1)[1])
    data["stderr"] = stderr
    return data


#: Seconds ``doctor`` still reads the child's pipes once it killed it (a process it left behind in
#: another session may hold them open for good).
GRACE_S = 2.0


def _communicate(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """The child's output once it exited, within ``timeout`` (``TimeoutExpired`` otherwise). A child
    that exited while a process it left behind holds the pipes open is not waited for: what it
    wrote is read for :data:`GRACE_S` more."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return proc.communicate(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:  # retried: communicate() loses no output
            if proc.poll() is not None:
                return _end(proc)
            if time.monotonic() >= deadline:
                raise


def _end(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Kill the child and its process group (if still there); what it wrote, read for :data:`GRACE_S` at most."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # no such process group (already gone): kill the child alone
        proc.kill()
    try:
        return proc.communicate(timeout=GRACE_S)
    except subprocess.TimeoutExpired as late:  # the pipe is held elsewhere: go on with what was read
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()
        return _text(late.stdout), _text(late.stderr)


def _text(data: str | bytes | None) -> str:
    """Output a ``TimeoutExpired`` carried (bytes before Python decodes it)."""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data or ""


def doctor_exit_code(data: dict[str, Any]) -> int:
    """``doctor``'s exit code for the child's report (strict: ``unsupported`` fails too)."""
    if data["status"] == "timed-out":
        return TIMED_OUT
    if data["status"] in ("crashed", "failed"):
        return CRASHED
    bad = ("failed", "superseded", "unsupported") if data.get("strict") else ("failed", "superseded")
    if any(r["state"] in bad for r in data["records"]):
        return PATCH_FAILED
    return MISMATCH if "verify" in data and not data["verify"]["ok"] else OK


#: Record states ``doctor`` lists under "needs attention", with their reasons.
ATTENTION = ("failed", "superseded", "unsupported")


def doctor_attention(data: dict[str, Any]) -> list[str]:
    """What ``doctor`` asks the reader to look at: warnings, records that failed, were superseded
    or found unsupported code, target modules that raised on import."""
    items = [f"WARNING: {text}" for text in data["warnings"]]
    items += [f"{r['state']}: {r['name']}: {r['reason']}" for r in data["records"] if r["state"] in ATTENTION]
    items += [f"could not import {module}: {error}" for module, error in data.get("import_errors", {}).items()]
    return items


def print_doctor(data: dict[str, Any], full: bool = False) -> None:
    """The report as ``doctor`` prints it, fitting 120 columns (tracebacks aside): the engine
    line, the summary and what needs attention (``full``: every record), the verification, what
    went wrong. Every line is escaped (``_summary.show``): reasons and the log are foreign text."""
    show = _summary.show
    if data["status"] == "timed-out":
        show(f"doctor: TIMED OUT: {data['reason']}\n{data['stderr']}")
        return
    if data["status"] == "crashed":
        show(f"doctor: the child interpreter crashed ({data['reason']})\n{data['stderr']}")
        return
    _summary.say(f"engine: {data['status']} ({data['reason']}); device: {data['device']}; pid {data['pid']}")
    if data["status"] == "inactive" and data["reason"].startswith("switched off"):
        show("patching is switched off in this environment: unset VERL_NPU_AUTOPATCH (or set it to 1) to turn it on")
    elif data["status"] == "inactive" and not data["records"]:
        show("nothing is patched on this host; `verl-npu-autopatch doctor --device npu` is a dry run of an NPU host")
    records = data["records"]
    if records:
        names = [r["name"] for r in records]
        rows = ((r["name"], r["state"], r["reason"]) for r in records)
        show("\n".join(_summary.groups(rows, names, "doctor --all")))
    show("\n".join(_summary.attention(doctor_attention(data))))
    if records and full:
        full_rows = [(r["name"], r["state"], r["target"], r["reason"]) for r in records]
        show("\n" + "\n".join(_summary.records_list(full_rows)))
    elif records:
        show("every patch with its target and reason: verl-npu-autopatch doctor --all")
    if "verify" in data:
        from verl_npu_autopatch.verify import render

        show("\n" + "\n".join(render(data["verify"])))
    superseded = [r["name"] for r in records if r["state"] == "superseded"]
    if superseded:
        show()
        _summary.say(
            f"SUPERSEDED: {', '.join(superseded)}: the fix was installed, but something else runs there now "
            "(needs attention names it; see docs/troubleshooting.md, Record states)"
        )
    failed = [r["name"] for r in records if r["state"] == "failed"]
    if failed:
        show(f"\nFAILED: {', '.join(failed)} (tracebacks follow)\n{first_screen(data['stderr'], full)}")
    elif data["status"] == "failed":
        show(f"\n{first_screen(data['stderr'], full)}")


#: Lines of the child's log (tracebacks) ``doctor`` shows without ``--all``.
LOG_LINES = 20


def first_screen(log: str, full: bool) -> str:
    """The child's log: in full with ``full``, else its first :data:`LOG_LINES` lines, each cut
    to the width, and how to see the rest."""
    lines = [printable(line) for line in log.rstrip("\n").split("\n")] if log else []
    if full or (len(lines) <= LOG_LINES and all(len(line) <= _summary.WIDTH for line in lines)):
        return "\n".join(lines) + "\n" if lines else log
    shown = [line if len(line) <= _summary.WIDTH else line[: _summary.WIDTH - 3] + "..." for line in lines[:LOG_LINES]]
    more = f"{len(lines) - len(shown)} more lines" if len(lines) > len(shown) else "long lines cut"
    return "\n".join([*shown, f"... ({more}; the whole log: verl-npu-autopatch doctor --all)"]) + "\n"
