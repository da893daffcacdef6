"""Images in, embeddings out, end to end: vitjax `Encoder.encode` against HF's image processor + tower.

The workload of DESIGN.md's decode row: 20 distinct JPEGs of 960x1280 (made from the photographs in
tests/data/images, each cropped differently), as encoded bytes. HF: `Qwen2VLImageProcessorPil` with
Qwen3-VL's settings (decode, resize, normalize, patchify on the CPU), then its `Qwen3VLVisionModel`
(sdpa, bf16) on the GPU. vitjax: `Encoder.encode(jpeg_bytes)` with the embedding cache off (decode and
preprocessing in threads, bucketed tower) on the same weights. Both are timed until the embeddings are
ready on the GPU; the CPU-side preprocessing of each is also timed alone (vitjax's into rows of each dtype it has
sent: uint8 levels since 2026-11-28, bfloat16 before).

    PYTHONPATH=. python bench/bench_encode.py --out bench/results
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import io
import json
import os
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import ml_dtypes
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_image_processor import hf_processor  # noqa: E402
from bench_vit import PRESET, flops, jpegs, median_time, results_file, versions  # noqa: E402

import vitjax  # noqa: E402
import vitjax.cache  # noqa: E402
import vitjax.encoder  # noqa: E402
import vitjax.preprocess  # noqa: E402
from vitjax.engine import FIT_AFTER  # noqa: E402
from vitjax.pipeline import Pipeline, default_workers  # noqa: E402
from vitjax.preprocess import LEVELS, preprocess_image  # noqa: E402
from vitjax.resize import resize_bicubic  # noqa: E402


def inline_dispatch(enc: vitjax.Encoder):
    """`Encoder._dispatch` as it was before 2026-11-27: each call made in the encode's own thread, so its host work
    on the next call waits while a dispatch waits for the device."""

    def dispatch(pipe, batch, found, dispatcher, in_flight) -> None:
        if len(in_flight) >= 2:
            jax.block_until_ready(in_flight.popleft().result())
        done = Future()
        done.set_result(enc._call(pipe, batch, found))
        in_flight.append(done)

    return dispatch


M_TOP_PAD = -2  # glibc's mallopt parameter


def top_pad(nbytes: int) -> None:
    """How much free memory glibc keeps at the top of each arena rather than handing it back to the kernel. Setting it
    also fixes glibc's mmap threshold (128 KiB unless set), which otherwise follows the largest block freed: a
    process-wide change that cannot be undone, so it is a setting of the whole run (`--malloc-top-pad`)."""
    if not ctypes.CDLL(None).mallopt(M_TOP_PAD, nbytes):
        raise RuntimeError("mallopt(M_TOP_PAD) failed")


def old_resized_pixels(image: Image.Image, height: int, width: int, backend: str = "pil") -> np.ndarray:
    """`preprocess.resized_pixels` as it was through 2026-11-27: numpy's copy (Pillow's `tobytes`) of the image, resized
    by Pillow even to its own size."""
    if backend == "pil":
        return np.asarray(image.resize((width, height), Image.Resampling.BICUBIC))
    return resize_bicubic(np.asarray(image), height, width)


SHIPPED_PIXELS = (vitjax.preprocess.resized_pixels, vitjax.cache.rgb_bytes)


def pixels_copied(on: bool) -> None:
    """Put the pixel copies of 2026-11-27 (`old_resized_pixels`, and `np.asarray` for the digest) in place, or the
    shipped `resized_pixels` and `rgb_bytes` back."""
    pixels = (old_resized_pixels, np.asarray) if on else SHIPPED_PIXELS
    vitjax.preprocess.resized_pixels, vitjax.cache.rgb_bytes = pixels


class FirstCallPipeline(Pipeline):
    """`Pipeline` whose first batch of an encode holds at most 1/`share` of the call budget (at least 4,800 rows, one
    photo): the device starts on a small call while the host makes the next, larger one."""

    def __init__(self, *args, share: int, **kw):
        super().__init__(*args, **kw)
        self._share = share
        self._first = True

    def batch(self, rows: int, host: bool | None = None):
        if self._first:
            self._first = False
            rows = max(rows // self._share, 4800)
        return super().batch(rows, host)


def pipeline_kind(parts: list[str]):
    """The `Pipeline` class a path's parts name (first_call_N), with its settings."""
    first = [int(p.removeprefix("first_call_")) for p in parts if p.startswith("first_call_")]
    return functools.partial(FirstCallPipeline, share=first[0]) if first else Pipeline


