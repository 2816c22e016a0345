"""Start-up hook run by ``verl_npu_autopatch.pth`` / ``.start`` in every interpreter.

Standard library only, and only what ``python -c pass`` has already loaded. It installs one
observer at the front of ``sys.meta_path``; the observer ignores every import except the first
import of a watched top-level package, which wakes the engine up. Nothing here raises, prints or
writes.
"""

import os
import sys

#: Top-level packages whose first import activates the engine. ``tests`` check that every
#: built-in patch target lives under one of these.
WATCHED = frozenset({"vllm", "vllm_ascend", "transformers", "liger_kernel"})

_FALSY = frozenset({"0", "false", "no", "off"})


def switched_off() -> bool:
    """True when ``VERL_NPU_AUTOPATCH`` is falsy (``0``, ``false``, ``no``, ``off``, any case)."""
    return os.environ.get("VERL_NPU_AUTOPATCH", "").strip().lower() in _FALSY


class Observer:
    """Meta-path finder that never finds anything; it only notices the first watched import."""

    verl_npu_autopatch_observer = True

    def __init__(self) -> None:
        self.watched = WATCHED

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.watched:
            return None
        return self.wake(fullname, path, target)

    def wake(self, fullname, path, target):
        """Activate the engine, then let the other finders (wrapt's first) resolve ``fullname``."""
        self.remove()
        try:
            from verl_npu_autopatch.engine import activate

            activate(trigger=fullname)
        except Exception:  # the engine records its own failures; never break the import
            return None
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def installed_observer():
    """The observer on ``sys.meta_path``, or ``None``."""
    for finder in sys.meta_path:
        if getattr(finder, "verl_npu_autopatch_observer", False):
            return finder
    return None


def install() -> None:
    """Entry point of the ``.pth`` line and the PEP 829 ``.start`` file. Idempotent, silent."""
    try:
        if switched_off() or installed_observer() is not None:
            return
        if any(name in sys.modules for name in WATCHED):
            return  # too late to observe: ``activate()`` or the vLLM plugin takes over
        sys.meta_path.insert(0, Observer())
    except Exception:
        pass
