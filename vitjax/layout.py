"""Host-side geometry (numpy): per-frame position tables, cached, and packing of many images into one sequence.

Everything here depends only on grid shapes, never on weights, so it is computed once per `(h, w)` and
reused; the device program receives it as plain integer/float arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

Grid = tuple[int, int, int]


class FrameGeometry(NamedTuple):
    """Per-patch tables of one frame, in spatial-merge (window) order."""

    pos_index: np.ndarray  # [h*w, 4] int32: bilinear taps into the flattened side x side table
    pos_weight: np.ndarray  # [h*w, 4] float32: their weights (align_corners, HF 5.x fp32 math)
    rope_pos: np.ndarray  # [h*w, 2] int32: full-resolution (row, col) for the 2-D rotary embedding


class Packed(NamedTuple):
    """Device inputs describing a packed sequence of T tokens holding up to M frame segments."""

    pos_index: np.ndarray  # [T, 4] int32 (padding: 0)
    pos_weight: np.ndarray  # [T, 4] float32 (padding: 0)
    rope_pos: np.ndarray  # [T, 2] int32 (padding: 0)
    segment_ids: np.ndarray  # [T] int32: frame segment of each token; padding is -1
    segment_starts: np.ndarray  # [M] int32: first token of each segment; unused slots hold T
    segment_lengths: np.ndarray  # [M] int32: tokens per segment; unused slots hold 0


def merge_order(h: int, w: int, merge: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of every patch, listed block-major over merge x merge windows (HF's order)."""
    if h % merge or w % merge:
        raise ValueError(f"grid {h}x{w} is not divisible by the merge size {merge}")
    shape = (h // merge, merge, w // merge, merge)
    rows = np.broadcast_to(np.arange(h).reshape(h // merge, merge, 1, 1), shape).transpose(0, 2, 1, 3)
    cols = np.broadcast_to(np.arange(w).reshape(1, 1, w // merge, merge), shape).transpose(0, 2, 1, 3)
    return rows.reshape(-1), cols.reshape(-1)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Two bilinear taps and weights along one axis, in float32 exactly as HF's vision_utils computes them."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = np.minimum(floor.astype(np.int64)[:, None] + np.arange(2), side - 1)
    weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0)
    return taps, weights.astype(np.float32)


# ~40 bytes a patch (a 16.7 MP frame's 2.6 MB): frame sizes past this many are computed again, not held.
@functools.lru_cache(maxsize=512)
def frame_geometry(h: int, w: int, side: int = 48, merge: int = 2) -> FrameGeometry:
    """Position-embedding taps and rotary positions of one h x w patch grid (cached; arrays are read-only)."""
    rows, cols = merge_order(h, w, merge)
    r_taps, r_w = _axis_taps(rows, h, side)
    c_taps, c_w = _axis_taps(cols, w, side)
    index = (r_taps[:, :, None] * side + c_taps[:, None, :]).reshape(-1, 4).astype(np.int32)
    weight = (r_w[:, :, None] * c_w[:, None, :]).reshape(-1, 4)
    rope = np.stack([rows, cols], axis=-1).astype(np.int32)
    for a in (index, weight, rope):
        a.flags.writeable = False
    return FrameGeometry(index, weight, rope)


def check_patches(shape: Sequence[int], grid_thw: object, patch_dim: int, merge: int = 2) -> list[Grid]:
    """The grids of pixel rows of `shape`, or a ValueError saying what does not fit: grid_thw must be an
    integer [n, 3] of positive (t, h, w) with h and w divisible by `merge`, and the rows exactly sum(t*h*w)."""
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3 or not np.issubdtype(grid.dtype, np.integer):
        raise ValueError(f"grid_thw must be an integer array [n, 3], got {grid.dtype} {list(grid.shape)}")
    bad = [g.tolist() for g in grid if g.min() < 1 or g[1] % merge or g[2] % merge]
    if bad:
        raise ValueError(f"grid_thw rows {bad} must be positive with h and w divisible by {merge}")
    grids = [tuple(int(v) for v in g) for g in grid]
    need = [sum(grid_tokens(g) for g in grids), patch_dim]  # Python ints: numpy's would wrap past 2**63
    if list(shape) != need:
        raise ValueError(f"pixel_values has shape {list(shape)}, but grid_thw needs {need}")
    return grids


def grid_tokens(grid: Grid) -> int:
    """Patches (tower tokens) of one image or video."""
    t, h, w = grid
    return t * h * w


def pack(
    grids: Sequence[Grid],
    num_tokens: int | None = None,
    max_segments: int | None = None,
    *,
    side: int = 48,
    merge: int = 2,
) -> Packed:
    """Lay several images/videos end to end in one sequence, padded to `num_tokens` and `max_segments`.

    Each temporal group of each entry is its own attention segment; padding tokens belong to none.
    Results are cached per arguments (a serving process sees the same layouts again and again) and
    read-only.
    """
    grids = tuple(tuple(int(v) for v in g) for g in grids)
    total = sum(grid_tokens(g) for g in grids)
    segments = sum(g[0] for g in grids)
    num_tokens = total if num_tokens is None else num_tokens
    max_segments = segments if max_segments is None else max_segments
    if total > num_tokens:
        raise ValueError(f"{total} tokens do not fit in a bucket of {num_tokens}")
    if segments > max_segments:
        raise ValueError(f"{segments} frame segments do not fit in a bucket of {max_segments}")
    return _pack(grids, num_tokens, max_segments, side, merge)


@functools.lru_cache(maxsize=32)
def _pack(grids: tuple[Grid, ...], num_tokens: int, max_segments: int, side: int, merge: int) -> Packed:
    total = sum(grid_tokens(g) for g in grids)
    pos_index = np.empty((num_tokens, 4), np.int32)
    pos_weight = np.empty((num_tokens, 4), np.float32)
    rope_pos = np.empty((num_tokens, 2), np.int32)
    segment_ids = np.empty(num_tokens, np.int32)
    for a in (pos_index, pos_weight, rope_pos):
        a[total:] = 0
    segment_ids[total:] = -1
    starts = np.full(max_segments, num_tokens, np.int32)
    lengths = np.zeros(max_segments, np.int32)
    cursor, seg = 0, 0
    for t, h, w in grids:
        geo = frame_geometry(h, w, side, merge)
        for _ in range(t):
            end = cursor + h * w
            pos_index[cursor:end], pos_weight[cursor:end], rope_pos[cursor:end] = geo
            segment_ids[cursor:end] = seg
            starts[seg], lengths[seg] = cursor, h * w
            cursor, seg = end, seg + 1
    packed = Packed(pos_index, pos_weight, rope_pos, segment_ids, starts, lengths)
    for a in packed:
        a.flags.writeable = False
    return packed


def split_points(grids: Sequence[Grid], merge_unit: int = 4) -> list[tuple[int, int]]:
    """(first output row, rows) of each entry in the merged output of a packed sequence."""
    spans, cursor = [], 0
    for g in grids:
        rows = grid_tokens(g) // merge_unit
        spans.append((cursor, rows))
        cursor += rows
    return spans
