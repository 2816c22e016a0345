"""vLLM ``vllm.general_plugins`` entry point: a second trigger inside every vLLM process.

vLLM loads general plugins in its front-end, EngineCore and worker processes. Where the ``.pth``
start-up hook already ran this is a no-op; where it did not (``python -S``, embedded
interpreters), it activates the engine before vLLM builds any layer.
"""

from __future__ import annotations


def register() -> None:
    """Activate the engine (idempotent, never raises)."""
    try:
        from verl_npu_autopatch.engine.lifecycle import activate

        activate(trigger="vllm.general_plugins")
    except Exception:  # pragma: no cover - activation records its own failures
        pass
