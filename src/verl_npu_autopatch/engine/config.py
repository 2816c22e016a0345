"""Configuration from the environment, read once at activation.

Kept free of heavy imports (no ``dataclasses``, ``typing``, ``logging``, not even ``__future__``):
it runs on the inactive path of a non-NPU host, where activation must cost well under a millisecond. Problems are
collected as warning texts; the engine logs each once.
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

#: A warning shows at most this many characters of a value (and says how long it is) ...
SHOWN = 60
#: ... and names this many unknown patch names one by one per variable, then counts the rest.
NAMES_SHOWN = 3

#: The report files' mode unless ``VERL_NPU_AUTOPATCH_REPORT_MODE`` says otherwise: only their owner reads them.
REPORT_MODE = 0o600
#: The modes ``VERL_NPU_AUTOPATCH_REPORT_MODE`` may give: the owner's read and write, plus read for group or others.
REPORT_MODES = ("600", "640", "604", "644")

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

#: How close (``difflib`` ratio) a variable name must be to a known name, and its first
#: ``len(PREFIX)`` characters to the prefix, to be taken for a misspelling.
NEAR_NAME, NEAR_PREFIX = 0.9, 0.85


def unknown_variables(environ: "Mapping[str, str] | None" = None) -> "list[tuple[str, str]]":
    """``(name, closest known name or "")`` for each variable of ``environ`` that looks meant for
    this package but is not one it reads: ``VERL_NPU_AUTOPATCH_*`` names it does not know
    (``..._DISABLED``) and near misses of a known name or of the prefix (``VERL_NPU_AUTOPACH_DISABLE``).
    Only the command line calls this (``status``, ``doctor``, ``bug-report``): start-up and
    activation never look."""
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
        """One short warning per ENABLE/DISABLE entry that names no patch, group or entry point
        in ``known`` (in any case), with the closest known names."""
        folded = _folded(known)
        found = []
        for variable, names in ((f"{PREFIX}_ENABLE", self.enable), (f"{PREFIX}_DISABLE", self.disable)):
            unknown = sorted(name for name in names if name.casefold() not in folded)
            for name in unknown[:NAMES_SHOWN]:
                hint = closest(name, known)
                found.append(
                    f"{variable}: unknown patch or group {shown(name)}; {hint}`verl-npu-autopatch list` shows the names"
                )
            if len(unknown) > NAMES_SHOWN:
                more = len(unknown) - NAMES_SHOWN
                found.append(
                    f"{variable}: {more:,} more unknown patch or group names; `verl-npu-autopatch list` shows the names"
                )
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


def _flag(environ: "Mapping[str, str]", name: str, default: bool, warnings: list[str]) -> bool:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = flag(raw)
    if value is not None:
        return value
    fallback = "on" if default else "off"
    warnings.append(f"{name}={shown(raw)} is not understood; accepted values: {VARIABLES[name]}. Using {fallback}.")
    return default


def _names(environ: "Mapping[str, str]", name: str) -> frozenset[str]:
    """The names a list variable holds: separated by commas, spaces or newlines (a YAML ``|`` block)."""
    return frozenset(environ.get(name, "").replace(",", " ").split())


def _folded(names: "Iterable[str]") -> "set[str]":
    """``names`` in one case, as ENABLE and DISABLE compare them."""
    return set(map(str.casefold, names))


def _report_dir(environ: "Mapping[str, str]", warnings: list[str]) -> str:
    """``VERL_NPU_AUTOPATCH_REPORT_DIR`` with ``~`` expanded; a relative path (each process would
    write under its own working directory) is refused with a warning: no report file then."""
    name = f"{PREFIX}_REPORT_DIR"
    raw = environ.get(name, "").strip()
    path = os.path.expanduser(raw)
    if path and not os.path.isabs(path):
        warnings.append(f"{name}={shown(raw)} is not an absolute path (nor ~/...); no report file is written.")
        return ""
    return path


def _report_mode(environ: "Mapping[str, str]", warnings: list[str]) -> int:
    name = f"{PREFIX}_REPORT_MODE"
    raw = environ.get(name, "").strip()
    digits = raw.lower().removeprefix("0o").lstrip("0")
    if not raw or digits in REPORT_MODES:
        return int(digits, 8) if raw else REPORT_MODE
    warnings.append(f"{name}={shown(raw)} is not understood; accepted values: {VARIABLES[name]}. Using 600.")
    return REPORT_MODE


def read_config(environ: "Mapping[str, str] | None" = None) -> Config:
    """Parse the configuration variables; bad values keep their defaults and add a warning."""
    env = os.environ if environ is None else environ
    warnings: list[str] = []
    enabled = _flag(env, PREFIX, True, warnings)
    strict = _flag(env, f"{PREFIX}_STRICT", False, warnings)

    device = env.get(f"{PREFIX}_DEVICE", "").strip().lower() or "auto"
    if device not in DEVICES:
        warnings.append(
            f"{PREFIX}_DEVICE={shown(env[f'{PREFIX}_DEVICE'])} is not understood; "
            f"accepted values: {VARIABLES[f'{PREFIX}_DEVICE']}. Using auto."
        )
        device = "auto"

    log_level = env.get(f"{PREFIX}_LOG", "").strip().upper() or None
    if log_level is not None and log_level not in LOG_LEVELS:
        warnings.append(
            f"{PREFIX}_LOG={shown(env[f'{PREFIX}_LOG'])} is not understood; "
            f"accepted values: {', '.join(LOG_LEVELS)}. Keeping the logger's level."
        )
        log_level = None

    enable = _names(env, f"{PREFIX}_ENABLE")
    if _flag(env, LEGACY_GLM52, False, warnings):
        enable |= {"glm52"}

    report_dir, report_mode = _report_dir(env, warnings), _report_mode(env, warnings)
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
