"""What a fix may ask of the engine applying it (``site.handover``), for families that arbitrate with
other patches (Liger-Kernel's, verl's); the engine implements it, tests may pass any such object."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from verl_npu_autopatch.engine.records import Record

__all__ = ["HandOver"]


class HandOver(Protocol):
    """Hand-over between one process's patches."""

    def record(self, name: str) -> Record | None:
        """A copy of patch ``name``'s record as it stands, or ``None`` for an unknown name."""

    def note(self, name: str, text: str) -> None:
        """Add ``text`` to the reason of patch ``name`` while it is applied."""

    def yield_to(self, name: str, owner: str) -> bool:
        """Hand patch ``name``'s target to ``owner``: undo it if applied (the result), record ``yielded``."""

    def reapply(self, name: str, when: Callable[[Any], bool]) -> bool:
        """Decide and apply ``name`` afresh where ``when(value)`` holds for another owner's value over
        ours; whether ``name`` is applied now."""
