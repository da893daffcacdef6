"""Images -> pixel rows: the host side of `Encoder.encode`, from what a user holds to one buffer per tower call.

Every input goes through two steps, so that the cache and the call planner know an input before any of
its pixel rows exist:
- `prepare` (one input, in a worker thread): decode it, hash the decoded content, work out its patch
  grid; the result is an `Item` (name, digest, grid_thw, and a `fill` that writes its rows later).
- `fill` (one tower call's batch of items): one pixel buffer, every item's rows written into its slice
  in worker threads, straight from the decoded image.
A decode backend is a `Decoder` (a `prepare` for one input); `PilDecoder` is the CPU one, bit-identical to
HF's processor. An item's grid may have t > 1 (a video's temporal groups): nothing here assumes t == 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from vitjax import layout
from vitjax.cache import pixel_digest
from vitjax.config import VisionConfig
from vitjax.images import ImageInputError, load_image
from vitjax.preprocess import preprocess_image, resized_size


@dataclass(frozen=True)
class Item:
    """One prepared input: known to the cache (`digest`) and the planner (`grid`), its rows not yet written."""

    name: str
    digest: str  # sha256 of the decoded content; with the pipeline's settings, the cache key
    grid: layout.Grid  # (t, h, w) in patches
    fill: Callable[[np.ndarray], object]  # writes the item's rows into a [tokens, patch_dim] buffer

    @property
    def tokens(self) -> int:
        return layout.grid_tokens(self.grid)


class Decoder(Protocol):
    """A decode backend: `name` goes into cache keys (backends may differ in pixels); `prepare` one input."""

    name: str

    def prepare(self, name: str, source: object) -> Item: ...


class PilDecoder:
    """Decode and resize with PIL on the CPU: HF's `Qwen2VLImageProcessorPil`, bit for bit (`vitjax.preprocess`)."""

    name = "pil"

    def __init__(self, cfg: VisionConfig, min_pixels: int, max_pixels: int):
        self.cfg = cfg
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels

    def prepare(self, name: str, source: object) -> Item:
        p = self.cfg
        image = load_image(source, name)
        height, width = resized_size(image, self.min_pixels, self.max_pixels, p.patch_size * p.spatial_merge_size, name)

        def fill(out: np.ndarray) -> object:
            return preprocess_image(
                image,
                self.min_pixels,
                self.max_pixels,
                patch_size=p.patch_size,
                merge_size=p.spatial_merge_size,
                temporal_patch_size=p.temporal_patch_size,
                name=name,
                out=out,
            )

        return Item(name, pixel_digest(image), (1, height // p.patch_size, width // p.patch_size), fill)


class Pipeline:
    """Inputs -> `Item`s -> one pixel buffer per batch, in a pool of worker threads (use it as a context manager).

    `settings` identifies what changes the pixel rows (backend, pixel bounds): part of every cache key.
    """

    def __init__(
        self,
        cfg: VisionConfig,
        *,
        min_pixels: int,
        max_pixels: int,
        pixel_dtype: np.dtype,
        workers: int | None = None,
    ):
        self.cfg = cfg
        self.pixel_dtype = np.dtype(pixel_dtype)
        self.decoder: Decoder = PilDecoder(cfg, min_pixels, max_pixels)
        self.settings = (self.decoder.name, min_pixels, max_pixels)
        self._pool = ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1), "vitjax-pipeline")

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown()

    def prepare(self, items: Iterable[tuple[str, object]]) -> Iterator[Item | ImageInputError]:
        """`(name, source)` pairs -> an `Item` or the input's error each, in order, prepared in the workers."""
        return self._pool.map(lambda item: guard(item[0], lambda: self.decoder.prepare(*item)), items)

    def fill(self, batch: Sequence[Item]) -> tuple[np.ndarray, list[ImageInputError | None]]:
        """The batch's rows, concatenated in order, and per item its error (its rows then undefined) or None."""
        starts = np.cumsum([0, *(item.tokens for item in batch)])
        pixels = np.empty((starts[-1], self.cfg.patch_dim), self.pixel_dtype)

        def fill(j: int) -> ImageInputError | None:
            result = guard(batch[j].name, lambda: batch[j].fill(pixels[starts[j] : starts[j + 1]]))
            return result if isinstance(result, ImageInputError) else None

        return pixels, list(self._pool.map(fill, range(len(batch))))


def guard(name: str, work: Callable[[], object]) -> object:
    """Run `work`, turning a ValueError into an `ImageInputError` naming the input (returned, not raised)."""
    try:
        return work()
    except ImageInputError as e:
        return e
    except ValueError as e:
        return ImageInputError(name, str(e))


def batches(items: Iterable[Item], budget: int) -> Iterator[list[Item]]:
    """Greedy, order-preserving batches of at most `budget` tokens (an item over the budget goes alone)."""
    batch: list[Item] = []
    total = 0
    for item in items:
        if batch and total + item.tokens > budget:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += item.tokens
    if batch:
        yield batch
