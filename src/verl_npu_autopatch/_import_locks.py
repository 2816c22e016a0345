"""The import system's own deadlock bookkeeping, read by the engine while another thread activates,
and the depth of the stack an activation runs at."""

import _thread
import sys


def blocked_on_us(activator: int) -> bool:
    """Whether thread ``activator`` waits, through a chain of module locks, for one this thread
    holds (read from the import system's own deadlock bookkeeping, ``_blocking_on``; ``False``
    where it is not there): an import held for the activation must then go on, or deadlock."""
    try:
        blocking = getattr(sys.modules.get("_frozen_importlib"), "_blocking_on", None)
        me, seen = _thread.get_ident(), set()
        thread: int | None = activator
        while blocking and thread not in seen:
            seen.add(thread)
            locks = blocking.get(thread)
            if locks is None:
                return False
            owners = [getattr(lock, "owner", None) for lock in (locks if isinstance(locks, list) else [locks])]
            if me in owners:
                return True
            thread = next((owner for owner in owners if owner is not None), None)
        return False
    except Exception:  # private CPython bookkeeping whose shape may change: then no deadlock is seen
        return False


def stack_depth() -> int:
    """How many frames deep the caller is (an activation that ran out of stack is retried only
    from a shallower one)."""
    frame, depth = sys._getframe(1), 1
    while frame.f_back is not None:
        frame, depth = frame.f_back, depth + 1
    return depth
