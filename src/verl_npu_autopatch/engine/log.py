"""The package's one logger, the level of each record state, and the stderr handler
``VERL_NPU_AUTOPATCH_LOG`` turns on. ``logging`` is imported only when a line is logged."""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging
    from typing import Any

    from verl_npu_autopatch.engine.config import Config
    from verl_npu_autopatch.engine.records import RecordState

__all__ = ["LOGGER_NAME", "Quiet", "configure", "level_of", "logger"]

LOGGER_NAME = "verl_npu_autopatch"

#: Logging level of each record state (others: INFO, so ``VERL_NPU_AUTOPATCH_LOG=INFO`` shows every decision).
_LEVELS: dict[RecordState, int] = {"failed": 40, "superseded": 30, "unsupported": 30}


def logger() -> Quiet:
    """Our logger, through :class:`Quiet`."""
    import logging

    return Quiet(logging.getLogger(LOGGER_NAME))


class Quiet:
    """A logger whose calls never raise: another's handler or filter that fails on a record of ours
    (an ``emit`` without ``handleError``, a filter reading the application's own fields) must not
    fail the user's import; the decision is in the record all the same."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def log(self, level: int, msg: str, *args: object, **kwargs: Any) -> None:
        self._say(level, msg, args, kwargs)

    def debug(self, msg: str, *args: object, **kwargs: Any) -> None:
        self._say(10, msg, args, kwargs)

    def info(self, msg: str, *args: object, **kwargs: Any) -> None:
        self._say(20, msg, args, kwargs)

    def warning(self, msg: str, *args: object, **kwargs: Any) -> None:
        self._say(30, msg, args, kwargs)

    def error(self, msg: str, *args: object, **kwargs: Any) -> None:
        self._say(40, msg, args, kwargs)

    def _say(self, level: int, msg: str, args: tuple[object, ...], kwargs: dict[str, Any]) -> None:
        try:  # stacklevel 3: the record names the line that called us
            self.logger.log(level, msg, *args, stacklevel=3, **kwargs)
        except Exception:  # the application's logging failed on our record: the record keeps the decision
            pass


def level_of(state: RecordState) -> int:
    """The logging level a record moving to ``state`` is logged at."""
    return _LEVELS.get(state, 20)


def configure(config: Config) -> None:
    """``VERL_NPU_AUTOPATCH_LOG``: set our logger's level and, when neither it nor the root logger has
    a handler, log to stderr with a ``verl-npu-autopatch:`` prefix, until the application configures
    the root logger (whose handlers then show our records)."""
    if not config.log_level:
        return
    import logging

    ours = logging.getLogger(LOGGER_NAME)
    ours.setLevel(config.log_level)
    if ours.handlers or logging.getLogger().handlers:
        return

    class StderrHandler(logging.StreamHandler):
        def emit(self, record: logging.LogRecord) -> None:
            if not logging.getLogger().handlers:
                super().emit(record)

    handler = StderrHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("verl-npu-autopatch: %(levelname)s: %(message)s"))
    ours.addHandler(handler)
