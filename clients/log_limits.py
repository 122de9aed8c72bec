"""Rate-limited warnings: input from Redis can arrive in floods, log lines must not."""

import logging
import time

DEFAULT_INTERVAL_S = 10.0


class RateLimitedLog:
    """At most one line per ``interval_s`` for each kind of problem (a fixed set of names,
    never a value from input); lines in between are counted and reported with the next."""

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S):
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (when logged, suppressed since)

    def warning(self, kind: str, message: str, *args, exc_info: bool = False) -> None:
        now = time.monotonic()
        logged_at, suppressed = self._last.get(kind, (-self.interval_s, 0))
        if now - logged_at < self.interval_s:
            self._last[kind] = (logged_at, suppressed + 1)
            return
        if suppressed:
            message += f" ({suppressed} more like it in the last {now - logged_at:.0f} s)"
        self.logger.warning(message, *args, exc_info=exc_info)
        self._last[kind] = (now, 0)


def shown(value, limit: int = 80) -> str:
    """A bounded, printable rendering of untrusted input for a log line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
