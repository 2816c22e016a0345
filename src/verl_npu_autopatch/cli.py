"""Command line: ``verl-npu-autopatch status | list | doctor`` (also ``python -m verl_npu_autopatch``)."""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
from pathlib import Path
from typing import Any

from verl_npu_autopatch import _environment, _gates, _startup, catalog
from verl_npu_autopatch._config import VARIABLES, read_config
from verl_npu_autopatch._version import __version__
from verl_npu_autopatch.records import table

#: Distributions whose versions ``status`` shows.
SHOWN_DISTRIBUTIONS = (
    "vllm",
    "vllm-ascend",
    "transformers",
    "liger-kernel",
    "torch",
    "torch-npu",
    "wrapt",
    "ray",
)

#: Code the ``doctor`` child runs: activate, import every target that can be, print the report.
#: Before each step it prints a progress mark, so a timeout can say what was still running.
DOCTOR_CHILD = """
import importlib, json, sys
def step(what):
    sys.stdout.write("\\n@@verl-npu-autopatch-step@@" + what + "\\n")
    sys.stdout.flush()
step("activation (loading the catalogue and the plugins)")
import verl_npu_autopatch
from verl_npu_autopatch.engine import engine
verl_npu_autopatch.activate("doctor")
eng = engine()
absent, errors = set(), {}
for module in eng.pending_modules():
    step("import " + module)
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            absent.add(module)
        else:
            errors[module] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        errors[module] = f"{type(exc).__name__}: {exc}"
step("settling the records")
eng.settle(absent)
data = verl_npu_autopatch.report().to_dict()
data["import_errors"] = errors
data["strict"] = verl_npu_autopatch.engine.read_config().strict
sys.stdout.write("\\n@@verl-npu-autopatch-doctor@@" + json.dumps(data))
"""
DOCTOR_MARK = "@@verl-npu-autopatch-doctor@@"
STEP_MARK = "@@verl-npu-autopatch-step@@"

#: Seconds the doctor child may run (a cold vLLM import takes about a minute on a slow disk).
DOCTOR_TIMEOUT_S = 600.0

#: ``doctor`` exit codes: all well / a patch failed / the child crashed or activation failed /
#: the child did not finish within ``--timeout``.
OK, PATCH_FAILED, CRASHED, TIMED_OUT = 0, 1, 2, 3


