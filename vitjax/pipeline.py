"""Images -> pixel rows: the host side of `Encoder.encode`, from what a user holds to one buffer per tower call.

Every input goes through two steps, so that the cache and the call planner know an input before any of
its pixel rows exist:
- `prepare` (one input, in a worker thread): decode it, hash the decoded content, work out its patch
  grid; the result is an `Item` (name, digest, grid_thw, and a `fill` that writes its rows later).
- `Batch.add` (one tower call's buffer, item after item): every item's rows written into its slice in
  worker threads, straight from the decoded image, which is then let go (with DALI: the item's sample is
  made in the workers, and `Batch.finish` runs DALI once over the batch).
A decode backend is a `Decoder` (a `prepare` for one input). `PilDecoder` is the CPU one, bit-identical to
HF's processor (either of its two backends: `image_processor_backend`). `DaliDecoder` hands whole batches to
NVIDIA DALI (`vitjax.dali`: nvJPEG and the hardware decoder on a GPU, its CPU backend elsewhere) and writes rows
PIL did not make: the JPEGs DALI decodes exactly as PIL does (RGB or greyscale, complete, any EXIF orientation);
everything else it routes to PIL, whose pixels then only pass through DALI. An item's `decoder` says which
backend made its pixels, and is part of its cache key.
Videos (a `vitjax.Video`, or a path with a video extension) go to `VideoDecoder` whatever the backend: HF's video
processor, exact, on the CPU; their rows are always written into a host buffer (grid t: one per pair of frames).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import jax
import numpy as np
from PIL import ExifTags, Image

from vitjax import layout
from vitjax.cache import pixel_digest
from vitjax.config import VisionConfig
from vitjax.dali import DaliRows, Sample
from vitjax.images import ImageInputError, check_size, encoded_bytes, load_image
from vitjax.preprocess import (
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    check_backend,
    preprocess_image,
    resized_pixels,
    resized_size,
    smart_resize,
    video_rows,
    video_size,
)
from vitjax.video import Video, is_video_path, open_clip

DECODERS = ("auto", "pil", "dali")


@dataclass(frozen=True)
class Item:
    """One prepared input: known to the cache (`digest`) and the planner (`grid`), its rows not yet written."""

    name: str
    digest: str  # sha256 of what the decoder decodes (PIL: the RGB pixels, DALI: the file); part of the cache key
    grid: layout.Grid  # (t, h, w) in patches
    fill: Callable[[np.ndarray], object] | None  # writes the item's rows into a [tokens, patch_dim] host buffer
    sample: Callable[[], Sample] | None = None  # what DALI turns into the item's rows (None: no DALI path)
    decoder: str = "pil"  # the backend that made (or makes) the pixels
    settings: tuple | None = None  # what else its rows depend on, when not the pipeline's (a video's sampling)

    @property
    def tokens(self) -> int:
        return layout.grid_tokens(self.grid)


class Decoder(Protocol):
    """A decode backend: `name` goes into cache keys (backends may differ in pixels); `prepare` one input."""

    name: str

    def prepare(self, name: str, source: object) -> Item: ...


class PilDecoder:
    """Decode with PIL and resize on the CPU: HF's image processor of backend `processor` ("pil":
    `Qwen2VLImageProcessorPil`, "torchvision": `Qwen2VLImageProcessor`), bit for bit (`vitjax.preprocess`)."""

    name = "pil"

    def __init__(self, cfg: VisionConfig, min_pixels: int, max_pixels: int, processor: str = "pil"):
        self.cfg = cfg
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.processor = processor

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
                backend=self.processor,
            )

        def sample() -> Sample:
            pixels = resized_pixels(image, height, width, self.processor)
            return Sample.of_pixels(pixels.tobytes(), height, width, self.processor)

        return Item(name, pixel_digest(image), (1, height // p.patch_size, width // p.patch_size), fill, sample)


class DaliDecoder:
    """JPEGs that NVIDIA DALI decodes exactly as PIL does go to DALI; everything else to `PilDecoder`.

    DALI gets a JPEG when PIL reads its header as JPEG in RGB (YCbCr) or greyscale, of at most
    `PIL.Image.MAX_IMAGE_PIXELS` pixels, whose markers are all in place up to the end-of-image marker that ends
    the file (`jpeg_process`: a truncated or corrupt file goes to PIL, which refuses it by name, rather than
    being decoded in part), of a process DALI decodes as PIL does (baseline, extended, progressive), and with its
    orientation, if any, as one SHORT EXIF tag in the file's only EXIF block (DALI reads no XMP, reads the last of
    several blocks where PIL reads the first, and a big-endian LONG tag as 0). DALI's CPU decode of those equals
    PIL's bit for bit, EXIF orientation included (tests). PIL keeps CMYK/YCCK JPEGs (Adobe's inverted CMYK), MPO,
    every other format (alpha, palettes, 16 bits follow HF's conversions there), PIL images and arrays.
    A DALI item's digest is the file's sha256: its pixels exist only inside DALI.
    """

    name = "dali"

    def __init__(self, cfg: VisionConfig, min_pixels: int, max_pixels: int, processor: str = "pil"):
        self.cfg = cfg
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.processor = processor
        self.pil = PilDecoder(cfg, min_pixels, max_pixels, processor)

    def prepare(self, name: str, source: object) -> Item:
        data = encoded_bytes(source, name)
        if data is None:
            return self.pil.prepare(name, source)
        decoded = self._jpeg_size(data)
        if decoded is None:
            return self.pil.prepare(name, data)
        p = self.cfg
        factor = p.patch_size * p.spatial_merge_size
        try:
            height, width = smart_resize(*decoded, factor, self.min_pixels, self.max_pixels)
        except ValueError as e:
            raise ImageInputError(name, str(e)) from e
        sample = Sample(np.frombuffer(data, np.uint8), decoded, (height, width), self.processor)
        grid = (1, height // p.patch_size, width // p.patch_size)
        return Item(name, hashlib.sha256(data).hexdigest(), grid, None, lambda: sample, "dali")

    @staticmethod
    def _jpeg_size(data: bytes) -> tuple[int, int] | None:
        """(height, width) once decoded and upright, for a JPEG that DALI decodes as PIL does; else None."""
        if jpeg_process(data) not in DALI_JPEG_PROCESSES:  # None too: not a JPEG, or not a whole one
            return None
        try:
            header = Image.open(io.BytesIO(data))  # reads the header only
        except Exception:  # not an image PIL knows, or a corrupt header: PIL's path names the reason
            return None
        if header.format != "JPEG" or header.mode not in ("RGB", "L"):
            return None
        check_size(header)
        # DALI turns the image by the EXIF tag alone; PIL (and HF) also read XMP's, and ignore a tag of another type
        orientation = header.getexif().get(ExifTags.Base.Orientation, 1)
        exif = Image.Exif()
        try:
            if "exif" in header.info:
                exif.load(header.info["exif"])
        except Exception:  # an EXIF block PIL decodes past but cannot parse (SyntaxError, struct.error): PIL decides
            return None
        if not isinstance(orientation, int) or orientation != exif.get(ExifTags.Base.Orientation, 1):
            return None
        # DALI reads the last EXIF block where PIL reads the first, and a big-endian LONG orientation as 0: it gets
        # files with at most one block whose orientation, if any, is one SHORT, as PIL writes it.
        blocks = exif_blocks(data)
        try:
            if len(blocks) > 1 or (blocks and orientation_entry(blocks[0]) not in (None, (3, 1))):
                return None
        except ValueError:
            return None
        return (header.width, header.height) if orientation in (5, 6, 7, 8) else (header.height, header.width)


# Start-of-frame markers DALI decodes as PIL does: baseline, extended and progressive, Huffman or arithmetic coded
# (not lossless, hierarchical or 12-bit lossless: DALI refuses or differs; PIL decodes them).
DALI_JPEG_PROCESSES = frozenset({0xC0, 0xC1, 0xC2, 0xC9, 0xCA})
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOF0-15 (C4: DHT, C8: reserved, CC: DAC)
_JPEG_SEGMENTS = _JPEG_FRAMES | {0xC4, 0xCC, 0xDA, 0xDB, 0xDC, 0xDD, 0xFE, *range(0xE0, 0xF0)}
_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")  # a marker: not a stuffed 0xFF, a restart or fill


def jpeg_segments(data: bytes) -> Iterator[tuple[int, int]]:
    """(marker, offset) of each segment of a JPEG, SOI to EOI; the walk stops short of EOI (which is last, at the
    file's end) where a marker is out of place.

    DALI decodes a file with a stray marker in its scan data into garbage without an error, where PIL (and HF)
    refuse it; such files go to PIL. Segments are skipped by their lengths, scan data up to its next marker.
    """
    if not data.startswith(b"\xff\xd8"):
        return
    i = 2
    while i + 2 <= len(data):
        if data[i] != 0xFF:
            return
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xD9:
            if i + 2 == len(data):
                yield marker, i
            return
        if marker not in _JPEG_SEGMENTS or i + 4 > len(data):
            return
        yield marker, i
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xDA:
            scan_end = _SCAN_END.search(data, i)
            if scan_end is None:
                return
            i = scan_end.start()


def jpeg_process(data: bytes) -> int | None:
    """The start-of-frame marker of a JPEG whose markers are all in place from SOI to EOI (`jpeg_segments`), else
    None."""
    process = None
    for marker, _ in jpeg_segments(data):
        if marker == 0xD9:
            return process
        if marker in _JPEG_FRAMES:
            if process is not None:  # one frame a file (hierarchical files, which have more, go to PIL too)
                return None
            process = marker
    return None


def exif_blocks(data: bytes) -> list[bytes]:
    """The payloads of a JPEG's EXIF segments (APP1 segments that start "Exif") before its first scan, in file order:
    PIL and DALI read none after it (a block there leaves DALI's rows equal to PIL's), so the scans are not walked."""
    blocks = []
    for marker, i in jpeg_segments(data):
        if marker == 0xDA:
            break
        payload = data[i + 4 : i + 2 + int.from_bytes(data[i + 2 : i + 4], "big")] if marker == 0xE1 else b""
        if payload.startswith(b"Exif\x00\x00"):
            blocks.append(payload)
    return blocks


def orientation_entry(block: bytes) -> tuple[int, int] | None:
    """(TIFF type, count) of the Orientation entry in an EXIF block's first IFD; None without one. Raises ValueError
    on a block too short or not TIFF."""
    tiff = block[6:]
    order = {b"II*\x00": "little", b"MM\x00*": "big"}.get(tiff[:4])
    if order is None:
        raise ValueError("not a TIFF header")

    def number(at: int, size: int) -> int:
        if at + size > len(tiff):
            raise ValueError("EXIF block cut short")
        return int.from_bytes(tiff[at : at + size], order)

    ifd = number(4, 4)
    for entry in range(ifd + 2, ifd + 2 + 12 * number(ifd, 2), 12):
        if number(entry, 2) == ExifTags.Base.Orientation:
            return number(entry + 2, 2), number(entry + 4, 4)
    return None


class VideoDecoder:
    """Videos: sampled, decoded (PyAV) and resized as HF's `Qwen3VLVideoProcessor` does (`vitjax.video`,
    `vitjax.preprocess.preprocess_video`). `prepare` probes the file and sizes the rows; `fill` decodes and
    resizes a temporal group at a time, so a long video never sits in memory at full size. A path is sampled at
    `fps` or to `num_frames` (default: 2 frames per second); a `Video` brings its own sampling. The digest is
    the file's sha256 (an array's: its sampled frames'); the sampling and pixel bounds join the cache key.
    """

    name = "video"

    def __init__(self, cfg: VisionConfig, min_pixels: int, max_pixels: int, fps: float | None, num_frames: int | None):
        self.cfg = cfg
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.fps = fps
        self.num_frames = num_frames

    def prepare(self, name: str, source: object) -> Item:
        p = self.cfg
        video = source if isinstance(source, Video) else Video(source, fps=self.fps, num_frames=self.num_frames)
        clip = open_clip(video, name)
        factors = {"factor": p.patch_size * p.spatial_merge_size, "temporal_factor": p.temporal_patch_size}
        height, width = video_size(clip, self.min_pixels, self.max_pixels, name=name, **factors)
        grid = (-(-clip.count // p.temporal_patch_size), height // p.patch_size, width // p.patch_size)
        geometry = {
            "patch_size": p.patch_size,
            "merge_size": p.spatial_merge_size,
            "temporal_patch_size": p.temporal_patch_size,
        }

        def fill(out: np.ndarray) -> None:
            video_rows(clip, height, width, out, **geometry)

        settings = (*video.settings, self.min_pixels, self.max_pixels)
        return Item(name, clip.digest(), grid, fill, None, self.name, settings)


def is_video(source: object) -> bool:
    """Whether an input goes to `VideoDecoder`: a `Video`, or a path with a video extension."""
    return isinstance(source, Video) or is_video_path(source)


def default_workers() -> int:
    """Preprocessing threads when none are given: one a core this process may run on (its CPU affinity), up to 16.
    Since the pixels are viewed in Pillow's memory (`pil_pixels`), 16 threads took 20 photos in end to end 1-6% faster
    than 8, and 32 no faster (H200s, 16- and 64-core hosts, bench/NOTES.md)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        cores = os.cpu_count() or 1
    return min(16, cores)


class Pipeline:
    """Inputs -> `Item`s -> one pixel buffer per batch, in a pool of worker threads (use it as a context manager).

    With `dali` (a `vitjax.dali.DaliRows`) the backend is `DaliDecoder` and each batch's rows come from one DALI
    run (on the device DALI runs on, for a GPU); else `PilDecoder` writes them into a host buffer of
    `pixel_dtype`. Videos go to a `VideoDecoder` (`video_min_pixels`, `video_max_pixels`, and `fps` or
    `num_frames` for video paths) and always into host buffers (`batch(..., host=True)`). Images follow HF's image
    processor of `image_processor_backend`. `settings` identifies what else changes an image's rows (the pixel
    bounds and that backend); `cache_key` joins them (or a video's own) with an item's decoder and digest.

    Host memory stays bounded however many inputs come: `prepare` runs at most `window` inputs ahead of the
    consumer, and at most `window` taken items wait for their rows (or DALI sample) to be made, so at most
    2 x `window` decoded images exist at a time.
    """

    def __init__(
        self,
        cfg: VisionConfig,
        *,
        min_pixels: int,
        max_pixels: int,
        pixel_dtype: np.dtype,
        dali: DaliRows | None = None,
        video_min_pixels: int = VIDEO_MIN_PIXELS,
        video_max_pixels: int = VIDEO_MAX_PIXELS,
        fps: float | None = None,
        num_frames: int | None = None,
        image_processor_backend: str = "pil",
        workers: int | None = None,
        window: int | None = None,
    ):
        check_backend(image_processor_backend, "image_processor_backend")
        self.cfg = cfg
        self.pixel_dtype = np.dtype(pixel_dtype)
        self.dali = dali
        decoder_cls = PilDecoder if dali is None else DaliDecoder
        self.decoder: Decoder = decoder_cls(cfg, min_pixels, max_pixels, image_processor_backend)
        self.video = VideoDecoder(cfg, video_min_pixels, video_max_pixels, fps, num_frames)
        self.settings = (min_pixels, max_pixels, image_processor_backend)
        workers = workers or default_workers()
        self.window = window or 2 * workers
        self._pool = ThreadPoolExecutor(workers, "vitjax-pipeline")
        self._making: deque[Future] = deque()  # items taken whose rows or samples are not made yet

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(cancel_futures=exc[0] is not None)

    def cache_key(self, item: Item) -> tuple:
        return (item.decoder, item.digest, *(self.settings if item.settings is None else item.settings))

    def prepare(self, items: Iterable[tuple[str, object]]) -> Iterator[Item | ImageInputError]:
        """`(name, source)` pairs -> an `Item` or the input's error each, in order, prepared in the workers."""
        ahead: deque[Future] = deque()
        items = iter(items)
        while True:
            while len(ahead) < self.window and (item := next(items, None)) is not None:
                decoder = self.video if is_video(item[1]) else self.decoder
                ahead.append(self._pool.submit(guard, item[0], functools.partial(decoder.prepare, *item)))
            if not ahead:
                return
            yield ahead.popleft().result()

    def host(self, item: Item) -> bool:
        """Whether `item`'s rows are written into a host buffer (else DALI makes them)."""
        return self.dali is None or item.decoder == VideoDecoder.name

    def batch(self, rows: int, host: bool | None = None) -> Batch:
        """An empty batch of `rows` rows (pages of a host buffer are touched only as rows are written): rows in a
        host buffer when `host` (default: unless DALI makes this pipeline's image rows)."""
        host = self.dali is None if host is None else host
        pixels = np.empty((rows, self.cfg.patch_dim), self.pixel_dtype) if host else None
        return Batch(self, rows, pixels)

    def fill(self, items: Sequence[Item]) -> tuple[np.ndarray | jax.Array, list[ImageInputError | None]]:
        """The rows of `items` (all made on the host, or all by DALI), concatenated in order, and per item its
        error (its rows then zeros, or DALI's black stand-in) or None."""
        batch = self.batch(sum(item.tokens for item in items), all(self.host(item) for item in items))
        for item in items:
            batch.add(item)
        return batch.finish()

    def _make(self, work: Callable, *args) -> Future:
        """Run `work(*args)` in a worker; the caller waits here while `window` earlier items are still unmade."""
        future = self._pool.submit(work, *args)
        self._making.append(future)
        while len(self._making) > self.window or (self._making and self._making[0].done()):
            self._making.popleft().result()
        return future

    def _run_dali(self, batch: Sequence[Item], samples: list) -> tuple[np.ndarray | jax.Array, list]:
        """One DALI run over the batch. DALI fails a whole batch on one bad file: then each sample is run
        alone, the ones DALI refuses become their input's error, and the rest run again together."""
        errors = [s if isinstance(s, ImageInputError) else None for s in samples]
        samples = [self._blank(item) if error else s for item, s, error in zip(batch, samples, errors, strict=True)]
        try:
            return self.dali(samples), errors
        except RuntimeError:
            pass
        for j, decodes in enumerate(self.dali.run_each(samples)):
            if not decodes:
                errors[j] = ImageInputError(batch[j].name, "corrupt JPEG data (DALI's decoder refused it)")
                samples[j] = self._blank(batch[j])
        return self.dali(samples), errors

    def _blank(self, item: Item) -> Sample:
        """Stand-in rows (black) for an item that failed, so the batch keeps its layout."""
        _, h, w = item.grid
        height, width = h * self.cfg.patch_size, w * self.cfg.patch_size
        return Sample.of_pixels(bytes(height * width * 3), height, width)


class Batch:
    """One tower call's rows: items are added in order, and made by the workers meanwhile (PIL: rows written
    into the host buffer; DALI: samples, run together by `finish`). `items` keeps each item without its
    pixels, so a decoded image lives only until its rows or sample exist."""

    def __init__(self, pipe: Pipeline, capacity: int, pixels: np.ndarray | None):
        self._pipe = pipe
        self.capacity = capacity
        self._pixels = pixels
        self.rows = 0
        self.items: list[Item] = []
        self._made: list[Future] = []

    def fits(self, item: Item) -> bool:
        return self.rows + item.tokens <= self.capacity

    def add(self, item: Item, done: Callable[[], object] = lambda: None) -> None:
        """Queue `item` after the last ones; `done()` is called once its rows (or sample) are made."""
        if self._pixels is None:
            future = self._pipe._make(guard, item.name, item.sample or _no_dali)
        else:
            future = self._pipe._make(_fill_rows, item, self._pixels[self.rows : self.rows + item.tokens])
        future.add_done_callback(lambda _: done())
        self._made.append(future)
        self.rows += item.tokens
        self.items.append(dataclasses.replace(item, fill=None, sample=None))

    def finish(self) -> tuple[np.ndarray | jax.Array, list[ImageInputError | None]]:
        """The rows, in order, and per item its error (its rows then zeros) or None."""
        made = [future.result() for future in self._made]
        if self._pixels is None:
            return self._pipe._run_dali(self.items, made)
        start = 0
        for item, error in zip(self.items, made, strict=True):
            if error is not None:  # a failed fill leaves anything (NaN too): 0 x NaN in attention would spread it
                self._pixels[start : start + item.tokens] = 0
            start += item.tokens
        return self._pixels[: self.rows], made


def _fill_rows(item: Item, rows: np.ndarray) -> ImageInputError | None:
    result = guard(item.name, lambda: item.fill(rows))
    return result if isinstance(result, ImageInputError) else None


def _no_dali() -> Sample:
    raise ValueError("decoder='dali' has no path for this input; use decoder='pil'")


def guard(name: str, work: Callable[[], object]) -> object:
    """Run `work`, turning its failure into an `ImageInputError` naming the input (returned, not raised): what one
    input does (a ValueError from our checks, or anything a decoder raises) never costs the rest of the batch."""
    try:
        return work()
    except ImageInputError as e:
        return e
    except ValueError as e:
        return ImageInputError(name, str(e))
    except Exception as e:
        return ImageInputError(name, f"{type(e).__name__}: {e}")
