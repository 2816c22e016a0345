"""``fleet``'s text: a first screen that fits the terminal (``COLUMNS``, else its width, else 120:
how many processes by role, every patch that differs between them with who and why, everything
uniform in one line, the problems), the patch x role matrix (``--all``) and the stale files
(``--stale``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections import Counter
from typing import Any

from verl_npu_autopatch.cli.fleet import INCOMPLETE, NOTHING, ROLES, STALE_AFTER_S, exit_code, read_directories, view
from verl_npu_autopatch.cli.help_text import json_object, seconds
from verl_npu_autopatch.cli.ray_doctor import TIMEOUT_S
from verl_npu_autopatch.cli.ray_session import CONNECT_TIMEOUT_S
from verl_npu_autopatch.cli.summary import table, width, wrap
from verl_npu_autopatch.engine.config import read_config
from verl_npu_autopatch.engine.text import cut, printable

__all__ = ["add_arguments", "looks_like_address", "main", "render"]

#: The variable whose directory ``fleet`` reads when no DIR is named.
REPORT_DIR = "VERL_NPU_AUTOPATCH_REPORT_DIR"

#: Reasons shown per differing patch before "... more"; the rest are in ``--json``.
GROUPS_SHOWN = 4
#: Longest reason, file name or other text from a file shown on a screen (``--json`` has it whole).
SHOWN_CHARS = 300
#: Longest name (patch, host, version) shown.
NAME_CHARS = 100


def _shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """Text from a report file (another user's, another host's) as a screen shows it: cut, and
    with its control and bidirectional characters escaped."""
    return printable(cut(str(value), limit))


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{_shown(name, NAME_CHARS)} {n:,}" for name, n in counts.items())


def _tally(values: Counter[Any]) -> str:
    """``3.11.7 (120), 3.10.2 (8)``: each value with how many processes have it."""
    return ", ".join(f"{_shown(value, NAME_CHARS)} ({n:,})" for value, n in values.most_common())


def _add(lines: list[str], text: str, indent: str = "") -> None:
    """``text`` wrapped; escaped again (a no-op on escaped text) so no raw control character passes."""
    lines += wrap(indent + printable(text), width(), indent + "    ")


def render(data: dict[str, Any], full: bool = False, stale: bool = False) -> str:
    """The first screen; ``full`` adds the patch x role matrix, ``stale`` lists the stale files."""
    if data.get("error"):
        return f"fleet: {_shown(data['error'])}"
    processes, lines = data["processes"], list[str]()
    where = ", ".join(_shown(source) for source in data["sources"])
    if data.get("directories_from") == REPORT_DIR:
        where += f" (from ${REPORT_DIR})"
    gone = f"; {len(data['stale']):,} stale (processes gone; --stale lists them)" if data["stale"] else ""
    _add(lines, f"verl-npu-autopatch fleet: {len(processes):,} live processes in {where}{gone}")
    for note in data.get("notes", []):
        _add(lines, note, "  ")
    for item in data["unreadable"][:3]:
        _add(lines, f"unreadable: {_shown(item['file'])}: {_shown(item['error'])}", "  ")
    if len(data["unreadable"]) > 3:
        lines.append(f"  ... {len(data['unreadable']) - 3:,} more unreadable files (--json lists them)")
    missing = data.get("without_package", [])
    if missing:
        from verl_npu_autopatch.cli.ray_doctor import ship_hint

        for line in ship_hint([_shown(node) for node in missing], data.get("runtime_env"), "the readers")[1:]:
            _add(lines, line, "  ")
    if not processes:
        if missing:
            lines.append("no live process report found on the nodes that have verl-npu-autopatch")
        else:
            lines.append(f"no live process report found (is {REPORT_DIR} set where the job runs?)")
        return "\n".join(lines + (_stale(data) if stale else []))
    _add(lines, "roles: " + _counts(data["roles"]), "  ")
    facts = {
        "python": Counter(p["python"] for p in processes),
        "verl-npu-autopatch": Counter(p["versions"].get("verl-npu-autopatch") for p in processes),
        "engine": Counter(p["status"] for p in processes),
    }
    text = "; ".join(f"{label} " + _tally(values) for label, values in facts.items())
    _add(lines, f"hosts {len({p['host'] for p in processes}):,}; {text}", "  ")
    lines.append("")
    uniform = Counter(state for state in data["uniform"].values() if state != "pending")
    pending = len(data["uniform"]) - sum(uniform.values())
    alike = ", ".join(f"{n:,} {state}" for state, n in uniform.most_common())
    undecided = f"; {pending:,} pending everywhere" if pending else ""
    _add(lines, f"uniform: {sum(uniform.values()):,} patches alike everywhere ({alike}){undecided}")
    if data["differing"]:
        lines += ["", f"DIFFERING: {len(data['differing']):,} patches"]
        for item in data["differing"]:
            _differing(lines, item)
    else:
        lines.append("differing: none")
    if data["problems"]:
        lines += ["", f"PROBLEMS (exit status {exit_code(data)}):"]
        for item in data["problems"]:
            what = _shown(item["patch"], NAME_CHARS) if item["patch"] else "engine"
            where = f"; e.g. {_shown(', '.join(item['examples']))}" if item["state"] == INCOMPLETE else ""
            text = f"{what}: {item['state']} in {item['count']:,} ({_counts(item['roles'])}{where}): "
            _add(lines, text + _shown(item["reason"]), "  ")
    if full:
        lines += ["", _matrix(data)]
    if stale:
        lines += _stale(data)
    return "\n".join(lines)


def _differing(lines: list[str], item: dict[str, Any]) -> None:
    """One differing patch: its states with counts, then who (roles, hosts, examples) and why."""
    _add(lines, f"{_shown(item['patch'], NAME_CHARS)}: " + _counts(item["states"]), "  ")
    groups = item["groups"]
    for group in groups[:GROUPS_SHOWN]:
        examples = _shown(", ".join(group["examples"]))
        who = f"{_counts(group['roles'])}; hosts {group['hosts']:,}; e.g. {examples}"
        _add(lines, f"{group['state']} {group['count']:,} ({who}): {_shown(group['reason']) or '-'}", "    ")
    if len(groups) > GROUPS_SHOWN:
        lines.append(f"    ... {len(groups) - GROUPS_SHOWN:,} more reasons (--json lists them)")


def _cell(states: dict[str, int]) -> str:
    if len(states) == 1:
        return next(iter(states))
    return " ".join(f"{state} {n:,}" for state, n in states.items())


def _matrix(data: dict[str, Any]) -> str:
    """``--all``: every patch (rows) by role (columns), each cell the states with counts."""
    roles = [r for r in ROLES if r in data["roles"]]
    rows = [
        [_shown(name, NAME_CHARS)] + [_cell(by_role[r]) if r in by_role else "-" for r in roles]
        for name, by_role in data["matrix"].items()
    ]
    header = ["patch"] + [f"{r} ({data['roles'][r]:,})" for r in roles]
    return table(rows, header, width())


def _stale(data: dict[str, Any]) -> list[str]:
    lines = ["", f"stale: {len(data['stale']):,} files of processes no longer running"]
    for process in data["stale"]:
        text = f"{_shown(process['file'])}: {process['role']}, pid {process['pid']}: {_shown(process['liveness'])}"
        _add(lines, text, "  ")
    return lines


def _hours(text: str) -> float:
    """``--stale-after``: a finite number of hours, 0 or more (argparse names the option on error)."""
    try:
        hours = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of hours: {text!r}") from None
    if not math.isfinite(hours) or hours < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of hours, 0 or more (0: never), not {text!r}")
    return hours


#: What ``--ray``'s optional value must look like to be taken for an ADDRESS (else it is a DIR).
_ADDRESS = re.compile(r"auto|ray://\S+|\[[0-9A-Fa-f:.]+\]:\d{1,5}|[\w.-]+:\d{1,5}")


def looks_like_address(value: str) -> bool:
    """Whether ``--ray VALUE`` names the cluster: ``auto``, ``host:port``, ``[v6]:port`` or
    ``ray://...``, and not an existing directory (``fleet --ray DIR`` reads DIR on the cluster
    ``auto`` finds; a DIR with a ``/`` never looks like an address)."""
    return _ADDRESS.fullmatch(value) is not None and not os.path.isdir(value)


class _RayAddress(argparse.Action):
    """``--ray [ADDRESS]``: the value when it looks like an address, else ``auto`` and the value
    becomes the first DIR (the documented ``fleet --ray DIR``)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any, option: str | None = None
    ) -> None:
        if value is None or looks_like_address(value):
            namespace.ray = value or "auto"
        else:
            namespace.ray = "auto"
            namespace.ray_directories = [*getattr(namespace, "ray_directories", []), value]