def install_files() -> list[str]:
    """Where this environment's start-up files are (``.pth`` and PEP 829 ``.start``)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    found = []
    for directory in dict.fromkeys(d for d in dirs if d):
        for name in ("verl_npu_autopatch.pth", "verl_npu_autopatch.start"):
            path = Path(directory, name)
            if path.is_file():
                found.append(str(path))
    return found


def status_data() -> dict[str, Any]:
    """This environment, configuration, device decision and each patch's gates, without
    importing any target."""
    config = read_config()
    device, inert = _environment.device_decision(config)
    loaded = catalog.load(config.disable)
    warnings = [*config.warnings, *config.unknown_names(loaded.names())]
    errors = []
    if not inert:
        problem = _environment.wrapt_problem()
        if problem:
            errors.append(problem)
    plans = []
    for patch in loaded.patches:
        plan = _gates.plan(patch, config)
        state = plan.state if not inert or plan.state != "pending" else "inactive"
        plans.append(
            {
                "name": patch.name,
                "groups": list(patch.groups),
                "state": "would apply" if state == "pending" else state,
                "reason": inert if state == "inactive" else plan.reason,
                "targets": [str(t) for t in (plan.variants or patch.targets)],
                "versions": plan.versions,
            }
        )
    files = install_files()
    return {
        "version": __version__,
        "package": str(Path(__file__).parent),
        "python": sys.executable,
        "install_files": files,
        "observer_installed": _startup.installed_observer() is not None,
        "site_disabled": bool(sys.flags.no_site),
        "configuration": config.to_dict(),
        "warnings": warnings,
        "errors": errors,
        "device": device,
        "active": not inert,
        "inactive_reason": inert,
        "distributions": {name: _environment.distribution_version(name) for name in SHOWN_DISTRIBUTIONS},
        "patches": plans,
        "load_errors": [{"name": n, "error": e} for n, e, _ in loaded.errors],
        "skipped_entry_points": loaded.skipped,
    }


def print_status(data: dict[str, Any]) -> None:
    print(f"verl-npu-autopatch {data['version']} ({data['package']})")
    print(f"python: {data['python']}")
    files = data["install_files"] or ["NOT FOUND: start-up hook not installed in this environment"]
    print("start-up files: " + "\n                ".join(files))
    print(f"observer installed in this process: {'yes' if data['observer_installed'] else 'no'}")
    print(f"device: {data['device']}" + (f" -> inactive: {data['inactive_reason']}" if not data["active"] else ""))
    print("configuration: " + ", ".join(f"{k}={v}" for k, v in data["configuration"].items() if k != "warnings"))
    for text in data["errors"]:
        print(f"ERROR: {text}")
    for text in data["warnings"]:
        print(f"WARNING: {text}")
    print("installed: " + ", ".join(f"{k} {v}" for k, v in data["distributions"].items() if v))
    rows = [[p["name"], p["state"], p["reason"]] for p in data["patches"]]
    rows += [[e["name"], "failed", e["error"]] for e in data["load_errors"]]
    off = "turned off by VERL_NPU_AUTOPATCH_DISABLE (not imported)"
    rows += [[name, "disabled", off] for name in data["skipped_entry_points"]]
    print()
    print(table(rows, ["patch", "decision", "why"]) if rows else "no patches in the catalogue")


def catalogue_data() -> list[dict[str, Any]]:
    patches = catalog.load(read_config().disable).patches
    return [
        {
            "name": p.name,
            "groups": list(p.groups),
            "default": "on" if p.default else "opt-in",
            "device": p.device,
            "requires": list(p.requires),
            "targets": [str(t) + (f" ({', '.join(t.requires)})" if t.requires else "") for t in p.targets],
            "summary": p.summary,
            "reference": p.reference,
        }
        for p in patches
    ]


def catalogue_markdown(entries: list[dict[str, Any]]) -> str:
    """``docs/patches.md``: the catalogue, generated by ``verl-npu-autopatch list --markdown``."""
    lines = [
        "# Patch catalogue",
        "",
        "Generated by `verl-npu-autopatch list --markdown > docs/patches.md`; a test fails when it is stale.",
        "",
        "| patch | groups | default | device | requires | targets | what it fixes |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        summary = e["summary"] + (f" ([reference]({e['reference']}))" if e["reference"] else "")
        lines.append(
            f"| `{e['name']}` | {', '.join(e['groups'])} | {e['default']} | {e['device']} | "
            f"{', '.join(e['requires']) or '-'} | {'<br>'.join(f'`{t}`' for t in e['targets'])} | {summary} |"
        )
    lines += ["", "Configuration variables:", ""]
    lines += [f"- `{name}`: {meaning}" for name, meaning in VARIABLES.items()]
    return "\n".join(lines) + "\n"


def run_doctor(device: str | None, timeout: float = DOCTOR_TIMEOUT_S) -> dict[str, Any]:
    """Run the doctor child: a fresh interpreter of this environment imports every target. It
    runs in its own session, so a timeout ends it and anything it started."""
    import signal

    env = dict(os.environ)
    if device:
        env["VERL_NPU_AUTOPATCH_DEVICE"] = device
    proc = subprocess.Popen(
        [sys.executable, "-c", DOCTOR_CHILD],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        stdout, stderr = proc.communicate()
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


def doctor_exit_code(data: dict[str, Any]) -> int:
    if data["status"] == "timed-out":
        return TIMED_OUT
    if data["status"] in ("crashed", "failed"):
        return CRASHED
    bad = ("failed", "superseded", "unsupported") if data.get("strict") else ("failed", "superseded")
    return PATCH_FAILED if any(r["state"] in bad for r in data["records"]) else OK


def print_doctor(data: dict[str, Any]) -> None:
    if data["status"] == "timed-out":
        print(f"doctor: TIMED OUT: {data['reason']}\n{data['stderr']}")
        return
    if data["status"] == "crashed":
        print(f"doctor: the child interpreter crashed ({data['reason']})\n{data['stderr']}")
        return
    print(f"engine: {data['status']} ({data['reason']}); device: {data['device']}; pid {data['pid']}")
    if data["status"] == "inactive" and data["reason"].startswith("switched off"):
        print("patching is switched off in this environment: unset VERL_NPU_AUTOPATCH (or set it to 1) to turn it on")
    elif data["status"] == "inactive" and not data["records"]:
        print("nothing is patched on this host; `verl-npu-autopatch doctor --device npu` is a dry run of an NPU host")
    for text in data["warnings"]:
        print(f"WARNING: {text}")
    rows = [[r["name"], r["state"], r["target"], r["reason"]] for r in data["records"]]
    if rows:
        print(table(rows, ["patch", "state", "target", "why"]))
    for module, error in data.get("import_errors", {}).items():
        print(f"could not import {module}: {error}")
    superseded = [r["name"] for r in data["records"] if r["state"] == "superseded"]
    if superseded:
        print(
            f"\nSUPERSEDED: {', '.join(superseded)}: the fix was installed, but something else runs there now "
            "(the why column names it; see docs/troubleshooting.md, Record states)"
        )
    failed = [r["name"] for r in data["records"] if r["state"] == "failed"]
    if failed:
        print(f"\nFAILED: {', '.join(failed)} (tracebacks follow)\n{data['stderr']}")
    elif data["status"] == "failed":
        print(f"\n{data['stderr']}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-npu-autopatch", description="Ascend-NPU runtime fixes for verl, applied in every process."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="this environment, configuration and each patch's gates")
    status.add_argument("--json", action="store_true")
    listing = sub.add_parser("list", help="the patch catalogue")
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--markdown", action="store_true", help="print docs/patches.md")
    doctor = sub.add_parser("doctor", help="import every installed target in a fresh interpreter and report")
    doctor.add_argument("--json", action="store_true")
    doctor.add_argument("--device", choices=["npu", "auto", "none"], help="npu: dry run on a non-NPU host")
    doctor.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS", help="probe every node of a Ray cluster")
    doctor.add_argument("--runtime-env", metavar="JSON", help="with --ray: the runtime_env the node probes run in")
    doctor.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help=f"how long the child may run (default {DOCTOR_TIMEOUT_S:g}; with --ray, the node probes: 900); "
        f"exit code {TIMED_OUT} when it runs out",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # e.g. `verl-npu-autopatch status | head`
        sys.stderr.close()
        return 0


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "status":
        data = status_data()
        print(json.dumps(data, indent=2)) if args.json else print_status(data)
        return 0
    if args.command == "list":
        entries = catalogue_data()
        if args.json:
            print(json.dumps(entries, indent=2))
        elif args.markdown:
            sys.stdout.write(catalogue_markdown(entries))
        else:
            rows = [[e["name"], ",".join(e["groups"]), e["default"], e["device"], e["summary"]] for e in entries]
            print(table(rows, ["patch", "groups", "default", "device", "summary"]))
        return 0
    if args.ray is not None or args.runtime_env is not None:
        from verl_npu_autopatch import ray_doctor

        return ray_doctor.main(args)
    data = run_doctor(args.device, args.timeout or DOCTOR_TIMEOUT_S)
    print(json.dumps(data, indent=2)) if args.json else print_doctor(data)
    return doctor_exit_code(data)
