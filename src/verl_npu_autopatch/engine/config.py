"""Configuration from the environment, read once at activation; problems become warning texts, which
the engine logs once each. No heavy import (not even ``__future__``): it runs on the inactive path.
"""

import os

from verl_npu_autopatch.bootstrap.startup import flag  # the one on/off parser

TYPE_CHECKING = False
if TYPE_CHECKING:  # without importing typing or collections at run time
    from collections.abc import Iterable, Mapping

PREFIX = "VERL_NPU_AUTOPATCH"
LEGACY_GLM52 = "VERL_VLLM_ASCEND_GLM52_PATCH"

DEVICES = ("auto", "npu", "none")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: Characters of a value a warning shows, and unknown patch names it names per variable (then counts).
SHOWN, NAMES_SHOWN = 60, 3
#: The report files' mode by default (only their owner reads them), and the modes ``_REPORT_MODE`` may give.
REPORT_MODE, REPORT_MODES = 0o600, ("600", "640", "604", "644")
_LIST = "`verl-npu-autopatch list` shows the names"

#: Every variable the engine reads, with its accepted values (for docs and ``status``).
VARIABLES = {
    PREFIX: "1 (default) / 0; also true/false, yes/no, on/off, enable(d)/disable(d), none",
    f"{PREFIX}_ENABLE": "patch names or groups to turn on (opt-in patches), in any case, separated by commas, "
    "spaces or newlines",
    f"{PREFIX}_DISABLE": "patch names, groups or plugin entry points to turn off, as for ENABLE; wins over ENABLE",
    f"{PREFIX}_DEVICE": "auto (default) / npu / none",
    f"{PREFIX}_STRICT": "0 (default) / 1",
    f"{PREFIX}_LOG": "a logging level name: " + ", ".join(LOG_LEVELS),
    f"{PREFIX}_REPORT_DIR": "an absolute directory or ~/...; each process that activates writes its report there "
    "(`fleet` reads them); a directory of another user, or writable by others without the sticky bit, is refused",
    f"{PREFIX}_REPORT_MODE": "the report files' mode: 600 (default), 640, 604 or 644 (a leading 0 or 0o allowed); "
    "directories made get the matching search bits (700, 750, 701, 755)",
    LEGACY_GLM52: "1 / true / yes turns on group glm52 (legacy verl switch)",
}

#: Variables under the prefix read by the repository's scripts, not by the package (never warned about).
SCRIPT_VARIABLES = (f"{PREFIX}_UPSTREAM_CACHE",)
#: How close (``difflib`` ratio) a name must be to a known one, or its head to the prefix, to be a misspelling.
NEAR_NAME, NEAR_PREFIX = 0.9, 0.85


def unknown_variables(environ: "Mapping[str, str] | None" = None) -> "list[tuple[str, str]]":
    """``(name, closest known name or "")`` for each variable that looks meant for this package but is
    not one it reads (``..._DISABLED``, ``VERL_NPU_AUTOPACH_DISABLE``). For the command line only."""
    import difflib

    env = os.environ if environ is None else environ
    known = sorted(VARIABLES)
    found = []
    for name in sorted(env):
        upper = name.upper()[: 2 * len(PREFIX) + SHOWN]  # a huge name is compared by its head
        if name in VARIABLES or name in SCRIPT_VARIABLES:
            continue
        longer = upper.startswith(PREFIX + "_")  # not the master switch with something after it
        close = difflib.get_close_matches(upper, [k for k in known if not longer or k != PREFIX], n=1, cutoff=NEAR_NAME)
        head = difflib.SequenceMatcher(None, upper[: len(PREFIX)], PREFIX).ratio()
        if not (close or upper.startswith(PREFIX) or head >= NEAR_PREFIX):
            continue
        if not close and upper.startswith(PREFIX):  # the known name whose rest is closest, if any
            rests = {k[len(PREFIX) :]: k for k in known if k.startswith(PREFIX + "_")}
            close = [rests[r] for r in difflib.get_close_matches(upper[len(PREFIX) :], rests, n=1, cutoff=0.6)]
        found.append((name, close[0] if close else ""))
    return found


def variable_warnings(environ: "Mapping[str, str] | None" = None) -> "list[str]":
    """One warning per :func:`unknown_variables` entry, with a "did you mean"."""
    return [
        f"{shown(name)} is set but is not a variable verl-npu-autopatch reads (ignored); "
        + (f"did you mean {close}? " if close else "")
        + "the variables: docs/configuration.md"
        for name, close in unknown_variables(environ)
    ]


