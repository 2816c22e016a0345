"""``verl-npu-autopatch doctor``: run the doctor child (:mod:`verl_npu_autopatch.cli.doctor_child`) in
a fresh interpreter of this environment, read its report, print it and choose the exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from verl_npu_autopatch._version import __version__
from verl_npu_autopatch.cli import summary
from verl_npu_autopatch.cli.doctor_child import COUNT_MARK, DOCTOR_MARK, STEP_MARK
from verl_npu_autopatch.engine.text import printable

if TYPE_CHECKING:
    from collections.abc import Callable

#: Seconds the doctor child may run (a cold vLLM import takes about a minute on a slow disk).
DOCTOR_TIMEOUT_S = 600.0

#: ``doctor`` exit codes: all well / a patch failed / the child crashed or activation failed /
#: the child did not finish within ``--timeout`` / ``--verify`` found a kernel that disagrees with
#: upstream (or could not run it).
OK, PATCH_FAILED, CRASHED, TIMED_OUT, MISMATCH = 0, 1, 2, 3, 4

#: The command line of the doctor child, after the interpreter.
CHILD = ("-m", "verl_npu_autopatch.cli.doctor_child")

#: Variables the doctor child runs without: with ``VERL_NPU_AUTOPATCH_REPORT_DIR`` (set in a job's
#: shell) it would write its report into the job's directory, where ``fleet`` lists it.
CHILD_DROPS = ("VERL_NPU_AUTOPATCH_REPORT_DIR",)


def run_doctor(
    device: str | None,
    timeout: float = DOCTOR_TIMEOUT_S,
    verify: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the doctor child: a fresh interpreter of this environment (without :data:`CHILD_DROPS`)
    imports every target (and with ``verify`` checks the kernels against upstream). It runs in its
    own session, so a timeout ends it and anything it started there; what it leaves behind
    elsewhere (a grandchild in a session of its own holding the pipe) is waited for :data:`GRACE_S`
    at most. Its output is UTF-8 whatever the locale. ``progress`` is given what the child has
    written so far, a few times a second while it runs."""
    env = {**{k: v for k, v in os.environ.items() if k not in CHILD_DROPS}, "PYTHONIOENCODING": "utf-8"}
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
        stdout, stderr = _communicate(proc, timeout, progress)
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


def _communicate(
    proc: subprocess.Popen[str], timeout: float, progress: Callable[[str], None] | None = None
) -> tuple[str, str]:
    """The child's output once it exited, within ``timeout`` (``TimeoutExpired`` otherwise). A child
    that exited while a process it left behind holds the pipes open is not waited for: what it
    wrote is read for :data:`GRACE_S` more. ``progress`` sees the output so far at each poll."""
    deadline = time.monotonic() + timeout
    poll = 0.25 if progress else 1.0
    while True:
        try:
            return proc.communicate(timeout=max(0.0, min(poll, deadline - time.monotonic())))
        except subprocess.TimeoutExpired as waiting:  # retried: communicate() loses no output
            if progress is not None:
                progress(_text(waiting.stdout))
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
    """The report as ``doctor`` prints it, fitting the terminal (``summary.width``): the version and
    the engine, the summary and what needs attention (``full``: every record), the verification,
    what went wrong. Every line is escaped (``summary.show``): reasons and the log are foreign text."""
    show, columns = summary.show, summary.width()
    version = f"verl-npu-autopatch {data.get('environment', {}).get('verl_npu_autopatch', __version__)}"
    if data["status"] in ("timed-out", "crashed"):
        what = "TIMED OUT" if data["status"] == "timed-out" else "the child interpreter crashed"
        summary.say(f"{version}: doctor: {what}")
        summary.say(data["reason"])
        show(first_screen(data["stderr"], full), end="")
        return
    summary.say(f"{version}: device {data['device']}")
    summary.say(f"engine {data['status']}: {data['reason']} (pid {data['pid']})")
    if data["status"] == "inactive" and data["reason"].startswith("switched off"):
        summary.say(
            "patching is switched off in this environment: unset VERL_NPU_AUTOPATCH (or set it to 1) to turn it on"
        )
    elif data["status"] == "inactive" and not data["records"]:
        summary.say(
            "nothing is patched on this host; `verl-npu-autopatch doctor --device npu` is a dry run of an NPU host"
        )
    records = data["records"]
    if records:
        names = [r["name"] for r in records]
        rows = ((r["name"], r["state"], r["reason"]) for r in records)
        show("\n".join(summary.groups(rows, names, "" if full else "doctor --all")))
    show("\n".join(summary.attention(doctor_attention(data))))
    if records and full:
        full_rows = [(r["name"], r["state"], r["target"], r["reason"]) for r in records]
        show("\n" + "\n".join(summary.records_list(full_rows)))
    elif records:
        show("every patch with its target and reason: verl-npu-autopatch doctor --all")
    if "verify" in data:
        from verl_npu_autopatch.cli.verify import render

        lines = render(data["verify"], columns)  # its table is as wide as its cells: wrapped here
        show("\n" + "\n".join(part for line in lines for part in summary.fold(line, columns)))
    superseded = [r["name"] for r in records if r["state"] == "superseded"]
    if superseded:
        show()
        summary.say(
            f"SUPERSEDED: {', '.join(superseded)}: the fix was installed, but something else runs there now "
            "(needs attention names it; see docs/troubleshooting.md, Record states)"
        )
    failed = [r["name"] for r in records if r["state"] == "failed"]
    if failed:
        show()
        summary.say(f"FAILED: {', '.join(failed)} (tracebacks follow)")
        show(first_screen(data["stderr"], full), end="")
    elif data["status"] == "failed":
        show(f"\n{first_screen(data['stderr'], full)}", end="")


