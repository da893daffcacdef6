"""Notices raised while a call is served: logged, never `warnings.warn`, whose `-W error` turns a notice into an
exception that fails the request it was meant to spare; each distinct one once, as a warning would be."""

from __future__ import annotations

import functools
import logging


@functools.lru_cache(maxsize=256)
def notice_once(logger: str, message: str) -> None:
    """Log `message` as a warning of `logger` the first time this pair is seen (the last 256 remembered)."""
    logging.getLogger(logger).warning(message)