DESCRIPTION = """\
What every live process of a job decided: the report files its processes
(the driver, Ray workers, vLLM's EngineCore and workers) write into
VERL_NPU_AUTOPATCH_REPORT_DIR, compared patch by patch: how many processes by
role, every patch that differs between them with who and why, the problems.
With --ray, DIR is read on every alive node of a Ray cluster (per-node
directories need no shared filesystem). See docs/watching.md."""

EPILOG = """\
--ray [ADDRESS]: ADDRESS is host:port, [v6]:port, ray://host:port or auto (the
default: RAY_ADDRESS, else the latest `ray start` on this host, else a Ray
cluster running here). A value that is an existing directory, or does not
look like an address, is the first DIR: `fleet --ray DIR` reads DIR on the
cluster auto finds. The first line names the cluster reached.

exit status:
  0  no live process has a failed or unsupported patch or a failed activation
  1  a live process has one (PROBLEMS lists them)
  2  no live process report found; no DIR and no VERL_NPU_AUTOPATCH_REPORT_DIR;
     with --ray: Ray is not installed, or the cluster cannot be reached or
     read (one line says why); a wrong command line

environment:
  VERL_NPU_AUTOPATCH_REPORT_DIR  the DIR read when none is named
  RAY_ADDRESS                    the cluster --ray (auto) reads, when set"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fleet`` subcommand's arguments, description, exit codes and environment (its help)."""
    parser.description, parser.epilog = DESCRIPTION, EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.set_defaults(ray_directories=[], fleet_error=parser.error)
    parser.add_argument(
        "directories",
        nargs="*",
        metavar="DIR",
        help="where the processes wrote their reports (default: $VERL_NPU_AUTOPATCH_REPORT_DIR)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="everything as one JSON object: processes, differing patches, problems, the matrix, stale and "
        "unreadable files, the cluster reached (so not with --all or --stale)",
    )
    parser.add_argument("--all", action="store_true", help="also the full patch x role matrix")
    parser.add_argument("--stale", action="store_true", help="also list the files of processes no longer running")
    parser.add_argument(
        "--stale-after",
        type=_hours,
        default=STALE_AFTER_S / 3600,
        metavar="HOURS",
        help="a file from another host not rewritten for longer is stale (default %(default)g; 0: never)",
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        action=_RayAddress,
        metavar="ADDRESS",
        help="read DIR on every alive node of the Ray cluster at ADDRESS (default auto; see below)",
    )
    parser.add_argument(
        "--runtime-env",
        type=json_object,
        metavar="JSON",
        help="with --ray: the runtime_env the readers run in, e.g. the package's wheel for nodes without it",
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        metavar="SECONDS",
        help=f"with --ray: how long to wait for the cluster (default {CONNECT_TIMEOUT_S:g}) and for the nodes' "
        f"answers (default {TIMEOUT_S:g})",
    )


