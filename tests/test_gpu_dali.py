"""decoder="dali" on a GPU: nvJPEG's decode (DALI's "mixed" backend) against the exact PIL path, and bad input.

Skipped without an NVIDIA GPU and DALI. The shared conftest pins JAX to the CPU unless told otherwise, so run:

    JAX_PLATFORMS=cuda python -m pytest -m gpu tests/test_gpu_dali.py -s

The CPU twin, tests/test_dali.py, holds DALI's CPU backend to PIL's decode bit for bit. nvJPEG's IDCT is not
libjpeg-turbo's, so here the rows differ: on an H200 at most 48 levels and 0.002-0.68
on average on the photos, 7-14 levels and 0.84-1.32 on average on the 7x5, 6400x32 and 32x6400 JPEGs, whose
upscaling spreads each decoded difference over many rows. A wrong orientation, colour order or resize moves the
mean by tens of levels, which is what the bounds below are for; the embeddings stay within cosine 0.9995 of PIL's
(0.99963 at worst, the 32x6400 one). The routing (which inputs DALI gets), the refusals of corrupt files and
the rest of a batch surviving them are the CPU twin's cases, run through the GPU decoder.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY, assert_close_to_scale
from PIL import Image
from test_dali import CASES, LEVEL, PHOTOS, SMALL, bad_inputs, dali_rows, jpeg
from test_gpu_parity import _cos_mae, _gpu

import vitjax
from vitjax.dali import DaliRows
from vitjax.images import ImageInputError
from vitjax.preprocess import MAX_PIXELS, MIN_PIXELS, preprocess_image

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda)")]


@pytest.fixture(scope="module")
def enc():
    return vitjax.Encoder.random(TINY["hd64"], dtype="float32", attention="reference", cache_bytes=0)


@pytest.mark.parametrize(("max_pixels", "backend"), [(MAX_PIXELS, "pil"), (SMALL, "pil"), (SMALL, "torchvision")])
def test_rows_match_the_cpu_rows_within_nvjpeg(max_pixels, backend):
    """Also with image_processor_backend="torchvision": its pass order and table, against its exact rows."""
    import jax

    rows = DaliRows(vitjax.VisionConfig.preset("qwen3-vl-2b"), jax.devices()[0])
    items, pixels, errors = dali_rows(rows, CASES, max_pixels, backend)
    assert errors == [None] * len(CASES) and isinstance(pixels, jax.Array)  # the rows stay on the GPU
    pixels, start, worst = np.asarray(pixels), 0, {}
    for (name, data), item in zip(CASES.items(), items, strict=True):
        got = pixels[start : start + item.tokens]
        start += item.tokens
        ref, grid = preprocess_image(data, MIN_PIXELS, max_pixels, backend=backend)
        assert item.grid == tuple(grid[0]), name
        assert item.decoder == ("pil" if name.endswith(".png") else "dali"), name
        diff = np.abs(got - ref) / LEVEL
        worst[name] = (float(diff.max()), float(diff.mean()))
        print(f"{name} at {max_pixels} pixels, {backend}: max {diff.max():.1f} levels, mean {diff.mean():.3f}")
    for name, (most, mean) in worst.items():
        if name.endswith(".png"):  # routed to PIL: its pixels pass through DALI untouched (the backend's table)
            assert most == 0, name  # exactly: an ulp of the other table would show
        else:
            assert most <= 64 and mean <= 2.0, (name, most, mean)


def test_auto_is_dali_and_embeddings_match_pil(enc):
    assert enc.resolve_decoder("auto") == "dali"
    inputs = list(CASES.values())
    pil = enc.encode(inputs, max_pixels=SMALL, decoder="pil")
    dali = enc.encode(inputs, max_pixels=SMALL)
    for name, a, b in zip(CASES, pil, dali, strict=True):
        assert a.grid_thw == b.grid_thw and b.decoder == ("pil" if name.endswith(".png") else "dali"), name
        cosine, mae = _cos_mae(np.asarray(a.features), np.asarray(b.features))
        print(f"{name}: cosine {cosine:.6f}, MAE {mae:.2e}")
        assert cosine >= 0.9995, (name, cosine)


def test_corrupt_files_are_refused_and_the_rest_of_the_batch_is_kept(enc, tmp_path):
    """A stray marker in the scan (PIL refuses it; DALI would decode garbage) and bogus Huffman tables (DALI
    refuses), round after round, beside a good JPEG; then every bad file of the CPU twin, each named."""
    good = jpeg(Image.open(PHOTOS[2]).convert("RGB"))
    scan = good.index(b"\xff\xda")
    stray = good[: scan + 3000] + b"\xff\xc8" + good[scan + 3002 :]
    huffman = good.index(b"\xff\xc4") + 5
    bogus = good[:huffman] + b"\xff" * 16 + good[huffman + 16 :]
    (alone,) = enc.encode([good], max_pixels=SMALL, decoder="dali")
    for _ in range(16):
        results = enc.encode([stray, good, bogus], max_pixels=SMALL, decoder="dali", errors="return")
        assert [type(r).__name__ for r in results] == ["ImageInputError", "Encoded", "ImageInputError"]
        assert "broken data stream" in results[0].reason and results[1].decoder == "dali"
        assert results[2].reason == "corrupt JPEG data (DALI's decoder refused it)"
        assert_close_to_scale(np.asarray(results[1].features), np.asarray(alone.features))
    bad = bad_inputs(tmp_path)
    results = enc.encode([*bad, good], max_pixels=SMALL, decoder="dali", errors="return")
    for (name, fragment), result in zip(bad.items(), results, strict=False):
        assert isinstance(result, ImageInputError) and result.name == name and fragment in result.reason, result
    assert_close_to_scale(np.asarray(results[-1].features), np.asarray(alone.features))
