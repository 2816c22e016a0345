"""``verl.checkpoint_send_reoffload``: after a checkpoint-engine weight send, verl's actor goes
back to the CPU when parameter offload is on.

``ActorRolloutRefWorker.update_weights`` (verl 0.8.0 to 0.9.1) sends the weights through the
checkpoint engine when the sync mode is not ``naive`` (trainer and rollout disaggregated).
``get_per_tensor_param`` loads an offloaded actor's parameters onto the device to send them, and
that path returns without offloading them again, unlike the ``naive`` path: the actor's weights stay
on the NPU until the next training step, memory the rollout or the next stage needs (verl PR #7631,
unmerged; the recipe's ``mtp_checkpoint_engine_reoffload.patch``).

The fix wraps the method: after the original returns on that path (not ``naive``, and not
``delta_sharded``, whose engine drives the training engine itself), and only when
``actor.engine.is_param_offload_enabled``, it moves the model (not the optimizer, not the grads)
back to the CPU and empties the device cache with verl's own ``aggressive_empty_cache`` (where the
module imports it), as the
``naive`` path does. Decided from the code: an ``update_weights`` that offloads after
``send_weights(per_tensor_param, ...)`` is fixed upstream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_npu_autopatch.authoring import (
    APPLY,
    Code,
    Verdict,
    around,
    decides,
    fixed_upstream,
    unsupported,
    wrapping_patch,
)

MODULE = "verl.workers.engine_workers"
SEND = "awaitself.checkpoint_engine.send_weights(per_tensor_param"
OFFLOAD = 'engine.to("cpu"'
#: Sync modes whose path the fix leaves alone.
LEFT_ALONE = ("naive", "delta_sharded")


@decides(f"{MODULE}:ActorRolloutRefWorker.update_weights")
def reoffload_rule(code: Code) -> Verdict:
    """Decide on ``ActorRolloutRefWorker.update_weights``: what follows the per-tensor send up to its
    ``return``."""
    source = code.source or ""
    if SEND not in source:
        return unsupported("update_weights sending per_tensor_param through the checkpoint engine", "another body")
    after = source[source.index(SEND) :]
    branch = after[: after.find("return")] if "return" in after else after
    if OFFLOAD in branch:
        return fixed_upstream("update_weights offloads the actor after the checkpoint-engine send")
    return APPLY


async def update_weights(original: Callable[..., Any], self: Any, global_steps: Any = None, mode: str = "auto") -> Any:
    """The release's ``update_weights``; then, on a checkpoint-engine path, the actor offloaded again."""
    result = await original(self, global_steps=global_steps, mode=mode)
    effective = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
    engine = self.actor.engine
    if effective not in LEFT_ALONE and engine.is_param_offload_enabled:
        engine.to("cpu", model=True, optimizer=False, grad=False)
        free = original.__globals__.get("aggressive_empty_cache")  # verl's, imported by the module
        if free is not None:
            free(force_sync=True)
    return result


PATCHES = [
    wrapping_patch(
        "verl.checkpoint_send_reoffload",
        "verl's actor is offloaded again after a checkpoint-engine weight send (parameter offload on).",
        rule=reoffload_rule,
        wrap=around(update_weights),
        reference="https://github.com/verl-project/verl/pull/7631",
    ),
]
