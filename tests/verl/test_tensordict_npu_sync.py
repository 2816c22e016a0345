"""``tensordict.npu_sync`` on the real tensordict 0.9.1 (installed; the newest release verl allows
that lacks the generic device sync) and on the real 0.10.0 source (which has it)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import tensordict
import tensordict.base
import torch
import torch._utils
from tensordict import TensorDict

from tests.support import upstream
from tests.verl.helpers import record, release_root, start
from verl_npu_autopatch.authoring.fingerprints import Code
from verl_npu_autopatch.patches import tensordict_npu_sync

NAME = "tensordict.npu_sync"


class CountingDevice:
    """Stand-in for a device module (``torch.npu``): available, counts ``synchronize`` calls."""

    def __init__(self) -> None:
        self.synchronized = 0

    def is_available(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.synchronized += 1


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> CountingDevice:
    """``torch.npu`` is a counting stand-in and the available device type is forced to ``npu``."""
    device = CountingDevice()
    monkeypatch.setattr(torch, "npu", device, raising=False)
    monkeypatch.setattr(torch._utils, "_get_available_device_type", lambda: "npu")
    return device


def _batch() -> TensorDict:
    return TensorDict({"logits": torch.randn(4, 3), "extra": {"ids": torch.arange(4)}}, batch_size=[4])


def test_installed_release_is_the_one_without_the_fix():
    assert tensordict.__version__ == "0.9.1"
    assert "_get_device_module" not in (Code.live(tensordict.base.TensorDictBase._sync_all).source or "")


def test_non_blocking_copy_synchronizes_the_npu_after_the_patch_only(npu: CountingDevice, engines: list) -> None:
    _batch().to("cpu")  # non_blocking=None: tensordict copies non-blocking and then calls _sync_all
    assert npu.synchronized == 0, "tensordict 0.9.1 alone never synchronizes a non-CUDA/MPS device"

    engine = start(engines, tensordict_npu_sync.PATCHES)
    assert record(engine, NAME) == ("applied", "fix installed")
    moved = _batch().to("cpu")
    assert npu.synchronized == 1
    assert moved["extra", "ids"].tolist() == [0, 1, 2, 3]

    _batch().to("cpu", non_blocking=True)  # the caller asked for no sync: none is added
    assert npu.synchronized == 1

    engine.revert()
    _batch().to("cpu")
    assert npu.synchronized == 1


def test_cuda_guards_still_hold(monkeypatch: pytest.MonkeyPatch, npu: CountingDevice, engines: list) -> None:
    start(engines, tensordict_npu_sync.PATCHES)
    calls: list[str] = []
    initialized = [False]
    monkeypatch.setattr(torch._utils, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("cuda"))
    td = _batch()
    td.__dict__["_has_cuda_val"] = True  # tensordict's cached torch.cuda.is_available()

    td._sync_all()
    assert calls == [], "CUDA not initialized: tensordict's guard skips the sync, and so do we"
    initialized[0] = True
    td._sync_all()
    assert calls == ["cuda"]
    assert npu.synchronized == 0, "on CUDA only CUDA is synchronized"


def test_check_on_the_real_0_10_0_source_records_fixed_upstream(monkeypatch: pytest.MonkeyPatch, engines: list):
    root = release_root("tensordict", "0.10.0")
    namespace: dict[str, Any] = {"torch": torch}
    base = upstream.load_subset(
        root / "tensordict" / "base.py", "tensordict.base", {"TensorDictBase": ("_sync_all",)}, namespace=namespace
    )
    monkeypatch.setitem(sys.modules, "tensordict.base", base)  # the hook fires on this module

    engine = start(engines, tensordict_npu_sync.PATCHES)
    state, reason = record(engine, NAME)
    assert state == "fixed-upstream"
    assert "_get_device_module" in reason
    assert not hasattr(base.TensorDictBase._sync_all, "__verl_npu_autopatch__")


def test_unknown_body_is_unsupported() -> None:
    code = Code("defsync(self):pass", ("self",))
    assert tensordict_npu_sync.sync_rule(code).action == "unsupported"
    assert tensordict_npu_sync.sync_rule(Code("", ("self", "x"))).action == "unsupported"
