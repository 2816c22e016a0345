"""The engine's view of the start-up observer: what it asks of it (:class:`Observer`, for type
checkers) and an observer that does nothing (:class:`NullObserver`).

The process's observer (``_startup.OBSERVER``) is given to the process-wide engine alone, by
``engine``'s composition root; every other engine (tests, tools) gets a :class:`NullObserver`, so
it never touches the process's start-up hook.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Protocol

    class Observer(Protocol):
        """What the engine asks of the start-up observer (``_startup.Observer``): whether the
        start-up hook is in place, which watched import found the host inert, guard imports while
        activating, retire, observe again."""

        woken_inert: str

        def hooked(self) -> bool: ...
        def guard(self, activator: int, packages: Iterable[str] | None = None) -> None: ...
        def retire(self) -> None: ...
        def observe_again(self, hooked: bool) -> None: ...


class NullObserver:
    """An observer that does nothing: no start-up hook, nothing to guard, never woken inert."""

    woken_inert = ""

    def hooked(self) -> bool:
        return False

    def guard(self, activator: int, packages: Iterable[str] | None = None) -> None:
        pass

    def retire(self) -> None:
        pass

    def observe_again(self, hooked: bool) -> None:
        pass
