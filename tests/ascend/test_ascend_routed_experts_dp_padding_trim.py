"""``ascend.routed_experts_dp_padding_trim`` on the releases' real captures.

vLLM's ``RoutedExpertsCapturer.capture`` is the paired vLLM release's own method
(``upstream.load_subset``: the file's name and line numbers; the constructor, which needs a whole
engine config, is left out: the test sets the attributes ``capture`` reads). vllm-ascend's is the
release's real ``patch_routed_experts_capture.py``, imported against that class by the stand-in
worker package of ``test_ascend_routed_experts_capture`` (0.25.1rc1 on: as the release imports it
itself, before the trigger fires). The forward context is a double holding the DP counts.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.ascend import doubles
from tests.ascend.test_ascend_routed_experts_capture import stand_in
from tests.support import release_loaders, upstream
from tests.support.contract import QuietHandOver
from verl_npu_autopatch.authoring.fingerprints import imports_module_unconditionally
from verl_npu_autopatch.authoring.spec import Site
from verl_npu_autopatch.engine.records import Record
from verl_npu_autopatch.patches import ascend_routed_experts_capture, ascend_routed_experts_dp_padding_trim
from verl_npu_autopatch.patches._capture_trim import CAPTURE, CAPTURER, RECIPE_MARK, TRIGGER, TRIM

CAPTURE_STATE = "ascend.routed_experts_capture"
FORWARD = types.SimpleNamespace(dp_metadata=None)
LAYERS, TOPK = 2, 2
BOTH = (*ascend_routed_experts_capture.PATCHES, *ascend_routed_experts_dp_padding_trim.PATCHES)


def forward_context() -> types.SimpleNamespace:
    return FORWARD


@release_loaders.loads(
    ascend_routed_experts_dp_padding_trim,
    "vllm-ascend",
    ("0.23.0", "0.30.0rc2"),
    sites={label: {f"{CAPTURER}:RoutedExpertsCapturer.capture"} for label in ("0.23.0", "0.30.0rc2")},
    param=True,
)
@pytest.fixture
def paired(request, releases, npu, tmp_path, monkeypatch) -> Iterator[types.ModuleType]:
    """vllm-ascend ``request.param`` installed over its paired vLLM's capturer module; yields that
    module, whose class holds the capture live once vllm-ascend's worker patches ran."""
    ascend_root, vllm_root = releases[request.param]
    module = upstream.load_subset(
        vllm_root / "vllm/model_executor/layers/fused_moe/routed_experts_capturer.py",
        CAPTURER,
        {"RoutedExpertsCapturer": ("capture",)},
        (),
        {"torch": torch, "get_forward_context": forward_context, "get_tp_group": None},
    )
    monkeypatch.setattr(FORWARD, "dp_metadata", None)
    with doubles.modules({CAPTURER: module}), stand_in(ascend_root, request.param, tmp_path, monkeypatch):
        worker = (ascend_root / "vllm_ascend/patch/worker/__init__.py").read_text(encoding="utf-8")
        if imports_module_unconditionally(worker, CAPTURE):  # the release imports it itself (0.25.1rc1 on)
            _own_context(importlib.import_module(CAPTURE))
        yield module


def _own_context(module: types.ModuleType) -> None:
    """vllm-ascend's capture module reads the forward-context double."""
    module.get_forward_context = forward_context


def capturer(module: types.ModuleType, dp_rank: int) -> Any:
    made = object.__new__(module.RoutedExpertsCapturer)
    made.dp_rank, made.tp_size = dp_rank, 1
    made.device_buffer = torch.zeros((8, LAYERS, TOPK), dtype=torch.int32)
    return made


def capture(module: types.ModuleType, counts: list[int], dp_rank: int, rows: int) -> torch.Tensor:
    """One layer's capture on DP rank ``dp_rank`` of ``counts`` tokens per rank, handed ``rows``
    rows (row i holds i + 1); returns what the buffer holds for this rank's tokens."""
    FORWARD.dp_metadata = types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor(counts))
    made = capturer(module, dp_rank)
    topk_ids = torch.arange(1, rows + 1, dtype=torch.int32).unsqueeze(1).expand(rows, TOPK)
    made.capture(0, topk_ids)
    return made.device_buffer[: counts[dp_rank], 0, 0]


def padded(module: types.ModuleType) -> torch.Tensor:
    """Rank 0 of two (2 and 4 tokens) handed its 2 rows padded to 4: the layout to trim."""
    return capture(module, [2, 4], 0, 4)


