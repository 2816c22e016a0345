"""The command line's help texts: each command's description, exit codes and the environment
variables it reads, laid out for the terminal's width (``summary.width``) when the parser is built.
docs/exit-codes.md and docs/configuration.md say the same at length; a test keeps them in step."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from verl_npu_autopatch.cli import summary
from verl_npu_autopatch.cli.summary import wrap
from verl_npu_autopatch.engine.config import LEGACY_GLM52, PREFIX
from verl_npu_autopatch.engine.text import cut, printable

#: One short line per configuration variable (``config.VARIABLES`` has the accepted values).
VARIABLE_HELP = {
    PREFIX: "0 switches everything off (the start-up placeholder stays, doing nothing)",
    f"{PREFIX}_ENABLE": "opt-in patches or groups to turn on",
    f"{PREFIX}_DISABLE": "patches, groups or plugin entry points to turn off",
    f"{PREFIX}_DEVICE": "auto (default) / npu (act anywhere: a dry run) / none",
    f"{PREFIX}_STRICT": "1: a failed or unsupported patch raises PatchError",
    f"{PREFIX}_LOG": "the verl_npu_autopatch logger's level (INFO: one line per decision)",
    f"{PREFIX}_REPORT_DIR": "where each process writes its report (what `fleet` reads)",
    f"{PREFIX}_REPORT_MODE": "the report files' mode (600 by default)",
    LEGACY_GLM52: "verl's legacy switch: 1 turns on group glm52",
}

#: What the screens' width follows.
COLUMNS_HELP = "the width every screen fits (default: the terminal's; 120 when unknown)"

#: The exit code of a command line argparse refuses (also the bare command).
USAGE = 2

#: Per command: its description, its exit codes (code, when) and a note on the environment.
COMMANDS: dict[str, tuple[str, list[tuple[int, str]], str]] = {
    "status": (
        "This environment as the engine would see it, without importing any target: the start-up "
        "files, the configuration, the device decision, the installed versions and each patch's gates "
        "(would apply, disabled, gated, inactive). Plugins' entry points are loaded, each within --timeout.",
        [(0, "always: errors and warnings are printed (ERROR:, WARNING:, needs attention), not returned")],
        "all of them are parsed and shown; unknown VERL_NPU_AUTOPATCH_* names are warned about",
    ),
    "list": (
        "The patch catalog: every built-in patch and every plugin's, whether it is on by default or "
        "opt-in, the device it needs and what it fixes.",
        [(0, "always")],
        f"{PREFIX}_DISABLE naming a plugin entry point keeps it out (its module is not imported)",
    ),
    "doctor": (
        "Run a fresh interpreter of this environment that activates the engine and imports every "
        "installed target, then print what was applied, skipped or failed, and why. --device npu is a "
        "dry run on a host without an NPU; --verify also runs each applied kernel against upstream; "
        "--ray checks every node of a Ray cluster (docs/ray.md).",
        [
            (0, "nothing below (an inactive host is 0)"),
            (1, "a record is failed or superseded (strict mode: also unsupported)"),
            (2, "the child crashed or its activation failed"),
            (3, "the child did not finish within --timeout"),
            (4, "--verify: a kernel disagrees with upstream or could not run"),
        ],
        f"the child runs with this environment minus {PREFIX}_REPORT_DIR, so it never writes into a "
        "job's report directory; unknown VERL_NPU_AUTOPATCH_* names are warned about",
    ),
    "bug-report": (
        "One paste-ready dump for an issue: the versions of this package, Python, the platform, torch, "
        "torch_npu, CANN, vLLM, vllm-ascend, transformers, verl, Megatron-Core and Ray (read from the "
        "installed metadata and CANN's version file, importing none of them), every VERL_NPU_AUTOPATCH_* "
        "variable, the summary of `doctor` (run as doctor runs it, within --timeout) and where to open "
        "the issue. Markdown by default, --json for a file. Nothing is sent anywhere.",
        [(0, "the dump was printed (whatever doctor found: its exit code is in the dump)")],
        "every VERL_NPU_AUTOPATCH_* variable is shown, its value escaped and cut",
    ),
}

JSON_HELP = "print JSON instead of the screen: every field, whatever the other flags"


def _block(title: str, items: list[tuple[str, str]]) -> list[str]:
    """``title:`` and one wrapped ``  key  text`` line per item, the texts aligned."""
    columns = summary.width()
    key_width = max(len(key) for key, _ in items)
    lines = [f"{title}:"]
    for key, text in items:
        lines += wrap(f"  {key.ljust(key_width)}  {text}", columns, " " * (key_width + 4))
    return lines


def epilog(command: str) -> str:
    """The exit codes and environment variables of ``command`` (``""``: the bare command)."""
    wrong = "the command line is wrong (usage and error on stderr)"
    head = ["environment (docs/configuration.md):"]
    if command:
        _, codes, note = COMMANDS[command]
        code_items = [(str(code), when + (f"; or {wrong}" if code == USAGE else "")) for code, when in codes]
        if USAGE not in (code for code, _ in codes):
            code_items.append((str(USAGE), wrong))
        head += wrap(note[0].upper() + note[1:] + ".", summary.width() - 2, "")
        head = [head[0], *("  " + line for line in head[1:])]
    else:
        code_items = [("0", "--help, --version"), (str(USAGE), "no command, or a command line that is wrong")]
        code_items.append(("", "each command's own: verl-npu-autopatch COMMAND --help, docs/exit-codes.md"))
    variables = [*VARIABLE_HELP.items(), ("COLUMNS", COLUMNS_HELP)]
    return "\n".join([*_block("exit codes", code_items), "", *head, *_block("", variables)[1:]])


def description(command: str) -> str:
    """``command``'s description, wrapped to the terminal."""
    text = COMMANDS[command][0] if command else TOP
    return "\n".join(wrap(text, summary.width()))


TOP = (
    "Ascend-NPU runtime fixes for verl, applied in every Python process when the module each one "
    "fixes is imported. Start with `verl-npu-autopatch doctor` (on a host without an NPU: doctor "
    "--device npu); docs: https://github.com/verl-project/verl-npu-autopatch/tree/main/docs"
)


def parser_options(command: str = "") -> dict[str, Any]:
    """The ``ArgumentParser`` keywords of ``command``: description, epilog, their layout kept."""
    return {
        "description": description(command),
        "epilog": epilog(command),
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }


def seconds(text: str) -> float:
    """``--timeout``'s value: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def json_object(text: str) -> dict[str, Any]:
    """``--runtime-env``'s value: a JSON object (a Ray ``runtime_env``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if type(value) is not dict:
        raise argparse.ArgumentTypeError(f"must be a JSON object (a runtime_env), not {printable(cut(text, 100))}")
    return value
