"""Notices raised while a call is served: logged, never `warnings.warn`, whose `-W error` turns a notice into an
exception that fails the request it was meant to spare; each distinct one once, as a warning would be, and marked
"vitjax:" (Python's fallback handler and SGLang's log format show the message without the logger's name)."""

from __future__ import annotations

import collections
import logging
import threading

REMEMBERED = 256  # distinct notices kept, the oldest forgotten first (a notice may name a path or an error)
_seen: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
_lock = threading.Lock()


def notice_once(logger: str, message: str) -> None:
    """Log `message` as a warning of `logger` the first time this pair is seen, once however many threads meet it at
    the same time (the last `REMEMBERED` pairs are remembered)."""
    with _lock:
        if (logger, message) in _seen:
            return
        _seen[logger, message] = None
        while len(_seen) > REMEMBERED:
            _seen.popitem(last=False)
    logging.getLogger(logger).warning("vitjax: %s", message)


def forget() -> None:
    """Every notice may be logged again (each test starts with none seen)."""
    with _lock:
        _seen.clear()
