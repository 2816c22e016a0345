"""``verl.distillation_log_prob_floor``: verl's sampled reverse-KL distillation loss floors both
log-probabilities at ``log_prob_min_clamp`` before the KL estimator, so ``-inf`` never reaches it.

``compute_distillation_loss_reverse_kl_estimator`` (verl 0.8.0 to 0.9.1; the estimator losses
``kl``, ``k1``, ``abs``, ``mse``, ``k2``, ``low_var_kl``, ``k3``) hands the student's and the
teacher's log-probabilities straight to ``kl_penalty``. A backend returning ``-inf`` for a token
(very low probability, masking, precision limits) makes ``k1 = -inf - (-inf) = NaN`` (or
``+-inf``); ``loss_max_clamp`` cannot repair a NaN, and the loss-range and ``abs_loss`` metrics
are computed before it. The top-k losses already floor at ``DistillationLossConfig.log_prob_min_clamp``
(-10 by default); verl PR #7333 (unmerged) makes the estimator do the same (the recipe's
``opd/patch/verl_opd_ascend.patch``).

The fix wraps the estimator: when ``log_prob_min_clamp`` is set it passes the original a copy of
``model_output`` whose ``log_probs`` and a shallow copy of ``data`` whose ``teacher_logprobs`` are
floored (``clamp_min``; nested tensors stay nested), and changes nothing else: the caller's
tensors are left as they are, and ``None`` keeps the original behaviour. Floor-then-pad equals
pad-then-floor here (the padding is 0, above any floor). verl looks the loss up in
``DISTILLATION_LOSS_REGISTRY``, filled by its decorator at import, so the fix rebinds every entry
holding the original function too (computed sites). Decided from the code: an estimator that
reads ``log_prob_min_clamp`` itself is fixed upstream.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    ComputedSites,
    Reach,
    Site,
    Undo,
    Verdict,
    chain,
    decides,
    fixed_upstream,
    replace_method,
    rule_patch,
    set_entry,
    unsupported,
)

MODULE = "verl.trainer.distillation.losses"
FUNCTION = "compute_distillation_loss_reverse_kl_estimator"
REGISTRY = "DISTILLATION_LOSS_REGISTRY"
PARAMS = ("config", "distillation_config", "model_output", "data")
#: What the releases pass to the estimator, unfloored.
UNFLOORED = ('model_output["log_probs"]', 'data["teacher_logprobs"]', "kl_penalty(logprob=student_log_probs")


@decides(f"{MODULE}:{FUNCTION}", PARAMS)
def estimator_rule(code: Code) -> Verdict:
    if code.has("log_prob_min_clamp"):
        return fixed_upstream(f"{FUNCTION} already floors the log-probabilities at log_prob_min_clamp")
    if not code.has(*UNFLOORED):
        return unsupported("the estimator passing model_output/teacher log-probs to kl_penalty", "another body")
    return APPLY


def _floored(floor: float, model_output: Any, data: Any) -> tuple[Any, Any]:
    """``(model_output, data)`` with both log-probabilities floored at ``floor`` (copies)."""
    output = {**model_output, "log_probs": model_output["log_probs"].clamp_min(floor)}
    view = data.copy()  # shallow: the caller's TensorDict keeps its teacher log-probs
    view["teacher_logprobs"] = data["teacher_logprobs"].clamp_min(floor)
    return output, view


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def estimator(config: Any, distillation_config: Any, model_output: Any, data: Any) -> Any:
        floor = getattr(distillation_config.distillation_loss, "log_prob_min_clamp", None)
        if floor is None:
            return original(config, distillation_config, model_output, data)
        output, view = _floored(floor, model_output, data)
        return original(config=config, distillation_config=distillation_config, model_output=output, data=view)

    return estimator


def registry_sites(module: ModuleType) -> tuple[str, ...]:
    """The registry entries holding the live estimator (``DISTILLATION_LOSS_REGISTRY[k1]``, ...)."""
    live = getattr(module, FUNCTION, None)
    table = getattr(module, REGISTRY, None) or {}
    return tuple(f"{REGISTRY}[{key}]" for key, value in table.items() if value is live)


def _fix(site: Site) -> Undo:
    table = getattr(site.module, REGISTRY, None) or {}
    keys = [key for key, value in table.items() if value is site.value]
    undo = replace_method(site.owner, site.attribute, _wrap, site.patch.name)
    installed = getattr(site.owner, site.attribute)
    return chain(undo, *(set_entry(table, key, installed) for key in keys))


PATCHES = [
    rule_patch(
        "verl.distillation_log_prob_floor",
        "verl's reverse-KL estimator distillation loss floors -inf log-probs at log_prob_min_clamp (no NaN).",
        rule=estimator_rule,
        fix=_fix,
        reach=Reach(computed=(ComputedSites(MODULE, f"{REGISTRY}[<estimator loss name>]", registry_sites),)),
        groups=("verl", "distillation"),
        reference="https://github.com/verl-project/verl/pull/7333",
    ),
]