@pytest.mark.parametrize("paired", ["0.23.0"], indirect=True)
def test_vllm_capture_raises_on_the_padded_layout_and_is_trimmed(paired):
    original = paired.RoutedExpertsCapturer.__dict__["capture"]
    with pytest.raises(AssertionError, match="unexpected topk_ids batch dim 4"):
        padded(paired)
    engine = upstream.run_engine(ascend_routed_experts_dp_padding_trim.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    record = engine.report()[TRIM]
    assert record.state == "applied", record.reason
    assert record.reason == f"fix installed; wraps {CAPTURER}.RoutedExpertsCapturer.capture"
    assert padded(paired).tolist() == [1, 2]
    assert capture(paired, [2, 4], 1, 6).tolist() == [3, 4, 5, 6]  # the concatenated layout: as before
    assert capture(paired, [2, 4], 1, 4).tolist() == [1, 2, 3, 4]  # the widest rank's own rows: untouched
    assert engine.revert() == [TRIM]
    assert paired.RoutedExpertsCapturer.__dict__["capture"] is original
    with pytest.raises(AssertionError):
        padded(paired)


@pytest.mark.parametrize("paired", ["0.30.0rc2"], indirect=True)
def test_vllm_ascend_capture_raises_on_the_padded_layout_and_is_trimmed(paired):
    ascend = paired.RoutedExpertsCapturer.__dict__["capture"]
    assert ascend.__module__ == CAPTURE  # the release imported its own capture
    with pytest.raises(AssertionError, match="unexpected topk_ids batch dim 4"):
        padded(paired)
    engine = upstream.run_engine(BOTH, VERL_NPU_AUTOPATCH_ENABLE="glm52,dsv4")
    assert engine.report()[CAPTURE_STATE].state == "fixed-upstream"
    assert engine.report()[TRIM].state == "applied", engine.report()[TRIM].reason
    assert engine.report()[TRIM].reason == f"fix installed; wraps {CAPTURE}.capture"
    assert padded(paired).tolist() == [1, 2]
    assert capture(paired, [2, 4], 0, 8).tolist() == [1, 2]  # padded after the all-gather: vllm-ascend's own
    assert engine.revert() == [TRIM]
    assert paired.RoutedExpertsCapturer.__dict__["capture"] is ascend


@pytest.mark.parametrize("paired", ["0.23.0"], indirect=True)
def test_carried_by_the_capture_patch_where_it_loads_vllm_ascends_capture(paired):
    """0.23.0 with the paired vLLM: ``ascend.routed_experts_capture`` loads vllm-ascend's capture,
    which raises on the padded layout too; with both enabled it installs it trimmed, one owner."""
    original = paired.RoutedExpertsCapturer.__dict__["capture"]
    alone = upstream.run_engine(ascend_routed_experts_capture.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="glm52")
    assert alone.report()[CAPTURE_STATE].state == "applied"
    _own_context(sys.modules[CAPTURE])
    with pytest.raises(AssertionError, match="unexpected topk_ids batch dim 4"):
        padded(paired)
    assert alone.revert() == [CAPTURE_STATE]
    assert paired.RoutedExpertsCapturer.__dict__["capture"] is original

    engine = upstream.run_engine(BOTH, VERL_NPU_AUTOPATCH_ENABLE="glm52,dsv4")
    report = engine.report()
    assert report[CAPTURE_STATE].state == "applied"
    assert TRIM in report[CAPTURE_STATE].reason
    assert report[TRIM].state == "yielded"
    assert report[TRIM].reason == f"target owned by {CAPTURE_STATE}, which carries this trim"
    assert padded(paired).tolist() == [1, 2]
    assert capture(paired, [2, 4], 0, 8).tolist() == [1, 2]  # vllm-ascend's padded all-gather layout
    assert engine.revert() == [CAPTURE_STATE]
    assert paired.RoutedExpertsCapturer.__dict__["capture"] is original
    trim = engine.report()[TRIM]  # the trim left with the capture that carried it
    assert (trim.state, trim.reason) == ("reverted", f"reverted with {CAPTURE_STATE}, which held its target")


@pytest.mark.parametrize("paired", ["0.18.0"], indirect=True)
def test_unsupported_where_the_capture_takes_only_the_concatenated_layout(paired):
    original = paired.RoutedExpertsCapturer.__dict__["capture"]
    record = upstream.run_engine(ascend_routed_experts_dp_padding_trim.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert record.report()[TRIM].state == "unsupported"
    assert "own rows" in record.report()[TRIM].reason
    assert paired.RoutedExpertsCapturer.__dict__["capture"] is original


@pytest.mark.parametrize("paired", ["0.23.0"], indirect=True)
def test_yields_to_the_recipes_own_trim(paired):
    """verl-ascend-recipe's ``npu_vllm_patch.py`` applied first: its wrapper stays, ours yields."""
    original = paired.RoutedExpertsCapturer.__dict__["capture"]

    def recipe(self, layer_id, topk_ids):  # the recipe's wrapper, reduced to its marker
        return original(self, layer_id, topk_ids)

    setattr(recipe, RECIPE_MARK, True)
    paired.RoutedExpertsCapturer.capture = recipe
    record = upstream.run_engine(ascend_routed_experts_dp_padding_trim.PATCHES, VERL_NPU_AUTOPATCH_ENABLE="dsv4")
    assert record.report()[TRIM].state == "yielded"
    assert "verl-ascend-recipe" in record.report()[TRIM].reason
    assert paired.RoutedExpertsCapturer.__dict__["capture"] is recipe


def test_opt_in_off_by_default():
    assert upstream.run_engine(ascend_routed_experts_dp_padding_trim.PATCHES).report()[TRIM].state == "disabled"


class _TrimYielded(QuietHandOver):
    """The engine as ``ascend.routed_experts_capture`` sees it when applied again (its trigger
    module executed anew) after the trim yielded to it."""

    def record(self, name: str) -> Record | None:
        reason = f"target owned by {CAPTURE_STATE}, which carries this trim"
        return Record(TRIM, ("dsv4",), str(TRIGGER), "yielded", reason) if name == TRIM else None


@pytest.mark.parametrize("paired", ["0.23.0"], indirect=True)
def test_applied_again_the_capture_patch_still_carries_the_trim(paired):
    (patch,) = ascend_routed_experts_capture.PATCHES
    worker = sys.modules[TRIGGER.module]
    site = Site(patch, TRIGGER, worker, worker, "__file__", worker.__file__, {}, _TrimYielded())
    assert patch.check(site).reason == ascend_routed_experts_capture.CARRYING
    undo = patch.fix(site)
    try:
        _own_context(sys.modules[CAPTURE])
        assert padded(paired).tolist() == [1, 2]
    finally:
        undo()
