"""The ``doctor`` child: run by :func:`verl_npu_autopatch.cli.doctor.run_doctor` in a fresh interpreter
of the environment as ``python -m verl_npu_autopatch.cli.doctor_child``.

It activates the engine, imports every target that can be imported, settles the records and prints
the report as JSON after :data:`DOCTOR_MARK`; with ``--verify`` the report also holds what
:func:`verl_npu_autopatch.cli.verify.run` found (patched against upstream kernels on tiny inputs).
Before each step it prints a progress line after :data:`STEP_MARK`, so a parent that times out
can say what was still running. Nothing of the package beyond this module is imported before the
first step is announced. Once the report is written and flushed, the child ends itself
(:func:`end`): a target may have left a non-daemon thread the interpreter would wait for at exit.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

DOCTOR_MARK = "@@verl-npu-autopatch-doctor@@"
STEP_MARK = "@@verl-npu-autopatch-step@@"
#: Before the first import: how many targets there are to import (the parent's progress line).
COUNT_MARK = "@@verl-npu-autopatch-targets@@"


def step(what: str) -> None:
    """Announce the step about to run (flushed: the parent may kill us in the middle of it)."""
    sys.stdout.write("\n" + STEP_MARK + what + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    """Activate, import every pending target, print the report (``--verify``: and verify)."""
    verifying = "--verify" in (sys.argv[1:] if argv is None else argv)
    step("activation (loading the catalog and the plugins)")
    from verl_npu_autopatch.engine.config import read_config
    from verl_npu_autopatch.engine.lifecycle import activate, engine, report
    from verl_npu_autopatch.engine.text import describe

    activate("doctor")
    eng = engine()
    absent: set[str] = set()
    errors: dict[str, str] = {}
    modules = eng.pending_modules()
    sys.stdout.write(f"\n{COUNT_MARK}{len(modules)}\n")
    for module in modules:
        step("import " + module)
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                absent.add(module)
            else:
                errors[module] = describe(exc)
        except Exception as exc:
            errors[module] = describe(exc)
    step("settling the records")
    eng.settle(absent)
    data = report().to_dict()
    data["import_errors"] = errors
    data["strict"] = read_config().strict
    if verifying:
        step("verifying the kernels against upstream")
        from verl_npu_autopatch.cli import verify

        try:
            data["verify"] = verify.run(data["records"])
        except Exception as exc:  # a bug of the verification itself: reported, the records still are
            data["verify"] = {**verify.absent(), "ok": False, "error": describe(exc)}
    sys.stdout.write("\n" + DOCTOR_MARK + json.dumps(data))


def end(code: int) -> None:
    """Flush what was written and end the process at once with ``code``, whatever threads the
    targets left running (``sys.exit`` would join every non-daemon one first, for good)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more can be said through it
            pass
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:  # an explicit exit code (or message) is kept as sys.exit would
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            sys.stderr.write(f"{stop.code}\n")
        end(code)
    except BaseException:  # the traceback as the interpreter would print it, then the same exit code
        sys.excepthook(*sys.exc_info())
        end(1)
    end(0)
