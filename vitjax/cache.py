"""Per-image embedding cache: LRU, bounded in bytes, keyed by decoded-pixel content and settings.

Callers that compute values `claim` a key first: while one caller computes a key, others that claim it get a
`Future` of its value, so an image requested by several threads at once is computed once.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import jax
from PIL import Image

from vitjax.checks import is_int, is_positive
from vitjax.pil_pixels import rgb_bytes


def pixel_digest(image: Image.Image) -> str:
    """sha256 of the decoded pixels of an RGB image and their size: equal images hash equal whatever their encoding.
    (The mode stays in the hashed prefix, "RGB" always, so that digests match those of earlier versions.)"""
    h = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(rgb_bytes(image))
    return h.hexdigest()


def nbytes(value: Any) -> int:
    return sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(value))


def check_max_bytes(value: object) -> int:
    """The cache's bound, a whole number of bytes (0: no cache), else a ValueError naming `cache_bytes`."""
    whole = is_int(value) or (is_positive(value) and float(value).is_integer())  # 2e9 too
    if not whole or value < 0:
        raise ValueError(f"cache_bytes must be a whole number of bytes, 0 or more (0: no cache), got {value!r}")
    return int(value)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


class EmbeddingCache:
    """Least-recently-used map of key -> array pytree, evicting until the total stays under `max_bytes`.

    A value larger than the whole budget is not stored. Thread-safe, so a server can share one.
    """

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = check_max_bytes(max_bytes)
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._pending: dict[Hashable, Future] = {}  # keys claimed by a caller computing them now
        self._lock = threading.Lock()
        self._stats = CacheStats()

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self._stats.misses += 1
                return None
            self._items.move_to_end(key)
            self._stats.hits += 1
            return item[0]

    def claim(self, key: Hashable, mine: dict | None = None) -> Any | Future | None:
        """The cached value (a hit); else a `Future` of it when another caller is computing it (also a hit); else
        None: the key is now the caller's to compute, and it must `put` it or `abandon` it. A claimed key joins `mine`
        with its claim's `Future` before it is pending, so a caller interrupted anywhere (Ctrl-C) can abandon every
        claim it holds, and only those (`abandon`'s `claim`)."""
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                self._stats.hits += 1
                return item[0]
            if key in self._pending:
                self._stats.hits += 1
                return self._pending[key]
            self._stats.misses += 1
            claim = Future()
            if mine is not None:
                mine[key] = claim
            self._pending[key] = claim
            return None

    def abandon(self, key: Hashable, error: BaseException, claim: Future | None = None) -> None:
        """Give up a claimed key: whoever waits on it gets `error` raised. With `claim` (from `claim`'s `mine`), only
        while that claim is the key's pending one: one the caller settled may since be another caller's."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None or claim not in (None, pending):
                return
            del self._pending[key]
        pending.set_exception(error)

    def put(self, key: Hashable, value: Any) -> None:
        """Store `value` (unless it alone is over the budget) and hand it to whoever waits on the key."""
        size = nbytes(value)
        with self._lock:
            pending = self._pending.pop(key, None)
            old = self._items.pop(key, None)
            if old is not None:
                self._stats.bytes -= old[1]
            if size <= self.max_bytes:
                while self._items and self._stats.bytes + size > self.max_bytes:
                    _, (_, freed) = self._items.popitem(last=False)
                    self._stats.bytes -= freed
                    self._stats.evictions += 1
                self._items[key] = (value, size)
                self._stats.bytes += size
        if pending is not None:
            pending.set_result(value)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        """Drop every entry (stale, say, after new weights); hits, misses and evictions keep counting, as a
        server's metrics expect of counters."""
        with self._lock:
            self._items.clear()
            self._stats.bytes = 0

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**{**self._stats.__dict__, "entries": len(self._items)})
