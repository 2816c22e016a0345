"""The hand-over interface a fix receives as ``site.handover``: what a patch family that arbitrates
with other patches (Liger-Kernel's, verl's) may ask of the engine applying it, and nothing else.

The engine implements it; tests and plugin authors may pass any object with these methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from verl_npu_autopatch.engine.records import Record

__all__ = ["HandOver"]


class HandOver(Protocol):
    """Hand-over between one process's patches."""

    def record(self, name: str) -> Record | None:
        """A copy of patch ``name``'s record as it stands, or ``None`` for an unknown name."""
        ...

    def note(self, name: str, text: str) -> None:
        """Add ``text`` to the reason of patch ``name`` while it is applied."""
        ...

    def yield_to(self, name: str, owner: str) -> bool:
        """Hand patch ``name``'s target to ``owner``: undo it if applied, record ``yielded``.
        Returns whether it was applied before."""
        ...

    def reapply(self, name: str, when: Callable[[Any], bool]) -> bool:
        """Decide and apply patch ``name`` afresh when ``when(live value)`` holds for what another
        owner put over our installed value. Returns whether ``name`` is applied now."""
        ...
