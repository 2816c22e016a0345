"""``tensordict.npu_sync``: ``TensorDictBase._sync_all`` also synchronizes the NPU.

After a non-blocking ``td.to("cpu")`` tensordict calls ``_sync_all`` so the host does not read
tensors still being copied. Before 0.10.0 it synchronizes only CUDA and MPS; on an NPU the host
reads half-copied data (seen in verl as precision errors when workers ship results to the driver;
tensordict issue #725, verl PR #3222). The fix keeps tensordict's own CUDA/MPS guards and then
synchronizes the available accelerator's device module when it is neither of those, as
tensordict 0.10.0 does generically (``fixed-upstream`` there, decided from the live source).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    ModuleSource,
    Site,
    UpstreamTree,
    Verdict,
    decides,
    fixed_upstream,
    unsupported,
    wrapping_patch,
)
from verl_npu_autopatch.patches._verl import yield_to_verl

BASE = "tensordict.base"
#: Where newer releases define ``_sync_all`` (a mixin ``TensorDictBase`` inherits from).
MIXIN_MODULES = ("tensordict._base.device",)
SYNC_PARAMS = ("self",)
#: 0.10.0+: the available device type's module is synchronized, whatever the device.
GENERIC = ("_get_available_device_type()", "_get_device_module(", ".synchronize()")
#: 0.8 - 0.9: CUDA, else MPS, nothing else.
CUDA_MPS_ONLY = ("ifself._has_cuda:", "torch.cuda.synchronize()", "elifself._has_mps:", "mps.synchronize()")


@decides(f"{BASE}:TensorDictBase._sync_all", SYNC_PARAMS)
def sync_rule(sync: Code) -> Verdict:
    if sync.has(*GENERIC):
        return fixed_upstream("_sync_all synchronizes the available device's module (torch._utils._get_device_module)")
    if sync.has(*CUDA_MPS_ONLY):
        return APPLY
    return unsupported(
        "_sync_all synchronizing CUDA (self._has_cuda) else MPS (self._has_mps)", "another _sync_all body"
    )


def _sync_all(site: Site, original: Callable[..., Any]) -> Callable[..., Any]:
    torch = site.module.torch  # tensordict.base's own torch

    @functools.wraps(original)
    def _sync_all(self: Any) -> None:
        original(self)  # tensordict's CUDA / MPS synchronization, guards included
        device_type = torch._utils._get_available_device_type()
        if device_type is None or device_type in ("cuda", "mps"):
            return
        module = getattr(torch, device_type, None)  # torch.npu once torch_npu is loaded
        if module is not None:
            module.synchronize()

    return _sync_all


def _defined_sync_all(source: ModuleSource) -> Code | None:
    """``_sync_all`` of the first top-level class of ``source`` that defines it."""
    for node in source.tree.body:
        code = source.code(f"{node.name}._sync_all") if isinstance(node, ast.ClassDef) else None
        if code is not None:
            return code
    return None


def _static(tree: UpstreamTree) -> Verdict:
    """``sync_rule`` on a release's source (``scripts/compat-matrix``): ``TensorDictBase`` in
    ``tensordict/base.py``, else the mixin module that defines ``_sync_all``."""
    code = tree.code(BASE, "TensorDictBase._sync_all")
    for module in MIXIN_MODULES:
        source = tree.module(module)
        if code is None and source is not None:
            code = _defined_sync_all(source)
    if code is None:
        return unsupported(f"{BASE}:TensorDictBase._sync_all", "no _sync_all in tensordict")
    return sync_rule(code)


PATCHES = [
    wrapping_patch(
        "tensordict.npu_sync",
        "TensorDictBase._sync_all synchronizes the NPU after non-blocking copies, not only CUDA/MPS.",
        rule=sync_rule,
        wrap=_sync_all,
        reads=("tensordict/base.py", "tensordict/_base/device.py"),
        static=_static,
        reference="https://github.com/pytorch/tensordict/issues/725",
        yields_to=(yield_to_verl(),),  # verl's own copy (equivalent) replaces or wraps ours
    ),
]
