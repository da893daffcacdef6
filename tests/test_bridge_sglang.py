"""The bridge inside a real SGLang 0.5.23 Engine on the CPU: same answers as SGLang's own tower, and
SGLang's per-image cache and chunked prefill still decide what gets encoded.

Each Engine runs in a process of its own (`sglang_driver.py`). The tiny Qwen3-VL (`qwen3vl_checkpoint`)
has a 3-block vision tower; images are resized to at most 16x16 patches (64 tokens), so with prefill
chunks of 32 tokens every image spans several chunks. (The MoE class is served beside stock SGLang in
`test_bridge_server.py`.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from qwen3vl_checkpoint import MAX_PIXELS, MIN_PIXELS

from bridge import backend
from vitjax.preprocess import preprocess_image

HERE = Path(__file__).parent
IMAGES = HERE / "data" / "images"


def user_prompt(images: int, text: str) -> str:
    vision = "<|vision_start|><|image_pad|><|vision_end|>" * images
    return f"<|im_start|>user\n{vision}{text}<|im_end|>\n<|im_start|>assistant\n"


REQUESTS = [
    {"prompt": user_prompt(1, "What is this?"), "images": [str(IMAGES / "astronaut.jpg")]},
    {"prompt": user_prompt(2, "Compare."), "images": [str(IMAGES / "coffee.jpg"), str(IMAGES / "chelsea.png")]},
    # The first request's image again, twice: SGLang's cache serves both, nothing is encoded.
    {"prompt": user_prompt(2, "Same?"), "images": [str(IMAGES / "astronaut.jpg")] * 2},
    # One new image beside a cached one: only the new one is encoded.
    {"prompt": user_prompt(2, "And now?"), "images": [str(IMAGES / "rocket.jpg"), str(IMAGES / "coffee.jpg")]},
]
# Weight updates, then an image not seen before: one of the language model only (as RL trainers push them, here
# its own values), one of two vision tensors, changed (the tower updates them in place; stock SGLang its own), and
# one under SGLang's own parameter name beside a checkpoint name (both prefixes in one update, as stock accepts),
# with a tensor sent twice and one under a name no tower has (stock skips it with a warning; the bridge's server
# used to stop on either).
AFTER_UPDATE = [
    {"update_weights": ["model.language_model.norm.weight", "lm_head.weight"]},
    {"update_weights": ["model.visual.blocks.1.mlp.linear_fc1.weight", "model.visual.merger.norm.bias"], "scale": 3},
    {
        "update_weights": ["model.visual.blocks.0.attn.qkv.weight", "model.visual.blocks.0.attn.qkv.bias"],
        "as": {"model.visual.blocks.0.attn.qkv.weight": "visual.blocks.0.attn.qkv_proj.weight"},
        "also": [
            ["model.visual.blocks.0.attn.qkv.bias", "model.visual.blocks.0.attn.qkv.bias"],
            ["model.visual.blocks.0.extra.weight", "model.visual.merger.norm.bias"],
        ],
        "scale": 2,
    },
    {"prompt": user_prompt(1, "Describe."), "images": [str(IMAGES / "camera.png")]},
]


# Pixel rows given directly (SGLang's processor_output format) that do not fit their grid or their prompt, or come
# without a grid, then rows that do: sent to the bridge's engine after the others (in stock SGLang 0.5.23 each of the
# four takes the whole server down from inside the scheduler). The last one's grid, 4x4 patches, is no other request's.
FOUR_PADS = "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>x<|im_end|>\n"
BAD_ROWS = [
    {"prompt": FOUR_PADS, "processor_output": [12, [1, 4, 4]]},
    {"prompt": FOUR_PADS, "processor_output": [12, [1, 3, 4]]},
    {"prompt": user_prompt(1, "x"), "processor_output": [16, [1, 4, 4]]},
    {"prompt": FOUR_PADS, "processor_output": [16, None]},
    {"prompt": FOUR_PADS, "processor_output": [16, [1, 4, 4]]},
]


def video_prompt(text: str) -> str:
    return f"<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n"


def write_clip(path: Path, frames: int = 12, fps: int = 4) -> Path:
    """A short real clip (MPEG-4 in MP4, written with PyAV): a photo panned one step per frame."""
    import av
    from PIL import Image

    photo = np.asarray(Image.open(IMAGES / "rocket.jpg").convert("RGB").resize((160, 96)))
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(photo[:, 2 * i : 2 * i + 128]), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def sglang_decodes_video() -> bool:
    """SGLang decodes video files with torchcodec, which needs FFmpeg's shared libraries (apt: ffmpeg)."""
    try:
        from torchcodec import _core

        _core.get_ffmpeg_library_versions()
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def runs(dense, tmp_path_factory):
    """Stock SGLang and the bridge on the same requests (images, and a video where SGLang can decode one), the two
    engines side by side; the bridge's then gets `BAD_ROWS`. Returns (answers, tower calls) of stock, of the bridge
    on the same requests, and of the bridge on `BAD_ROWS`."""
    tmp = tmp_path_factory.mktemp("engines")
    requests = REQUESTS + AFTER_UPDATE
    if sglang_decodes_video():
        clip = write_clip(tmp / "clip.mp4")
        requests.append({"prompt": video_prompt("What happens?"), "videos": [str(clip)]})
    stock, (got, calls) = side_by_side(
        (tmp, "stock", "torch", dense, requests), (tmp, "jax", "jax", dense, requests + BAD_ROWS)
    )
    rows = [c for c in calls if c["grid_thw"] == [[1, 4, 4]]]
    n = len(requests)
    return stock, (got[:n], [c for c in calls if c not in rows]), (got[n:], rows)


