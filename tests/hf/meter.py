"""What a run does on the host, counted: every aten op dispatched and the bytes of fresh storage
the ops allocate (a view or an in-place op allocates none). An emulated NPU op
(:mod:`npu_emulation`) counts as one op allocating its outputs, as on the device: the CPU code
computing it is not counted."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

#: The meter counting now (``None``: none).
ACTIVE: Meter | None = None


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


class Meter(TorchDispatchMode):
    """``with Meter() as meter: ...`` counts ``meter.ops`` and ``meter.bytes``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0

    def __enter__(self) -> Meter:
        global ACTIVE
        self._outer, ACTIVE = ACTIVE, self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        global ACTIVE
        ACTIVE = self._outer
        super().__exit__(*exc)

    def count(self, outputs: Any, inputs: Any) -> None:
        """One op: the storages of ``outputs`` that none of ``inputs`` holds are fresh."""
        self.ops += 1
        seen = {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
        for tensor in _tensors(outputs):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self.bytes += storage.nbytes()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.count(out, (args, kwargs))
        return out


def run_as_one_op(function: Any, inputs: dict[str, Any]) -> Any:
    """``function(**inputs)``, counted by the active meter (if any) as one op, its own work unseen."""
    meter = ACTIVE
    if meter is None:
        return function(**inputs)
    with _disable_current_modes():
        result = function(**inputs)
    meter.count(result, inputs)
    return result
