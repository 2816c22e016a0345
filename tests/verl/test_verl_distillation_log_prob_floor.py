"""``verl.distillation_log_prob_floor`` on verl's real code: the release's
``compute_distillation_loss_reverse_kl_estimator`` with its real ``kl_penalty``,
``no_padding_2_padding``, ``tensordict_utils`` and ``Metric``, run from the release files (the
wheel's package ``__init__`` chain, which needs Ray, Hydra and transformers, is not executed)."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict

from tests.support import release_loaders, upstream
from tests.verl.helpers import record, start, verl_files
from verl_npu_autopatch.patches import verl_distillation_log_prob_floor as floor_patch

NAME = "verl.distillation_log_prob_floor"
LOSSES = floor_patch.MODULE
#: The names verl 0.9.1 registers the estimator under.
ESTIMATOR_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
INF = float("inf")


def _losses_module(root: Path) -> types.ModuleType:
    """verl's ``losses.py`` holding the estimator, over verl's real helpers, with its registry
    filled as verl's decorator fills it."""
    tensordict_utils = upstream.load_file(root / "verl/utils/tensordict_utils.py", "verl.utils.tensordict_utils")
    metric = upstream.load_file(root / "verl/utils/metric/utils.py", "verl.utils.metric.utils")
    core = upstream.load_subset(
        root / "verl/trainer/ppo/core_algos.py",
        "verl.trainer.ppo.core_algos",
        {},
        ("kl_penalty", "kl_penalty_forward"),
        namespace={"torch": torch},
    )
    padding = upstream.load_subset(
        root / "verl/workers/utils/padding.py",
        "verl.workers.utils.padding",
        {},
        ("no_padding_2_padding",),
        namespace={"torch": torch, "F": F, "TensorDict": TensorDict, "tu": tensordict_utils},
    )
    losses = upstream.load_subset(
        root / "verl/trainer/distillation/losses.py",
        LOSSES,
        {},
        (floor_patch.FUNCTION,),
        namespace={
            "torch": torch,
            "TensorDict": TensorDict,
            "Any": Any,
            **{name: object for name in ("ActorConfig", "DistillationConfig", "DistillationLossConfig")},
            "kl_penalty": core.kl_penalty,
            "no_padding_2_padding": padding.no_padding_2_padding,
            "Metric": metric.Metric,
            "AggregationType": metric.AggregationType,
        },
    )
    estimator = getattr(losses, floor_patch.FUNCTION)
    losses.DISTILLATION_LOSS_REGISTRY = {name: estimator for name in ESTIMATOR_NAMES}
    return losses


