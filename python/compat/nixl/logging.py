"""`nixl.logging` as NIXL's Python package configures it (src/api/python/logging.py): the
"nixl" logger writes INFO and above to standard output as
"2026-12-07 11:00:00 NIXL INFO    file.py:42 message", does not propagate to the root logger,
takes its level from NIXL_LOG_LEVEL (NIXL's names: TRACE, DEBUG, INFO, WARN, ERROR, FATAL),
and NIXL_DEBUG_LOGGING (true, 1, yes) turns on logging's raiseExceptions. NIXL's examples start
with `from nixl.logging import get_logger` and print their results through it."""

import logging as _logging
import logging.config as _logging_config
import os as _os

__all__ = ["get_logger", "setup_logging", "set_log_level_by_env", "LOGGING_CONFIG"]

_configured = False

LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "simpleFormatter": {
            "format": "%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s",
            "datefmt": "%Y-%m-%d %H:%M:%S",
        }
    },
    "handlers": {
        "consoleHandler": {
            "class": "logging.StreamHandler",
            "level": "INFO",
            "formatter": "simpleFormatter",
            "stream": "ext://sys.stdout",
        }
    },
    "loggers": {"nixl": {"level": "INFO", "handlers": ["consoleHandler"], "propagate": False}},
}

_LEVELS = {"TRACE": _logging.DEBUG, "DEBUG": _logging.DEBUG, "INFO": _logging.INFO,
           "WARN": _logging.WARNING, "ERROR": _logging.ERROR, "FATAL": _logging.CRITICAL}


def set_log_level_by_env(nixl_logger: _logging.Logger) -> None:
    """Sets `nixl_logger`'s level from NIXL_LOG_LEVEL, if set; a value NIXL does not name is
    warned about and the configured level stays."""
    value = _os.getenv("NIXL_LOG_LEVEL")
    if not value:
        return
    level = _LEVELS.get(value.upper())
    if level is None:
        nixl_logger.warning(
            "Invalid NIXL_LOG_LEVEL value '%s': %s. Using configuration default.", value,
            ValueError(f"Invalid log level: {value}"))
        return
    nixl_logger.setLevel(level)
    nixl_logger.info("Log level set to %s from NIXL_LOG_LEVEL environment variable",
                     value.upper())


def setup_logging() -> None:
    """Configures the "nixl" logger once per process."""
    global _configured
    if _configured:
        return
    _logging_config.dictConfig(LOGGING_CONFIG)
    set_log_level_by_env(_logging.getLogger("nixl"))
    _logging.raiseExceptions = _os.getenv("NIXL_DEBUG_LOGGING", "").lower() in (
        "true", "1", "yes")
    _configured = True


def get_logger(name: str) -> _logging.Logger:
    """The logger for module `name` under "nixl" ("_api" gives "nixl.api")."""
    setup_logging()
    return _logging.getLogger("nixl." + name.lstrip("_"))