def side_by_side(*runs: tuple) -> list[tuple]:
    """`run_engine` on each argument tuple, the engines at the same time (each is mostly one busy process)."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return [f.result() for f in [pool.submit(run_engine, *args) for args in runs]]


def engine_process(
    tmp: Path, name: str, backend_name: str, model: Path, requests: list[dict], engine: dict | None = None, **env
) -> subprocess.CompletedProcess:
    """One Engine run in its own process (`engine`: more of SGLang's Engine arguments), finished."""
    spec, out, trace = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.trace.jsonl"
    spec.write_text(
        json.dumps({"backend": backend_name, "model": str(model), "requests": requests, "engine": engine or {}})
    )
    environ = {
        **os.environ,
        "SGLANG_CACHE_DIR": str(tmp / "sglang-cache"),
        backend.TRACE_ENV: str(trace),
        backend.WARMUP_ENV: "512",
        **env,
    }
    return subprocess.run(
        [sys.executable, str(HERE / "sglang_driver.py"), str(spec), str(out)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )


def run_engine(tmp: Path, name: str, *args, **kwargs) -> tuple:
    """(results per request, tower calls traced) of one Engine run (`engine_process`'s arguments)."""
    proc = engine_process(tmp, name, *args, **kwargs)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out, trace = tmp / f"{name}.out.json", tmp / f"{name}.trace.jsonl"
    calls = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    return json.loads(out.read_text()), calls


def assert_same_answers(got: list[dict], ref: list[dict]) -> None:
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert "error" not in g and "error" not in r, (i, g, r)
        assert g["prompt_tokens"] == r["prompt_tokens"] and g["tokens"] == r["tokens"], (i, g, r)
        np.testing.assert_allclose(g["logprobs"], r["logprobs"], atol=1e-4, err_msg=f"request {i}")
        for step_g, step_r in zip(g["top"], r["top"], strict=True):
            assert [a[1] for a in step_g] == [a[1] for a in step_r], (i, step_g, step_r)
            np.testing.assert_allclose([a[0] for a in step_g], [a[0] for a in step_r], atol=1e-4)


def test_engine_with_bridge_equals_stock_sglang_on_images(runs):
    (stock, stock_calls), (got, calls), _ = runs
    assert stock_calls == []  # SGLang's own tower: the bridge never ran
    n = len(REQUESTS)
    assert_same_answers(got[:n], stock[:n])
    calls = [c for c in calls if c["grid_thw"][0][0] == 1]
    # Each new image encoded once, when the first prefill chunk that touches it runs (so the second request's
    # two images come in two calls); the repeated astronaut and the cached coffee are never re-encoded. (The
    # camera comes from the request after the weight update.)
    new = ["astronaut.jpg", "coffee.jpg", "chelsea.png", "rocket.jpg", "camera.png"]
    expected = [preprocess_image(IMAGES / n, MIN_PIXELS, MAX_PIXELS)[1].tolist() for n in new]
    assert [c["grid_thw"] for c in calls] == expected, calls
    assert all(h * w // 4 > 32 for [[_, h, w]] in expected)  # every image spans several 32-token chunks
    assert len({c["pid"] for c in calls}) == 1


def test_weight_updates_keep_the_jax_tower(runs):
    (stock, _), (got, calls), _ = runs
    n = len(REQUESTS)
    for i in (n, n + 1, n + 2):
        assert got[i] == stock[i] == {"update": [[True, "Success"]] * 3}, (got[i], stock[i])
    assert_same_answers([got[n + 3]], [stock[n + 3]])
    camera = preprocess_image(IMAGES / "camera.png", MIN_PIXELS, MAX_PIXELS)[1].tolist()
    images = [c for c in calls if c["grid_thw"][0][0] == 1]  # the fifth new image, in the same process
    assert len(images) == 5 and images[4]["grid_thw"] == camera and images[4]["pid"] == images[0]["pid"]


@pytest.mark.skipif(not sglang_decodes_video(), reason="SGLang's torchcodec needs FFmpeg's libraries (apt: ffmpeg)")
def test_engine_with_bridge_equals_stock_sglang_on_a_video(runs):
    (stock, _), (got, calls), _ = runs
    n = len(REQUESTS) + len(AFTER_UPDATE)
    assert_same_answers(got[n:], stock[n:])
    videos = [g for c in calls for g in c["grid_thw"] if g[0] > 1]
    assert len(videos) == 1 and videos[0][0] >= 2, calls  # one video item, several temporal groups, encoded once


def test_rows_that_do_not_fit_their_grid_fail_their_own_request_only(runs):
    """Pixel rows given directly that do not fit their grid or their prompt, or have no grid, are refused in the
    tokenizer process with vitjax's message, and the engine serves the next request (`BAD_ROWS`)."""
    _, _, (got, calls) = runs
    assert got[0]["error"].endswith("image 0: pixel_values has shape [12, 1536], but grid_thw needs [16, 1536]")
    assert got[1]["error"].endswith("image 0: grid_thw rows [[1, 3, 4]] must be positive with h and w divisible by 2")
    assert got[2]["error"].endswith(
        "image 0: the prompt has 1 placeholder tokens for it, but its grid [(1, 4, 4)] makes 4"
    )
    assert got[3]["error"].endswith("image 0: pixel rows without image_grid_thw")  # SGLang's scheduler would fail
    assert "error" not in got[4] and len(got[4]["tokens"]) == 4
    assert [c["grid_thw"] for c in calls] == [[[1, 4, 4]]]  # the refused ones never reached the tower
