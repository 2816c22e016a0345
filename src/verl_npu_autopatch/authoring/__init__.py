"""The authoring kit: everything a patch is written with, built-in families and plugins alike.

One way to write a patch (docs/writing-a-patch.md): declare it with ``Patch`` and ``Target``
(``spec``), check and fix the live code with the helpers of ``patching``, or let ``family`` make
the check, fix and static rule from one rule over the code (``fingerprints``: what a rule reads).
``HandOver`` is what a fix may ask of the engine; ``verify_case`` the shape of a ``doctor --verify``
case (imports torch). Every name resolves lazily, from the module named beside it.
"""

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