#: Lines of the child's log (tracebacks) ``doctor`` shows without ``--all``.
LOG_LINES = 20


def first_screen(log: str, full: bool) -> str:
    """The child's log, each line escaped and no wider than the terminal: in full with ``full``
    (long lines folded onto the next), else its first :data:`LOG_LINES` lines, each cut, and how
    to see the rest."""
    columns = summary.width()
    lines = [printable(line) for line in log.rstrip("\n").split("\n")] if log else []
    if full or (len(lines) <= LOG_LINES and all(len(line) <= columns for line in lines)):
        return "".join(part + "\n" for line in lines for part in summary.fold(line, columns))
    shown = [line if len(line) <= columns else line[: columns - 3] + "..." for line in lines[:LOG_LINES]]
    more = summary.count(len(lines) - len(shown), "more line") if len(lines) > len(shown) else "long lines cut"
    return "\n".join([*shown, f"... ({more}; the whole log: verl-npu-autopatch doctor --all)"]) + "\n"


def add_warnings(data: dict[str, Any]) -> None:
    """Add to the child's report what only the command line checks: variables set in this
    environment that look meant for the package but are not read (``config.unknown_variables``)."""
    from verl_npu_autopatch.engine.config import variable_warnings

    if "warnings" in data:
        data["warnings"] = [*data["warnings"], *variable_warnings()]


class Progress(summary.StatusLine):
    """``doctor``'s progress on a terminal's stderr: once the child has run
    :data:`~.summary.PROGRESS_AFTER_S`, one line rewritten in place (the targets imported so far
    out of all, the step running), erased by :meth:`~.summary.StatusLine.clear`."""

    def __call__(self, output: str) -> None:
        elapsed = self.due()
        if elapsed is None:
            return
        steps = [line.split(STEP_MARK, 1)[1] for line in output.splitlines() if STEP_MARK in line]
        counts = [line.split(COUNT_MARK, 1)[1] for line in output.splitlines() if COUNT_MARK in line]
        running = steps[-1] if steps else "interpreter start-up"
        imported = sum(s.startswith("import ") for s in steps) - running.startswith("import ")
        done = f"targets imported {imported}/{counts[-1].strip()}, " if counts else ""
        self.write(summary.one_line(f"doctor: {done}{elapsed:.0f} s; now: {running}", summary.width() - 1))


def progress_for(stream: Any) -> Progress | None:
    """A :class:`Progress` on ``stream`` if it is a terminal, else ``None``."""
    try:
        return Progress(stream) if stream.isatty() else None
    except (AttributeError, ValueError, OSError):  # no stream, or a closed one: no progress line
        return None


def main(args: Any, environment: Callable[[], dict[str, Any]]) -> int:
    """``verl-npu-autopatch doctor`` (without ``--ray``): run the child, print its report or its JSON
    (with the block ``environment()`` makes), and return the exit code. Progress on stderr, on a
    terminal only."""
    import json

    progress = None if args.json else progress_for(sys.stderr)
    timeout = DOCTOR_TIMEOUT_S if args.timeout is None else args.timeout
    try:
        data = run_doctor(args.device, timeout, verify=args.verify, progress=progress)
    finally:
        if progress is not None:
            progress.clear()
    add_warnings(data)
    data["environment"] = environment()
    print(json.dumps(data, indent=2)) if args.json else print_doctor(data, full=args.all)
    return doctor_exit_code(data)