class Config:
    """The parsed configuration plus the warnings parsing produced."""

    __slots__ = (
        "_folded",
        "device",
        "disable",
        "enable",
        "enabled",
        "log_level",
        "report_dir",
        "report_mode",
        "strict",
        "warnings",
    )

    def __init__(
        self,
        *,
        enabled: bool = True,
        enable: frozenset[str] = frozenset(),
        disable: frozenset[str] = frozenset(),
        device: str = "auto",
        strict: bool = False,
        log_level: str | None = None,
        warnings: tuple[str, ...] = (),
        report_dir: str = "",
        report_mode: int = REPORT_MODE,
    ) -> None:
        self.enabled = enabled
        self.enable = enable
        self.disable = disable
        self._folded: tuple[set[str], set[str]] | None = None  # (enable, disable) in one case, on first use
        self.device = device
        self.strict = strict
        self.log_level = log_level
        self.warnings = warnings
        self.report_dir = report_dir
        self.report_mode = report_mode

    def to_dict(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "enable": sorted(self.enable),
            "disable": sorted(self.disable),
            "device": self.device,
            "strict": self.strict,
            "log_level": self.log_level,
            "report_dir": self.report_dir or None,
            "report_mode": f"{self.report_mode:04o}",
            "warnings": list(self.warnings),
        }

    def named(self, names: "Iterable[str]") -> "tuple[bool, bool]":
        """Whether DISABLE, and whether ENABLE, names one of ``names`` (a patch and its groups), in any case."""
        if self._folded is None:
            self._folded = (_folded(self.enable), _folded(self.disable))
        on, off = self._folded
        keys = _folded(names)
        return not off.isdisjoint(keys), not on.isdisjoint(keys)

    def unknown_names(self, known: set[str]) -> list[str]:
        """A warning per ENABLE/DISABLE entry naming nothing in ``known`` (in any case), with the closest names."""
        folded = _folded(known)
        found = []
        for variable, names in ((f"{PREFIX}_ENABLE", self.enable), (f"{PREFIX}_DISABLE", self.disable)):
            unknown = sorted(name for name in names if name.casefold() not in folded)
            for name in unknown[:NAMES_SHOWN]:
                found.append(f"{variable}: unknown patch or group {shown(name)}; {closest(name, known)}{_LIST}")
            if len(unknown) > NAMES_SHOWN:
                found.append(f"{variable}: {len(unknown) - NAMES_SHOWN:,} more unknown patch or group names; {_LIST}")
        return found


def closest(name: str, known: "Iterable[str]") -> str:
    """``"did you mean 'a' or 'b'? "``: the known names closest to ``name`` in any case (up to three),
    or "" (also for a name longer than :data:`SHOWN`)."""
    import difflib

    spelled = {k.casefold(): k for k in sorted(known, reverse=True)}  # the first spelling wins
    folded = name.casefold() if len(name) <= SHOWN else ""
    close = difflib.get_close_matches(folded, sorted(spelled), n=3, cutoff=0.6) if folded else []
    return f"did you mean {' or '.join(repr(spelled[c]) for c in close)}? " if close else ""


def shown(raw: str) -> str:
    """``raw`` as a warning shows it: its ``repr``, cut after :data:`SHOWN` characters."""
    if len(raw) <= SHOWN:
        return repr(raw)
    return f"{raw[:SHOWN]!r}... ({len(raw):,} characters)"


def _not_understood(warnings: list[str], name: str, raw: str, outcome: str, accepted: str = "") -> None:
    warnings.append(
        f"{name}={shown(raw)} is not understood; accepted values: {accepted or VARIABLES[name]}. {outcome}."
    )


def _flag(environ: "Mapping[str, str]", name: str, default: bool, warnings: list[str]) -> bool:
    raw = environ.get(name, "")
    value = flag(raw) if raw.strip() else default
    if value is None:
        _not_understood(warnings, name, raw, "Using on" if default else "Using off")
    return default if value is None else value


def _names(environ: "Mapping[str, str]", name: str) -> frozenset[str]:
    """The names a list variable holds: separated by commas, spaces or newlines (a YAML ``|`` block)."""
    return frozenset(environ.get(name, "").replace(",", " ").split())


def _folded(names: "Iterable[str]") -> "set[str]":
    """``names`` in one case, as ENABLE and DISABLE compare them."""
    return set(map(str.casefold, names))


def read_config(environ: "Mapping[str, str] | None" = None) -> Config:
    """Parse the configuration variables; a bad value keeps its default and adds one warning."""
    env = os.environ if environ is None else environ
    warnings: list[str] = []
    enabled = _flag(env, PREFIX, True, warnings)
    strict = _flag(env, f"{PREFIX}_STRICT", False, warnings)

    raw = env.get(f"{PREFIX}_DEVICE", "")
    device = raw.strip().lower() or "auto"
    if device not in DEVICES:
        _not_understood(warnings, f"{PREFIX}_DEVICE", raw, "Using auto")
        device = "auto"

    raw = env.get(f"{PREFIX}_LOG", "")
    log_level = raw.strip().upper() or None
    if log_level is not None and log_level not in LOG_LEVELS:
        _not_understood(warnings, f"{PREFIX}_LOG", raw, "Keeping the logger's level", ", ".join(LOG_LEVELS))
        log_level = None

    enable = _names(env, f"{PREFIX}_ENABLE")
    if _flag(env, LEGACY_GLM52, False, warnings):
        enable |= {"glm52"}

    # a relative directory (each process would write under its own working directory): no report file
    raw = env.get(f"{PREFIX}_REPORT_DIR", "").strip()
    report_dir = os.path.expanduser(raw)
    if report_dir and not os.path.isabs(report_dir):
        warnings.append(
            f"{PREFIX}_REPORT_DIR={shown(raw)} is not an absolute path (nor ~/...); no report file is written."
        )
        report_dir = ""

    raw = env.get(f"{PREFIX}_REPORT_MODE", "").strip()
    digits = raw.lower().removeprefix("0o").lstrip("0")
    report_mode = int(digits, 8) if digits in REPORT_MODES else REPORT_MODE
    if raw and digits not in REPORT_MODES:
        _not_understood(warnings, f"{PREFIX}_REPORT_MODE", raw, "Using 600")
    return Config(
        enabled=enabled,
        enable=enable,
        disable=_names(env, f"{PREFIX}_DISABLE"),
        device=device,
        strict=strict,
        log_level=log_level,
        warnings=tuple(warnings),
        report_dir=report_dir,
        report_mode=report_mode,
    )
