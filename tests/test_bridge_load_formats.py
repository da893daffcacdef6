"""SGLang's load formats that skip the model's `load_weights`, in a real SGLang 0.5.23 Engine on the CPU (the
engines of `test_bridge_sglang.py`, in a file of their own so xdist can run them on another worker)."""

from __future__ import annotations

import shutil

from qwen3vl_checkpoint import MAX_PIXELS, MIN_PIXELS
from test_bridge_sglang import IMAGES, REQUESTS, engine_process, run_engine

from vitjax.preprocess import preprocess_image


def test_load_formats_that_skip_load_weights(dense, tmp_path):
    """`--load-format dummy` (benchmarks): SGLang reads no checkpoint and draws its parameters at random; the JAX
    tower gets random weights of its own and the request is answered (the server used to die at warm-up). A format
    that fills SGLang's parameters another way (here `sharded_state`, from that engine's `save_sharded_model`, which
    holds no vision tensors) is refused at start, by name, where it used to serve a random tower."""
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    requests = [REQUESTS[0], {"save_sharded": str(sharded)}]
    [got, saved], calls = run_engine(tmp_path, "dummy", "jax", dense, requests, engine={"load_format": "dummy"})
    assert "error" not in got and len(got["tokens"]) > 0, got
    astronaut = preprocess_image(IMAGES / "astronaut.jpg", MIN_PIXELS, MAX_PIXELS)[1].tolist()
    assert [c["grid_thw"] for c in calls] == [astronaut]

    assert saved == {"saved": str(sharded)} and list(sharded.glob("model-rank-0-part-*.safetensors"))
    for f in dense.iterdir():  # the config, tokenizer and processor beside the saved parameters
        if f.suffix != ".safetensors":
            shutil.copy(f, sharded)
    proc = engine_process(tmp_path, "sharded", "jax", sharded, REQUESTS[:1], engine={"load_format": "sharded_state"})
    assert proc.returncode != 0
    assert "vitjax: --load-format sharded_state gave SGLang's parameters their values without" in proc.stderr
    assert not (tmp_path / "sharded.out.json").exists()
