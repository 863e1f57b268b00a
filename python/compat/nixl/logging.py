"""`nixl.logging` as NIXL's Python package has it: loggers under the "nixl" hierarchy, whose level
NIXL_LOG_LEVEL sets (DEBUG, INFO, WARNING, ERROR, CRITICAL). NIXL's examples start with
`from nixl.logging import get_logger`."""

import logging as _logging
import os as _os

__all__ = ["get_logger", "setup_logging", "set_log_level_by_env"]

_configured = False


def set_log_level_by_env(nixl_logger: _logging.Logger) -> None:
    """Sets `nixl_logger`'s level from NIXL_LOG_LEVEL, if set; a bad value is warned about and
    ignored."""
    value = _os.getenv("NIXL_LOG_LEVEL")
    if not value:
        return
    level = getattr(_logging, value.upper(), None)
    if not isinstance(level, int):
        nixl_logger.warning("Invalid NIXL_LOG_LEVEL value '%s'; the configured level stays",
                            value)
        return
    nixl_logger.setLevel(level)
    nixl_logger.info("Log level set to %s from NIXL_LOG_LEVEL", value.upper())


def setup_logging() -> None:
    """Configures the "nixl" logger once per process."""
    global _configured
    if _configured:
        return
    set_log_level_by_env(_logging.getLogger("nixl"))
    _configured = True


def get_logger(name: str) -> _logging.Logger:
    """The logger for module `name` under "nixl" ("_api" gives "nixl.api")."""
    setup_logging()
    return _logging.getLogger("nixl." + name.lstrip("_"))
