"""Several devices: a request's whole images spread over engines (data parallelism), each engine one device
or a group of devices sharing every call's tokens (Ulysses sequence parallelism, see `vitjax.engine`).

Every engine holds the weights and its own bucket executables; a request is cut into contiguous groups
of whole images whose largest token total is as small as possible, and each group runs on its engine at
the same time (one host thread per engine, so the host-to-device copies overlap too). An image's output
stays on the (first) device of the engine that computed it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from vitjax import layout
from vitjax.buckets import Bucket
from vitjax.checks import is_int
from vitjax.engine import MAX_CHUNK_ROWS, Engine
from vitjax.row_views import row_view


def pick_devices(devices: int | str | jax.Device | Sequence[jax.Device] | None) -> list[jax.Device]:
    """None: the first local device; an int n: the first n local devices; "all": every local device; a device."""
    local = jax.local_devices()
    if devices is None:
        return local[:1]
    if isinstance(devices, jax.Device):
        return [devices]
    if isinstance(devices, str) and devices == "all":
        return local
    if isinstance(devices, (str, bool)) or not isinstance(devices, (numbers.Integral, Iterable)):
        raise ValueError(f"devices must be a count, 'all', a device or a list of devices, not {devices!r}")
    if isinstance(devices, numbers.Integral):
        if not 1 <= devices <= len(local):
            raise ValueError(f"asked for {devices} devices, but this process has {len(local)}: {local}")
        return local[: int(devices)]
    chosen = list(devices)
    if not chosen or len(set(chosen)) != len(chosen) or not all(isinstance(d, jax.Device) for d in chosen):
        raise ValueError(f"devices must be distinct JAX devices, at least one, got {chosen}")
    return chosen


def device_groups(devices: Sequence[jax.Device], sequence_parallel: int, num_heads: int) -> list[list[jax.Device]]:
    """Consecutive groups of `sequence_parallel` devices, one engine each; a group splits the tower's heads."""
    if not is_int(sequence_parallel) or sequence_parallel < 1:
        raise ValueError(f"sequence_parallel must be a positive integer, got {sequence_parallel!r}")
    if len(devices) % sequence_parallel:
        raise ValueError(f"sequence_parallel={sequence_parallel} does not divide the {len(devices)} devices")
    if num_heads % sequence_parallel:
        raise ValueError(f"sequence_parallel={sequence_parallel} does not divide the tower's {num_heads} heads")
    return [list(devices[i : i + sequence_parallel]) for i in range(0, len(devices), sequence_parallel)]


def split_balanced(sizes: Sequence[int], parts: int) -> list[range]:
    """`parts` contiguous index ranges over `sizes` (whole items, input order) whose largest total is as small as
    possible, since the slowest device sets the request's time; unneeded groups come last, empty."""

    def greedy(limit: int) -> list[int]:  # group ends when each group is filled up to `limit`
        ends, total = [], 0
        for i, n in enumerate(sizes):
            if total + n > limit:
                ends.append(i)
                total = 0
            total += n
        return [*ends, len(sizes)]

    lo, hi = max(sizes, default=0), sum(sizes)
    while lo < hi:  # the smallest limit that needs at most `parts` groups
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(greedy(mid)) <= parts else (mid + 1, hi)
    ends = greedy(lo)
    ends += [len(sizes)] * (parts - len(ends))
    return [range(a, b) for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def group_rows(pixel_values: np.ndarray | jax.Array, start: int, stop: int) -> tuple[np.ndarray | jax.Array, int]:
    """An engine's share of a request's pixels, rows [start, stop): (rows, where its first row is in them). Host rows
    are a view of exactly those. A device array's are a zero-copy view of at least `MAX_CHUNK_ROWS` rows around them
    where it has that many (an engine reads device rows a chunk at a time, and a shorter array goes through the
    host). An array spread over several devices is given whole: one engine gathers it on its device (several get
    host rows, `DataParallel.encode` gathers it once)."""
    if not isinstance(pixel_values, jax.Array):
        return pixel_values[start:stop], 0
    if len(pixel_values.devices()) > 1:
        return pixel_values, start
    high = min(pixel_values.shape[0], max(stop, start + MAX_CHUNK_ROWS))
    low = max(0, min(start, high - MAX_CHUNK_ROWS))
    return row_view(pixel_values, low, high - low), start - low


class DataParallel:
    """Engines used together; with one engine it is that engine."""

    def __init__(self, engines: Sequence[Engine]):
        self.engines = list(engines)
        self._pool = ThreadPoolExecutor(len(self.engines), "vitjax-device") if len(self.engines) > 1 else None

    @property
    def compiles(self) -> int:
        """Executables built so far, all devices together."""
        return sum(e.compiles for e in self.engines)

    def _map(self, work, items: list) -> list:
        """`work` on every item: in the device threads when there are several items, else in this thread."""
        return [work(item) for item in items] if len(items) < 2 else list(self._pool.map(work, items))

    def warmup(
        self, buckets: Iterable[Bucket] | None, pixel_dtype: np.dtype, run: bool, *, levels: bool = False
    ) -> dict[Bucket, float]:
        """Every engine's warm-up, devices in parallel; seconds per bucket on the slowest device."""
        buckets = None if buckets is None else list(buckets)
        times = self._map(lambda e: e.warmup(buckets, pixel_dtype, run, levels=levels), self.engines)
        return {b: max(t[b] for t in times) for b in times[0]}

    def encode(
        self, pixel_values: np.ndarray | jax.Array, grids: Sequence[layout.Grid], *, levels: bool = False
    ) -> list[jax.Array]:
        """Per-image outputs in input order, each on the engine whose group held the image; each engine is given its
        group's rows (`group_rows`: a view), so no device receives, and no host converts, the other groups' pixels.
        `levels`: as `Engine.run`'s."""
        sizes = [layout.grid_tokens(g) for g in grids]
        groups = split_balanced(sizes, len(self.engines))
        first_rows = np.concatenate([[0], np.cumsum(sizes)]).tolist()

        def work(pair: tuple[Engine, range]) -> list[jax.Array]:
            engine, group = pair
            rows, first = group_rows(pixel_values, first_rows[group.start], first_rows[group.stop])
            return engine.encode(rows, [grids[i] for i in group], first, levels=levels)

        # Empty groups come last: a request of one image (or fewer images than engines) skips their thread hops.
        busy = [(engine, group) for engine, group in zip(self.engines, groups, strict=True) if group]
        if isinstance(pixel_values, jax.Array) and len(pixel_values.devices()) > 1 and len(busy) > 1:
            pixel_values = np.asarray(pixel_values)  # spread over devices: gathered on the host once, not per engine
        return [out for outs in self._map(work, busy) for out in outs]