def settled(call, enc: vitjax.Encoder) -> None:
    """`call` made as often as a size must be seen before its fitted bucket compiles, then that compile waited for:
    the calls after it run in the fitted bucket, with nothing compiling beside them."""
    for _ in range(FIT_AFTER):
        call()
    for engine in enc.parallel.engines:
        engine.settle()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--devices", default="1", help="comma-separated device counts for vitjax (data parallel)")
    parser.add_argument("--decoders", default="auto", help="comma-separated vitjax decoders: auto, pil, dali")
    parser.add_argument(
        "--batch-tokens",
        default="98304,65536,24576",
        help="comma-separated patches per call for vitjax end to end (98304: the 20 photos in one call; 65536: the "
        "default; 24576: calls of ~5 photos, the default until 2026-11-26 where max_pixels allowed it)",
    )
    parser.add_argument(
        "--paths",
        default="shipped",
        help="vitjax end to end: code paths in this order, comma-separated, repeats allowed: shipped, "
        "inline_dispatch (each call dispatched from the encode's own thread, as before 2026-11-27), or bf16_rows "
        "(rows made and sent as bfloat16 values, as before 2026-11-28, not as uint8 levels); first_call_N (an encode's "
        "first call holds 1/N of the call budget); asarray (an image's pixels copied out by np.asarray, Pillow's "
        "tobytes, for its digest and rows, and resized even to its own size, as before 2026-11-28); joined with +",
    )
    parser.add_argument(
        "--workers",
        help="comma-separated counts of preprocessing threads (the pipeline's workers; default: its own default), "
        "for the preprocessing alone and vitjax end to end",
    )
    parser.add_argument(
        "--malloc-top-pad",
        type=int,
        help="bytes glibc keeps free at each arena's top, set for the whole run (mallopt M_TOP_PAD; this also fixes "
        "its mmap threshold); default: glibc's own settings",
    )
    parser.add_argument(
        "--switch-intervals",
        help="vitjax end to end under each of these Python switch intervals (ms, comma-separated; default: the "
        "interpreter's): how long a thread that let go of Python's lock may wait to get it back",
    )
    args = parser.parse_args()
    if args.malloc_top_pad is not None:
        top_pad(args.malloc_top_pad)

    import torch
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = vitjax.VisionConfig.preset(PRESET)
    data = jpegs(args.images)
    meta = versions()
    rows = []

    def emit(row: dict) -> None:
        top = {"malloc_top_pad": args.malloc_top_pad} if args.malloc_top_pad is not None else {}
        rows.append({**meta, "bench": "encode", "workload": f"{args.images}x960x1280 jpeg", **top, **row})
        print(json.dumps(rows[-1]), flush=True)

    # HF: processor (PIL backend, exact) then the tower, on weights vitjax loads below.
    processor = hf_processor("pil")
    hf_cfg = Qwen3VLVisionConfig(**{k: v for k, v in cfg.to_hf().items() if k != "model_type"})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3VLVisionModel._from_config(hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    weights_dir = Path(tempfile.mkdtemp())
    model.save_pretrained(weights_dir)

    def hf_preprocess():
        return processor(images=[Image.open(io.BytesIO(b)) for b in data], return_tensors="pt")

    def hf_end_to_end():
        batch = hf_preprocess()
        with torch.inference_mode():
            model(batch["pixel_values"].to("cuda", torch.bfloat16), grid_thw=batch["image_grid_thw"].to("cuda"))
        torch.cuda.synchronize()

    grids = [tuple(int(v) for v in g) for g in hf_preprocess()["image_grid_thw"]]
    gemm, attn = flops(cfg, grids)
    t, times = median_time(hf_preprocess, 5)
    emit({"impl": "hf", "part": "preprocess", "ms": t * 1e3, "ms_all": [round(v * 1e3, 2) for v in times]})
    t, times = median_time(hf_end_to_end, 5)
    emit(
        {
            "impl": "hf",
            "part": "end_to_end",
            "ms": t * 1e3,
            "ms_all": [round(v * 1e3, 2) for v in times],
            "patches": sum(np.prod(g) for g in grids).item(),
            "tflops": (gemm + attn) / t / 1e12,
        }
    )
    model = None  # free the GPU for JAX
    torch.cuda.empty_cache()

    worker_counts = [int(w) for w in args.workers.split(",")] if args.workers else [default_workers()]
    shapes = [(int(np.prod(g)), cfg.patch_dim) for g in grids]
    for workers, dtype in [(w, d) for w in worker_counts for d in (LEVELS, np.dtype(ml_dtypes.bfloat16))]:

        def vj_preprocess(dtype=dtype, workers=workers):
            with ThreadPoolExecutor(workers) as pool:
                return list(pool.map(lambda b, shape: preprocess_image(b, out=np.empty(shape, dtype)), data, shapes))

        t, times = median_time(vj_preprocess, 5)
        emit(
            {
                "impl": "vitjax",
                "part": f"preprocess {dtype.name}",
                "ms": t * 1e3,
                "ms_all": [round(v * 1e3, 2) for v in times],
                "threads": workers,
                "rows": dtype.name,
            }
        )
    # Calls of each --batch-tokens (tokens per device: with several devices each call is split over them).
    for devices in (int(n) for n in args.devices.split(",")):
        enc = vitjax.Encoder.from_pretrained(weights_dir, dtype="bfloat16", cache_bytes=0, devices=devices)
        intervals = [float(v) for v in args.switch_intervals.split(",")] if args.switch_intervals else [None]
        sizes = [int(b) for b in args.batch_tokens.split(",")]
        paths = args.paths.split(",")
        runs = [
            (d, b, i, w, p)
            for d in args.decoders.split(",")
            for b in sizes
            for i in intervals
            for w in worker_counts
            for p in paths
        ]
        default_interval = sys.getswitchinterval()
        shipped_dispatch, shipped_rows = enc._dispatch, enc._row_dtype
        for decoder, batch_tokens, interval, workers, path in runs:
            sys.setswitchinterval(default_interval if interval is None else interval / 1e3)
            parts = path.split("+")
            vitjax.encoder.Pipeline = pipeline_kind(parts)
            enc._dispatch = inline_dispatch(enc) if "inline_dispatch" in parts else shipped_dispatch
            enc._row_dtype = np.dtype(ml_dtypes.bfloat16) if "bf16_rows" in parts else shipped_rows
            pixels_copied("asarray" in parts)

            def vj_end_to_end(enc=enc, batch_tokens=batch_tokens, decoder=decoder, workers=workers):
                # default pixel bounds, as HF's
                out = enc.encode(data, batch_tokens=batch_tokens, decoder=decoder, workers=workers)
                jax.block_until_ready([o.features for o in out])

            settled(vj_end_to_end, enc)
            t, times = median_time(vj_end_to_end, 5)
            emit(
                {
                    "impl": "vitjax",
                    "part": f"end_to_end@{batch_tokens}" + (f"x{devices}gpu" if devices > 1 else "") + f" {decoder}",
                    "decoder": enc.resolve_decoder(decoder),
                    "ms": t * 1e3,
                    "ms_all": [round(v * 1e3, 2) for v in times],
                    "patches": sum(np.prod(g) for g in grids).item(),
                    "tflops": (gemm + attn) / t / 1e12,
                    "attention": enc.attention,
                    "batch_tokens": batch_tokens,
                    "devices": devices,
                    "switch_interval_ms": sys.getswitchinterval() * 1e3,
                    "rows": enc._row_dtype.name,
                    "workers": workers,
                    **({"path": path} if path != "shipped" else {}),
                }
            )
        sys.setswitchinterval(default_interval)
        vitjax.encoder.Pipeline = Pipeline
        pixels_copied(False)
        # The two row forms give the same embeddings: levels mapped on the device are the bf16 values the host made.
        features = {}
        for row_dtype in (shipped_rows, np.dtype(ml_dtypes.bfloat16)):
            enc._row_dtype = row_dtype

            def encoded(enc=enc, batch_tokens=sizes[0]):
                return enc.encode(data, batch_tokens=batch_tokens, decoder="pil")

            settled(encoded, enc)  # both forms in their fitted buckets: the same shapes
            features[row_dtype.name] = np.concatenate([np.asarray(o.features, np.float64) for o in encoded()])
        enc._row_dtype = shipped_rows
        a, b = features.values()
        emit(
            {
                "impl": "vitjax",
                "part": "levels_against_bf16_rows" + (f"x{devices}gpu" if devices > 1 else ""),
                "identical": bool(np.array_equal(a, b)),
                "max_abs_diff": float(np.abs(a - b).max()),
                "cosine": float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b)),
                "devices": devices,
            }
        )

    args.out.mkdir(parents=True, exist_ok=True)
    path = results_file(args.out, meta)
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n{'impl':8} {'part':22} {'path':16} {'thr':>4} {'ms':>9}")
    for r in rows:
        threads = r.get("workers", r.get("threads", ""))
        print(f"{r['impl']:8} {r['part']:22} {r.get('path', ''):16} {threads!s:>4} {r.get('ms', float('nan')):9.1f}")


if __name__ == "__main__":
    main()
