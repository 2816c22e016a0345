"""The patch contract (``tests/support/contract.py``) for every built-in patch whose target imports
in this suite's environment, on the real upstream modules."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import contract
from tests.verl.test_megatron_async_save_format import megatron_writer  # noqa: F401  (fixture)
from tests.verl.test_megatron_expert_bias_fp32 import megatron_release  # noqa: F401  (fixture)
from tests.verl.test_megatron_layer_offset import megatron_layers  # noqa: F401  (fixture)
from tests.verl.test_megatron_mtp_postprocess import megatron  # noqa: F401  (fixture)
from tests.verl.test_torch_npu_nested_tensor_intercept import standin, torch_npu_standin  # noqa: F401  (fixtures)
from tests.verl.test_verl_3d_position_ids import verl  # noqa: F401  (fixture)
from tests.verl.test_verl_checkpoint_send_reoffload import verl_workers  # noqa: F401  (fixture)
from tests.verl.test_verl_distillation_log_prob_floor import ESTIMATOR_NAMES, verl_losses  # noqa: F401  (fixture)
from tests.verl.test_verl_npu_version_probe import verl_device  # noqa: F401  (fixture)
from verl_npu_autopatch.authoring.spec import Patch
from verl_npu_autopatch.patches import (
    megatron_async_save_format,
    megatron_expert_bias_fp32,
    megatron_layer_offset,
    megatron_mtp_postprocess,
    torch_npu_nested_tensor_intercept,
    verl_3d_position_ids,
    verl_checkpoint_send_reoffload,
    verl_distillation_log_prob_floor,
    verl_npu_version_probe,
)

LIVE = contract.live_patches()


@pytest.mark.parametrize("patch", LIVE, ids=lambda patch: patch.name)
def test_the_patch_keeps_its_contract(patch: Patch) -> None:
    contract.check_contract(patch)


def test_tensordict_sync_is_live_and_applies_on_tensordict_0_9_1() -> None:
    assert [(p.name, contract.check_contract(p).state) for p in LIVE] == [("tensordict.npu_sync", "applied")]


def test_megatron_mtp_on_megatron_core_0_16_1(megatron: Any) -> None:  # noqa: F811  (the fixture)
    megatron("0.16.1")
    (patch,) = contract.live_patches(megatron_mtp_postprocess.PATCHES)
    finding = contract.check_contract(patch)
    assert (finding.state, finding.changed) == ("applied", {f"{megatron_mtp_postprocess.GPT}:GPTModel._postprocess"})


def test_megatron_expert_bias_on_megatron_core_0_16_1(megatron_release: Any) -> None:  # noqa: F811  (the fixture)
    megatron_release("0.16.1")
    (patch,) = contract.live_patches(megatron_expert_bias_fp32.PATCHES)
    finding = contract.check_contract(patch)
    target = f"{megatron_expert_bias_fp32.MODULE}:Float16Module.__init__"
    assert (finding.state, finding.changed) == ("applied", {target})


def test_megatron_layer_offset_on_megatron_core_0_17_0(megatron_layers: Any) -> None:  # noqa: F811  (the fixture)
    megatron_layers("0.17.0")
    (patch,) = contract.live_patches(megatron_layer_offset.PATCHES)
    finding = contract.check_contract(patch)
    name = megatron_layer_offset.FUNCTION
    copies = {"megatron.core.transformer.transformer_block", "megatron.core.models.gpt.gpt_layer_specs"}
    assert finding.state == "applied"
    assert {f"{megatron_layer_offset.MODULE}:{name}", *(f"{m}:{name}" for m in copies)} <= finding.changed


def test_megatron_async_save_format_on_megatron_core_0_12_1(megatron_writer: Any) -> None:  # noqa: F811
    megatron_writer("0.12.1")
    (patch,) = contract.live_patches(megatron_async_save_format.PATCHES)
    finding = contract.check_contract(patch)
    assert (finding.state, finding.changed) == ("applied", {f"{megatron_async_save_format.MODULE}:_write_item"})


def test_verl_distillation_floor_on_verl_0_9_1(verl_losses: Any) -> None:  # noqa: F811  (the fixture)
    verl_losses("0.9.1")
    (patch,) = contract.live_patches(verl_distillation_log_prob_floor.PATCHES)
    finding = contract.check_contract(patch)
    module = verl_distillation_log_prob_floor.MODULE
    entries = {f"{module}:DISTILLATION_LOSS_REGISTRY[{name}]" for name in ESTIMATOR_NAMES}
    assert (finding.state, finding.changed) == ("applied", {f"{module}:{patch.targets[0].qualname}", *entries})


def test_verl_npu_version_probe_on_verl_0_9_1(verl_device: Any) -> None:  # noqa: F811  (the fixture)
    verl_device("0.9.1")
    (patch,) = contract.live_patches(verl_npu_version_probe.PATCHES)
    finding = contract.check_contract(patch)
    assert (finding.state, finding.changed) == ("applied", {f"{verl_npu_version_probe.MODULE}:get_npu_versions"})


def test_verl_checkpoint_send_reoffload_on_verl_0_9_1(verl_workers: Any) -> None:  # noqa: F811  (the fixture)
    verl_workers("0.9.1")
    (patch,) = contract.live_patches(verl_checkpoint_send_reoffload.PATCHES)
    finding = contract.check_contract(patch)
    target = f"{verl_checkpoint_send_reoffload.MODULE}:ActorRolloutRefWorker.update_weights"
    assert (finding.state, finding.changed) == ("applied", {target})


def test_torch_npu_nested_intercept_on_the_stand_in(standin: None) -> None:  # noqa: F811  (the fixture)
    import torch_npu  # noqa: F401  (the stand-in: torch_npu's intercept over torch.nested)

    (patch,) = contract.live_patches(torch_npu_nested_tensor_intercept.PATCHES)
    finding = contract.check_contract(patch)
    functions = {f"torch_npu:torch.nested.{name}" for name in torch_npu_nested_tensor_intercept.FUNCTIONS}
    assert (finding.state, finding.changed) == ("applied", functions)


def test_verl_3d_position_ids_on_verl_0_9_1(verl: Any) -> None:  # noqa: F811  (the fixture)
    """The release's ``tensordict_utils`` and the copies its engine modules take of the function."""
    verl("0.9.1")
    (patch,) = contract.live_patches(verl_3d_position_ids.PATCHES)
    finding = contract.check_contract(patch)
    name = verl_3d_position_ids.FUNCTION
    copies = {f"{module}:{name}" for module in verl_3d_position_ids.COPIERS}
    assert (finding.state, finding.changed) == ("applied", {f"{verl_3d_position_ids.MODULE}:{name}", *copies})