@release_loaders.loads(
    floor_patch,
    "verl",
    ("0.8.0", "0.9.0", "0.9.1"),
    sites={
        "0.9.1": {
            f"{LOSSES}:{floor_patch.PATCHES[0].targets[0].qualname}",
            *(f"{LOSSES}:DISTILLATION_LOSS_REGISTRY[{name}]" for name in ESTIMATOR_NAMES),
        }
    },
)
@pytest.fixture
def verl_losses(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install a release's losses module under its real name (and a bare ``verl`` package so the
    engine's "is verl installed" gate holds); returns a loader ``version -> module``."""

    def install(version: str) -> types.ModuleType:
        module = _losses_module(verl_files(version))
        monkeypatch.setitem(sys.modules, "verl", types.ModuleType("verl"))
        monkeypatch.setitem(sys.modules, LOSSES, module)
        return module

    return install


def _config(clamp: float | None, mode: str = "k1") -> Any:
    loss = types.SimpleNamespace(loss_mode=mode, log_prob_min_clamp=clamp)
    return types.SimpleNamespace(distillation_loss=loss)


def _batch() -> tuple[dict, TensorDict]:
    """Two sequences, prompt 2 and response 3 tokens each, in verl's no-padding layout: the
    student's log-probs of response token i sit at position prompt_len + i - 1 of the sequence.
    Response tokens: (both -inf, student -inf, finite) and (finite, teacher -inf, finite); the teacher's
    log-probs are a jagged tensor ``[batch, sequence, 1]`` in the same layout."""
    student = torch.tensor([0.0, -INF, -INF, -1.0, 0.0, 0.0, -2.0, -0.5, -3.0, 0.0])
    teacher = torch.tensor([0.0, -INF, -2.0, -1.5, 0.0, 0.0, -2.5, -INF, -3.0, 0.0]).unsqueeze(-1)
    data = TensorDict(
        {
            "prompts": torch.ones(2, 2, dtype=torch.long),
            "responses": torch.ones(2, 3, dtype=torch.long),
            "attention_mask": torch.ones(2, 5, dtype=torch.long),
            "response_mask": torch.ones(2, 3, dtype=torch.long),
            "teacher_logprobs": torch.nested.nested_tensor([teacher[:5], teacher[5:]], layout=torch.jagged),
        },
        batch_size=[2],
    )
    return {"log_probs": student}, data


def _run(losses: types.ModuleType, clamp: float | None, name: str = "k1") -> tuple[torch.Tensor, dict]:
    output, data = _batch()
    estimator = losses.DISTILLATION_LOSS_REGISTRY[name]  # how verl's distillation_loss finds it
    return estimator(config=None, distillation_config=_config(clamp, name), model_output=output, data=data)


def test_the_real_0_9_1_estimator_gives_nan(verl_losses: Any) -> None:
    losses, metrics = _run(verl_losses("0.9.1"), clamp=-10.0)
    assert torch.isnan(losses[0, 0]), "-inf - (-inf)"
    assert torch.isinf(losses).any()
    assert math.isnan(metrics["distillation/abs_loss"].values[0])


@pytest.mark.parametrize("version", ["0.8.0", "0.9.1"])
def test_with_the_patch_the_loss_is_finite_and_floored(verl_losses: Any, engines: list, version: str) -> None:
    losses_module = verl_losses(version)
    engine = start(engines, floor_patch.PATCHES)
    assert record(engine, NAME) == ("applied", "fix installed")
    wrapper = getattr(losses_module, floor_patch.FUNCTION)
    assert set(losses_module.DISTILLATION_LOSS_REGISTRY.values()) == {wrapper}, "every registry entry rebound"

    output, data = _batch()
    losses, metrics = losses_module.DISTILLATION_LOSS_REGISTRY["k1"](
        config=None, distillation_config=_config(-10.0), model_output=output, data=data
    )
    expected = torch.tensor([[-10.0 - -10.0, -10.0 - -2.0, -1.0 - -1.5], [-2.0 - -2.5, -0.5 - -10.0, -3.0 - -3.0]])
    assert torch.equal(losses, expected)
    assert math.isfinite(metrics["distillation/abs_loss"].values[0])
    assert torch.isinf(output["log_probs"]).any() and torch.isinf(data["teacher_logprobs"]).any(), "inputs untouched"

    low_var, _ = _run(losses_module, clamp=-10.0, name="low_var_kl")
    assert torch.isfinite(low_var).all()
    unset, _ = _run(losses_module, clamp=None)
    assert torch.isnan(unset[0, 0]), "log_prob_min_clamp=None keeps verl's behaviour"

    engine.revert()
    assert set(losses_module.DISTILLATION_LOSS_REGISTRY.values()) == {getattr(losses_module, floor_patch.FUNCTION)}
    assert torch.isnan(_run(losses_module, clamp=-10.0)[0][0, 0])


def test_nested_log_probs_are_floored_and_stay_nested(verl_losses: Any, engines: list) -> None:
    losses_module = verl_losses("0.9.1")
    start(engines, floor_patch.PATCHES)
    output, data = _batch()
    student = output["log_probs"]
    nested = torch.nested.nested_tensor([student[:5], student[5:]], layout=torch.jagged)
    losses, _ = losses_module.DISTILLATION_LOSS_REGISTRY["k3"](
        config=None, distillation_config=_config(-10.0, "k3"), model_output={"log_probs": nested}, data=data
    )
    assert torch.isfinite(losses).all()
