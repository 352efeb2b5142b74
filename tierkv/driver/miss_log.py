"""`MissLog`: an engine adapter's calls that answered a miss because something failed.

An engine calls its storage backend many times a second and never sees an exception
from tierkv (it gets a miss, a False, a failed bit). So that a broken tier is neither
silent nor a log flood, the first failure of each kind (the call, the exception type)
is a warning and the rest are debug lines. Shared by the SGLang and LMCache adapters.
"""

from __future__ import annotations

import logging

__all__ = ["MissLog"]


class MissLog:
    """Logs, once per (call, exception type) as a warning, a call answered as a miss."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: set[str] = set()

    def failed(self, what: str, exc: BaseException) -> None:
        kind = f"{what}:{type(exc).__name__}"
        if kind not in self._seen:
            self._seen.add(kind)  # a race logs a kind twice at worst
            self._logger.warning(
                "tierkv %s failed (%s: %s); answered a miss", what, type(exc).__name__, exc
            )
        else:
            self._logger.debug("tierkv %s failed: %s", what, exc)
