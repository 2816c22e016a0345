"""What the engine asks of the start-up observer (``ObserverControls``, which ``_startup.Observer`` has;
for type checkers), and the observer that does nothing (:class:`NullObserver`): every engine's but
the process-wide one, which the composition root in ``engine.py`` gives the live ``OBSERVER``.
Standard library only, nothing imported at run time (it is on the engine's import path)."""

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Protocol

    class ObserverControls(Protocol):
        """What the engine asks of the start-up observer (``_startup.Observer``): whether the
        start-up hook is in place, which watched import found the host inactive, guard imports while
        activating, retire, observe again."""

        woken_inactive: str

        def hooked(self) -> bool: ...
        def guard(self, activator: int, packages: "Iterable[str] | None" = None) -> None: ...
        def retire(self) -> None: ...
        def observe_again(self, hooked: bool) -> None: ...


class NullObserver:
    """An observer that does nothing: no start-up hook, nothing to guard, never woken inactive. The
    process's observer (``_startup.OBSERVER``) is the process-wide engine's alone; every other
    engine (tests, tools) gets this one, so it never touches the process's start-up hook."""

    woken_inactive = ""

    def hooked(self) -> bool:
        return False

    def guard(self, activator: int, packages: "Iterable[str] | None" = None) -> None:
        pass

    def retire(self) -> None:
        pass

    def observe_again(self, hooked: bool) -> None:
        pass
