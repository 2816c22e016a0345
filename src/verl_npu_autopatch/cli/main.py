"""Command line: ``verl-npu-autopatch status | list | doctor | fleet | bug-report`` (also
``python -m verl_npu_autopatch``).

``status`` and ``list`` are here; ``doctor`` runs through :mod:`verl_npu_autopatch.cli.doctor`,
``doctor --ray`` through :mod:`verl_npu_autopatch.cli.ray_doctor`, which never import this module (a
Ray node's probe is told to run :func:`status_data` by name), and ``bug-report`` through
:mod:`verl_npu_autopatch.cli.bug_report`. The help texts are in :mod:`verl_npu_autopatch.cli.help_text`."""

from __future__ import annotations

import argparse
import json
import site
import sys
from pathlib import Path
from typing import Any

from verl_npu_autopatch._version import __version__
from verl_npu_autopatch.authoring.spec import Patch, Target
from verl_npu_autopatch.bootstrap.startup import OBSERVER
from verl_npu_autopatch.cli import bug_report, doctor, fleet_view, help_text, summary
from verl_npu_autopatch.cli.doctor import DOCTOR_TIMEOUT_S, MISMATCH, TIMED_OUT, run_doctor
from verl_npu_autopatch.cli.help_text import json_object, seconds
from verl_npu_autopatch.cli.summary import table
from verl_npu_autopatch.cli.verify import absent as verify_absent
from verl_npu_autopatch.engine import catalog, environment
from verl_npu_autopatch.engine.config import VARIABLES, read_config, variable_warnings

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


