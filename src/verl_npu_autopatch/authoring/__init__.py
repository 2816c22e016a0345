"""The authoring kit, one way to write a patch (docs/writing-a-patch.md): ``spec`` declares it,
``patching`` checks and fixes live code, ``family`` makes the check, fix and static rule from one
rule over the code ``fingerprints`` reads; ``handover`` is what a fix may ask of the engine,
``verify_case`` a ``doctor --verify`` case (imports torch). Each name resolves lazily."""

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # what a type checker sees; at run time each name resolves lazily
    from verl_npu_autopatch.authoring.family import *  # noqa: F403
    from verl_npu_autopatch.authoring.fingerprints import *  # noqa: F403
    from verl_npu_autopatch.authoring.handover import *  # noqa: F403
    from verl_npu_autopatch.authoring.patching import *  # noqa: F403
    from verl_npu_autopatch.authoring.spec import *  # noqa: F403
    from verl_npu_autopatch.authoring.verify_case import *  # noqa: F403

#: Each module of the kit and the public names it defines.
_KIT = {
    "spec": "APPLY ComputedSites Device fixed_upstream Patch Reach Site StaticRule Target Undo unsupported Verdict",
    "patching": "ABSENT chain definition describe mark marked_by MARKER normalized_source origin own_value"
    " parameter_defaults parameter_names replace_method set_attribute set_entry set_marked signature_from_ast"
    " signature_of signature_text statements underlying",
    "handover": "HandOver",
    "family": "around code_check copied_into copies_only decides module_file RECIPE rule_patch TargetRule wrapping_fix"
    " wrapping_patch",
    "fingerprints": "Code definition_defaults imports_module_unconditionally ModuleSource params_mismatch takes"
    " UpstreamTree",
    "verify_case": "Call Case leaf placed replaced resolve Unverifiable",
}
_WHERE = {name: module for module, names in _KIT.items() for name in names.split()}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> object:
    module = _WHERE.get(name)
    if module is None:  # also every submodule not imported yet: the import system asks first
        raise AttributeError(f"module 'verl_npu_autopatch.authoring' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"verl_npu_autopatch.authoring.{module}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _moved(module: str) -> None:
    """Hand the kit's ``module`` back under its path of before 0.2, ``verl_npu_autopatch.<module>``
    (until 0.3), with a ``DeprecationWarning`` at the import naming its successor."""
    import warnings
    from importlib import import_module

    successor = f"verl_npu_autopatch.authoring.{module}"
    message = (
        f"verl_npu_autopatch.{module} moved to {successor} (or import its names from verl_npu_autopatch.authoring)"
    )
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    sys.modules[f"verl_npu_autopatch.{module}"] = import_module(successor)
