"""``fleet``'s text: a first screen that fits 120 columns (how many processes by role, every patch
that differs between them with who and why, everything uniform in one line, the problems), the
patch x role matrix (``--all``) and the stale files (``--stale``)."""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from typing import Any

from verl_npu_autopatch._text import cut, printable
from verl_npu_autopatch.fleet import INCOMPLETE, NOTHING, ROLES, STALE_AFTER_S, exit_code, read_directories, view
from verl_npu_autopatch.records import table, wrap

__all__ = ["add_arguments", "main", "render"]

WIDTH = 120
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
    lines += wrap(indent + printable(text), WIDTH, indent + "    ")


def render(data: dict[str, Any], full: bool = False, stale: bool = False) -> str:
    """The first screen; ``full`` adds the patch x role matrix, ``stale`` lists the stale files."""
    if data.get("error"):
        return f"fleet: {_shown(data['error'])}"
    processes, lines = data["processes"], list[str]()
    where = ", ".join(_shown(source) for source in data["sources"])
    gone = f"; {len(data['stale']):,} stale (processes gone; --stale lists them)" if data["stale"] else ""
    _add(lines, f"verl-npu-autopatch fleet: {len(processes):,} live processes in {where}{gone}")
    for item in data["unreadable"][:3]:
        _add(lines, f"unreadable: {_shown(item['file'])}: {_shown(item['error'])}", "  ")
    if len(data["unreadable"]) > 3:
        lines.append(f"  ... {len(data['unreadable']) - 3:,} more unreadable files (--json lists them)")
    if not processes:
        lines.append("no live process report found (is VERL_NPU_AUTOPATCH_REPORT_DIR set where the job runs?)")
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
    return table(rows, header, WIDTH)


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``fleet`` subcommand's arguments."""
    parser.add_argument("directories", nargs="*", metavar="DIR", help="where the processes wrote their reports")
    parser.add_argument("--json", action="store_true", help="processes, differing patches, problems, matrix")
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
        "--ray", nargs="?", const="auto", metavar="ADDRESS", help="read DIR on every alive node of a Ray cluster"
    )
    parser.add_argument("--runtime-env", metavar="JSON", help="with --ray: the runtime_env the readers run in")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="with --ray: how long to wait for the nodes")


def main(args: argparse.Namespace) -> int:
    """``verl-npu-autopatch fleet``: print the view; the exit status gates a job (see ``fleet.exit_code``)."""
    if not args.directories:
        print("fleet: name at least one DIR (the VERL_NPU_AUTOPATCH_REPORT_DIR of the job)")
        return NOTHING
    stale_after = args.stale_after * 3600
    if args.ray is not None:
        from verl_npu_autopatch import _fleet_ray

        try:
            runtime_env = json.loads(args.runtime_env) if args.runtime_env else None
        except json.JSONDecodeError as exc:
            print(f"fleet: --runtime-env is not valid JSON: {_shown(exc)}")
            return NOTHING
        read = _fleet_ray.gather(args.ray, args.directories, stale_after, args.timeout, runtime_env)
        sources = [f"{d} on every node of the Ray cluster at {args.ray}" for d in args.directories]
    else:
        read, sources = read_directories(args.directories, stale_after), list(args.directories)
    data = {"error": read["error"]} if read.get("error") else view(read, sources, args.json, args.json or args.all)
    print(
        json.dumps(data) if args.json else render(data, full=args.all, stale=args.stale)
    )  # one line: 100 MB for 10,000
    return exit_code(data)