def _conflict(args: argparse.Namespace) -> str | None:
    """What the command line asks that cannot be done together (argparse refuses it, exit 2)."""
    if args.json and (args.all or args.stale):
        return "--json holds everything (the matrix, the stale files): --all and --stale shape the screen only"
    if args.ray is None and (args.runtime_env is not None or args.timeout is not None):
        return "--runtime-env and --timeout need --ray"
    return None


def main(args: argparse.Namespace) -> int:
    """``verl-npu-autopatch fleet``: print the view; the exit status gates a job (see ``fleet.exit_code``)."""
    conflict = _conflict(args)
    if conflict:
        args.fleet_error(conflict)  # exits 2 with the usage
    directories = [*getattr(args, "ray_directories", []), *args.directories]
    from_environment = not directories
    if from_environment:
        report_dir = read_config().report_dir
        if not report_dir:
            raw = os.environ.get(REPORT_DIR, "").strip()
            why = f"{REPORT_DIR}={_shown(raw)} is not an absolute path (nor ~/...)" if raw else f"{REPORT_DIR} is unset"
            print(f"fleet: name at least one DIR (the {REPORT_DIR} of the job); {why}")
            return NOTHING
        directories = [report_dir]
    stale_after = args.stale_after * 3600
    if args.ray is not None:
        from verl_npu_autopatch.cli import fleet_ray, ray_session

        read = fleet_ray.gather(args.ray, directories, stale_after, args.timeout, args.runtime_env)
        where, notes = ray_session.cluster_lines(args.ray, read.get("cluster"))
        sources = [f"{d} on every node of {where}" for d in directories]
    else:
        read, sources, notes = read_directories(directories, stale_after), list(directories), []
    if read.get("error"):
        data: dict[str, Any] = {"error": read["error"]}
    else:
        data = view(read, sources, args.json, args.json or args.all)
        data["directories_from"] = REPORT_DIR if from_environment else "command line"
        if args.ray is not None:
            data.update(cluster=read["cluster"], notes=notes, without_package=read.get("without_package", []))
            data["runtime_env"] = args.runtime_env
    if args.json:  # where fleet ran, as every --json says (the processes' own versions are in their entries)
        from verl_npu_autopatch.cli.bug_report import environment

        data["environment"] = environment()
    print(
        json.dumps(data) if args.json else render(data, full=args.all, stale=args.stale)
    )  # one line: 100 MB for 10,000
    return exit_code(data)
