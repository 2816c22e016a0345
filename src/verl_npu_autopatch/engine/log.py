"""The package's one logger, the level of each record state, and the stderr handler
``VERL_NPU_AUTOPATCH_LOG`` turns on. ``logging`` is imported only when a line is logged."""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging

    from verl_npu_autopatch.engine.config import Config
    from verl_npu_autopatch.engine.records import RecordState

__all__ = ["LOGGER_NAME", "configure", "level_of", "logger"]

LOGGER_NAME = "verl_npu_autopatch"

#: Logging level of each record state (others: INFO, so ``VERL_NPU_AUTOPATCH_LOG=INFO`` shows every decision).
_LEVELS: dict[RecordState, int] = {"failed": 40, "superseded": 30, "unsupported": 30}


def logger() -> logging.Logger:
    import logging

    return logging.getLogger(LOGGER_NAME)


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

    ours = logger()
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