def startup_files() -> list[str]:
    """Where this environment's start-up files are (``.pth`` and PEP 829 ``.start``)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    found = []
    for directory in dict.fromkeys(d for d in dirs if d):
        for name in ("verl_npu_autopatch.pth", "verl_npu_autopatch.start"):
            path = Path(directory, name)
            if path.is_file():
                found.append(str(path))
    return found


def _with_requires(target: Target) -> str:
    return str(target) + (f" ({', '.join(target.requires)})" if target.requires else "")


#: How :func:`touches` shows a target of a patch declaring ``stale`` (the source of the copies it rebinds).
STALE_SOURCE = "rebinds the stale copies of "


def touches(patch: Patch) -> list[str]:
    """Everything ``patch`` declares it touches, one line each: its targets, then the triggers whose
    import runs it, the secondary sites its fix also changes and the upstream files its static rule
    reads for the decision table."""
    source = (
        STALE_SOURCE if patch.reach.stale_values is not None else ""
    )  # another owner replaced them: their copies are fixed
    lines = [source + _with_requires(t) for t in patch.targets]
    lines += [f"triggered by {_with_requires(t)}" for t in patch.reach.triggers]
    lines += [f"also changes {t}" for t in patch.reach.secondary]
    lines += [f"also changes {sites} (found in the live module)" for sites in patch.reach.computed]
    lines += [f"also changes {p}.*:<copies of the target> (found in the live modules)" for p in patch.reach.copies_in]
    if patch.static is not None:
        lines.append("decision table reads " + ", ".join(f for rule in patch.static.rules() for f in rule.reads))
    return lines


#: Seconds ``status`` waits for each plugin's entry point to load (a plugin that hangs at load is
#: then listed as failed to load; ``status`` never hangs).
STATUS_TIMEOUT_S = 30.0


def status_data(timeout: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
    """This environment, configuration, device decision and each patch's gates, without
    importing any target (the plugins' entry points are loaded, each within ``timeout``)."""
    from verl_npu_autopatch.engine import decision  # the gates' rule: imported only here (ownership, patching)

    config = read_config()
    device, inactive = environment.device_decision(config)
    loaded = catalog.load(config.disable, timeout)
    warnings = [*config.warnings, *config.unknown_names(loaded.names()), *variable_warnings()]
    errors = []
    if not inactive:
        problem = environment.wrapt_problem()
        if problem:
            errors.append(problem)
    plans = []
    for patch in loaded.patches:
        plan = decision.plan(patch, config)
        # the engine's own decision first: a plan that waits, or needs the NPU stack, is inactive here
        state = "inactive" if inactive and (plan.state == "pending" or plan.reason == NPU_STACK_GATE) else plan.state
        plans.append(
            {
                "name": patch.name,
                "groups": list(patch.groups),
                "state": "would apply" if state == "pending" else state,
                "reason": inactive if state == "inactive" else plan.reason,
                "targets": [str(t) for t in (plan.variants or patch.hooks)],
                "touches": touches(patch),
                "defined_at": patch.defined_at,
                "versions": plan.versions,
            }
        )
    files = startup_files()
    return {
        "version": __version__,
        "package": str(Path(__file__).parent),
        "python": sys.executable,
        "install_files": files,
        "observer_installed": OBSERVER.hooked(),
        "observer": OBSERVER.mode,
        "site_disabled": bool(sys.flags.no_site),
        "configuration": config.to_dict(),
        "warnings": warnings,
        "errors": errors,
        "device": device,
        "active": not inactive,
        "inactive_reason": inactive,
        "distributions": {name: environment.distribution_version(name) for name in SHOWN_DISTRIBUTIONS},
        "patches": plans,
        "load_errors": [{"name": n, "error": e} for n, e, _ in loaded.errors],
        "skipped_entry_points": loaded.skipped,
        "environment": bug_report.environment(),
    }


#: The gate of a patch that needs the NPU stack (``decision.plan``): on a host where the engine
#: stays inactive, ``status`` gives such a patch the engine's reason, so one cause has one label.
NPU_STACK_GATE = "needs the NPU stack (torch_npu)"


def verified_status_data() -> dict[str, Any]:
    """:func:`status_data` plus what ``doctor --verify`` finds here (the node probe of
    ``doctor --ray --verify``): the doctor child runs with this process's environment."""
    data = status_data()
    found = run_doctor(None, verify=True)
    data["verify"] = found.get("verify") or {
        **verify_absent(),
        "ok": False,
        "error": f"the doctor child {found['status']}: {found.get('reason', '')}",
    }
    return data


def _status_rows(data: dict[str, Any]) -> list[list[str]]:
    """``[name, decision, why]`` per patch, failed plugin loads and skipped entry points."""
    rows = [[p["name"], p["state"], p["reason"]] for p in data["patches"]]
    rows += [[e["name"], "failed", e["error"]] for e in data["load_errors"]]
    off = "turned off by VERL_NPU_AUTOPATCH_DISABLE (not imported)"
    return rows + [[name, "disabled", off] for name in data["skipped_entry_points"]]


def status_attention(data: dict[str, Any]) -> list[str]:
    """What ``status`` asks the reader to look at: errors, warnings, plugins that failed to load,
    a missing start-up hook."""
    items = [f"ERROR: {text}" for text in data["errors"]]
    items += [f"WARNING: {text}" for text in data["warnings"]]
    items += [f"plugin {e['name']} failed to load: {e['error']}" for e in data["load_errors"]]
    if not data["install_files"]:
        items.append("the start-up hook (.pth) is not installed in this environment: see docs/troubleshooting.md")
    return items


def hook_state(data: dict[str, Any]) -> str:
    """What the start-up hook does in this process, as ``status`` says it."""
    if not data["configuration"]["enabled"]:
        where = "in place but idle" if data["observer_installed"] else "not in place"
        return f"{where}: VERL_NPU_AUTOPATCH is off, so the first watched import imports nothing and nothing is patched"
    if not data["observer_installed"]:
        return "NOT in place (see docs/troubleshooting.md, The start-up hook does not run)"
    return f"in place ({data['observer']})"


def print_status(data: dict[str, Any], full: bool = False) -> None:
    """The summary (and with ``full`` every patch and what it touches), fitting the terminal."""
    say, show = summary.say, summary.show
    say(f"verl-npu-autopatch {data['version']}: device {data['device']}")
    if not data["active"]:
        say(f"inactive: {data['inactive_reason']}")
    rows = _status_rows(data)
    more = "" if full else "status --all"
    show("\n".join(summary.groups([(n, s, r) for n, s, r in rows], [row[0] for row in rows], more)))
    show("\n" + "\n".join(summary.attention(status_attention(data))))
    show()
    say(f"package: {data['package']}")
    say(f"python: {data['python']}")
    show("start-up files:")
    for path in data["install_files"] or ["NOT FOUND: start-up hook not installed in this environment"]:
        say(path, indent="  ")
    say(f"start-up hook in this process: {hook_state(data)}")
    say("configuration: " + ", ".join(f"{k}={v}" for k, v in data["configuration"].items() if k != "warnings"))
    say("installed: " + ", ".join(f"{k} {v}" for k, v in data["distributions"].items() if v))
    if not full:
        show()
        say("every patch, its reason and what it touches: verl-npu-autopatch status --all")
        return
    show()
    show(table(rows, ["patch", "decision", "why"], width=summary.width()) if rows else "no patches in the catalog")
    if data["patches"]:
        show("\nwhat each patch touches:")
        for plan in data["patches"]:
            say(f"{plan['name']} ({plan['defined_at']}):", indent="  ")
            for line in plan["touches"]:
                say(summary.site(line), indent="    ")


def catalog_data() -> list[dict[str, Any]]:
    patches = catalog.load(read_config().disable).patches
    return [
        {
            "name": p.name,
            "groups": list(p.groups),
            "default": "on" if p.default else "opt-in",
            "device": p.device,
            "requires": list(p.requires),
            "targets": [_with_requires(t) for t in p.targets],
            "touches": touches(p),
            "defined_at": p.defined_at,
            "summary": p.summary,
            "reference": p.reference,
        }
        for p in patches
    ]


def _markdown_site(line: str) -> str:
    """One line of :func:`touches` in the catalog table: places and files as code."""
    line, found, note = line.partition(" (found in")
    note = found + note
    line = summary.site(line)
    labels = ("triggered by the import of ", "triggered by ", "also changes ", "decision table reads ", STALE_SOURCE)
    for label in labels:
        if line.startswith(label):
            items = line[len(label) :].split(", ") if label.endswith("reads ") else [line[len(label) :]]
            return label + ", ".join(f"`{item}`" for item in items) + note
    return f"`{line}`{note}"


def catalog_markdown(entries: list[dict[str, Any]]) -> str:
    """``docs/patches.md``: the catalog, generated by ``verl-npu-autopatch list --markdown``."""
    lines = [
        "# Patch catalog",
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
            f"{', '.join(e['requires']) or '-'} | {'<br>'.join(_markdown_site(t) for t in e['touches'])} | {summary} |"
        )
    lines += ["", "Configuration variables:", ""]
    lines += [f"- `{name}`: {meaning}" for name, meaning in VARIABLES.items()]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The command line: every command with its description, exit codes and variables (``--help``)."""
    options = help_text.parser_options
    parser = argparse.ArgumentParser(prog="verl-npu-autopatch", **options())
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    json_help = help_text.JSON_HELP
    status = sub.add_parser(
        "status", help="this environment, configuration and each patch's gates", **options("status")
    )
    status.add_argument("--json", action="store_true", help=json_help)
    status.add_argument("--all", action="store_true", help="every patch, its reason and what it touches")
    status.add_argument(
        "--timeout",
        type=seconds,
        default=STATUS_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long each plugin's entry point may take to load (default {STATUS_TIMEOUT_S:g})",
    )
    listing = sub.add_parser("list", help="the patch catalog", **options("list"))
    form = listing.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help=json_help)
    form.add_argument("--markdown", action="store_true", help="print docs/patches.md")
    form.add_argument("--all", action="store_true", help="each patch's groups, whole summary and what it touches")
    doctor_help = "import every installed target in a fresh interpreter and report"
    check = sub.add_parser("doctor", help=doctor_help, **options("doctor"))
    check.add_argument("--json", action="store_true", help=json_help)
    check.add_argument("--device", choices=["npu", "auto", "none"], help="npu: dry run on a non-NPU host")
    check.add_argument("--all", action="store_true", help="every record with its target and reason, the whole log")
    check.add_argument(
        "--verify",
        action="store_true",
        help="also run each applied kernel patch against upstream on tiny inputs on the device (errors, time); "
        f"exit code {MISMATCH} when one disagrees or cannot run (with --ray: every node, a problem there)",
    )
    check.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help="probe every node of a Ray cluster: ADDRESS is host:port or ray://host:port (default auto: "
        "RAY_ADDRESS, else the latest `ray start` here, else the one running here)",
    )
    check.add_argument(
        "--runtime-env", type=json_object, metavar="JSON", help="with --ray: the runtime_env the node probes run in"
    )
    check.add_argument(
        "--timeout",
        type=seconds,
        metavar="SECONDS",
        help=f"how long the child may run (default {DOCTOR_TIMEOUT_S:g}; exit code {TIMED_OUT} when it runs out); "
        "with --ray: how long to wait for the cluster (default 60; exit code 2) and for the node probes "
        f"(default 900; exit code {TIMED_OUT})",
    )
    fleet = sub.add_parser("fleet", help="what every live process of a job decided (VERL_NPU_AUTOPATCH_REPORT_DIR)")
    fleet_view.add_arguments(fleet)
    report = sub.add_parser("bug-report", help="one paste-ready dump for an issue", **options("bug-report"))
    report.add_argument("--json", action="store_true", help=json_help)
    report.add_argument(
        "--timeout",
        type=seconds,
        default=DOCTOR_TIMEOUT_S,
        metavar="SECONDS",
        help=f"how long the doctor child may run (default {DOCTOR_TIMEOUT_S:g})",
    )
    return parser


def ascii_safe() -> None:
    """Whatever the locale (``PYTHONIOENCODING=ascii``, the C locale), a character the output
    cannot encode is written as an escape, never a ``UnicodeEncodeError``."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except Exception:  # a stream that cannot be reconfigured (replaced by the caller) is left as it is
                pass


def main(argv: list[str] | None = None) -> int:
    ascii_safe()
    try:
        return _main(argv)
    except BrokenPipeError:  # e.g. `verl-npu-autopatch status | head`
        sys.stderr.close()
        return 0


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # the bare command: the help, as for a command line that is incomplete
        parser.print_help(sys.stderr)
        return help_text.USAGE
    if args.command == "status":
        data = status_data(args.timeout)
        print(json.dumps(data, indent=2)) if args.json else print_status(data, full=args.all)
        return 0
    if args.command == "fleet":
        return fleet_view.main(args)
    if args.command == "bug-report":
        found = bug_report.collect(args.timeout)
        print(json.dumps(found, indent=2)) if args.json else summary.show(bug_report.markdown(found), end="")
        return 0
    if args.command == "list":
        entries = catalog_data()
        if args.json:
            print(json.dumps(entries, indent=2))
        elif args.markdown:
            summary.show(catalog_markdown(entries), end="")
        else:
            summary.show("\n".join(summary.catalog_lines(entries, args.all)))
            if not args.all:
                summary.say("groups, whole summaries and what each patch touches: verl-npu-autopatch list --all")
        return 0
    if args.ray is not None or args.runtime_env is not None:
        from verl_npu_autopatch.cli import ray_doctor

        probe = verified_status_data if args.verify else status_data
        return ray_doctor.main(args, status=f"{__name__}:{probe.__name__}")
    return doctor.main(args, bug_report.environment)
