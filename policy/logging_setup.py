"""The "runnerlab" logger, configured the way vLLM configures its own: a stderr handler,
INFO by default, the level from RUNNERLAB_LOGGING_LEVEL, set up once on `import policy`
so the runner decision line is visible with no logging setup by the user.

propagate stays True so pytest's caplog (a root handler) sees every record; an application
that also puts a handler on the root logger will see runnerlab lines twice and can set
`logging.getLogger("runnerlab").propagate = False`.
"""

from __future__ import annotations

import logging
import sys

from policy import envs

LOGGER_NAME = "runnerlab"
_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATEFMT = "%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time (pytest's capsys and the CLI's
    redirections replace sys.stderr after import)."""

    _runnerlab = True

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def init_logger(name: str = LOGGER_NAME) -> logging.Logger:
    """Loggers of the project are children of "runnerlab" (e.g. "runnerlab.policy")."""
    return logging.getLogger(name)


def configure_logging() -> logging.Logger:
    """Idempotent: adds the handler once, re-reads the level every call."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(getattr(h, "_runnerlab", False) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATEFMT))
        logger.addHandler(handler)
    logger.propagate = True
    try:
        level = envs.logging_level()
        logger.setLevel(level)
    except envs.EnvVarError as err:
        # Raising here would make `import policy` fail; keep INFO and say why, loudly.
        logger.setLevel(logging.INFO)
        logger.warning("%s; using INFO", err)
    return logger
