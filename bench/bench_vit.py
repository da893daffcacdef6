"""vitjax against HF transformers' Qwen3VLVisionModel (PyTorch, sdpa) on one GPU, same random bf16 weights.

The HF tower is built from the 8B vision config with random init in bf16 on the GPU; its weights go
through `save_pretrained` and vitjax's own loader (`Encoder.from_pretrained`: `vitjax.weights` ->
`Encoder.from_params`), so both run identical weights on identical pixel rows: random ones, or with --pixels photos
the rows of 20 photographs (at the power limit a call's time depends on its data). HF is timed on
its tower forward alone (inputs already on the GPU, `torch.cuda.synchronize` around it); vitjax on the
full `encode_patches` call (host layout, host-to-device copy of the fp32 pixel rows, tower; the outputs stay
on the GPU, as HF's do), and also on the device-only tower call (`Engine.run` on device-resident pixels, its
host dispatch included as HF's is) for a like-for-like number: the table's "dev x HF". Also measured: per-part
times, achieved TFLOP/s, peak GPU memory, cold compile time per bucket (empty persistent cache) and warm start
(a second process reading that cache); with --profile, the device time of every op of the device-only call; with
$HLO_DIR set, each bucket's optimized program is written there.
With --paths shipped,previous the vitjax runs repeat on an earlier code path (`PATHS`), for a comparison in one process.
With --rows levels vitjax's calls get random uint8 levels (as `encode` sends a 16-bit tower's rows), not HF's rows;
per-part times and the warm start are then skipped.

    PYTHONPATH=. python bench/bench_vit.py --sweep          # writes bench/results/<device>-<date>.jsonl

Results: one JSON object per line; the last lines printed are a short table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import gzip
import io
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Both frameworks share the GPU: JAX grows its pool on demand instead of taking 75% up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")

import code_revision  # noqa: E402  (bench/ is on sys.path when run as a script)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from PIL import Image  # noqa: E402

import vitjax  # noqa: E402
from vitjax import layout  # noqa: E402
from vitjax.attention import widen  # noqa: E402
from vitjax.buckets import Bucket, BucketPolicy  # noqa: E402
from vitjax.engine import COMPILER_OPTIONS, FIT_AFTER  # noqa: E402
from vitjax.fa4 import FA4_TILES, Fa4Tile, set_fa4_tile  # noqa: E402
from vitjax.model import TowerInputs, VisionTower, rotary_tables  # noqa: E402
from vitjax.parallel import DataParallel, group_rows, split_balanced  # noqa: E402
from vitjax.preprocess import LEVELS, preprocess_image  # noqa: E402
from vitjax.row_views import row_view  # noqa: E402

PRESET = "qwen3-vl-8b"
RESOLUTIONS = {"720p": (1, 44, 80), "1080p": (1, 68, 120), "2k": (1, 90, 160), "960x1280": (1, 80, 60)}
MAIN = [("1x720p", 1, "720p"), ("8x1080p", 8, "1080p"), ("20x960x1280", 20, "960x1280")]
MAIN_NAMES = frozenset(name for name, _, _ in MAIN)  # the workloads that get per-op, per-part and sustained rows
PHOTOS = Path(__file__).resolve().parents[1] / "tests" / "data" / "images"
PIXELS = ("noise", "photos")  # what `pixel_pools` makes
# Videos at HF's Qwen3-VL defaults (2 frames a second, ~137k pixels a frame): clips of 60 s to 257 s, as many
# temporal slices of 16x30 patches, each slice its own attention segment (`vitjax.preprocess.video_resized_size`).
# The 65, 129 and 257 s clips sit just past a rung of the segment ladder (one slice a second).
CLIPS = [(f"1x{t}s-clip", (t, 16, 30)) for t in (60, 65, 120, 129, 257)]
# Requests of more than 64 images (`--many`), each one call in a bucket of 128 or 256 slots: (name, count, grid).
MANY = [
    ("200x256x256", 200, (1, 16, 16)),
    ("128x384x384", 128, (1, 24, 24)),
    ("80x480x640", 80, (1, 40, 30)),
    ("100x512x512", 100, (1, 32, 32)),
    ("65x512x768", 65, (1, 48, 32)),
]
# Several GPUs (`--scaling`): many images for data parallelism, one huge image for Ulysses (65,536 patches).
SCALING = [("64x1080p", 64, (1, 68, 120)), ("1x4096x4096", 1, (1, 256, 256))]
SWEEP_COUNTS = (1, 2, 4, 8, 16, 32)
SWEEP_RES = ("720p", "1080p", "2k")
MIN_ENERGY_WINDOW_S = 1.0  # the shortest window the energy counter is read over (see GpuSampler)
SHIPPED_TILES = dict(FA4_TILES)  # fa4 schedules as the library ships them (a run may set others)


def workloads(
    sweep: bool, smoke: bool, video: bool = False, many: bool = False, scaling: bool = False
) -> list[tuple[str, list[tuple[int, int, int]]]]:
    res = {k: (1, h // 8 * 2, w // 8 * 2) for k, (_, h, w) in RESOLUTIONS.items()} if smoke else RESOLUTIONS
    items = [(name, [res[r]] * n) for name, n, r in MAIN]
    if video:
        items += [(name, [(t, h // 8 * 2, w // 8 * 2) if smoke else (t, h, w)]) for name, (t, h, w) in CLIPS]
    if many:
        items += [(name, [(1, h // 8 * 2, w // 8 * 2) if smoke else (t, h, w)] * n) for name, n, (t, h, w) in MANY]
    if scaling:
        items += [(name, [(1, h // 8 * 2, w // 8 * 2) if smoke else (t, h, w)] * n) for name, n, (t, h, w) in SCALING]
    if sweep:
        items += [(f"{n}x{r}", [res[r]] * n) for r in SWEEP_RES for n in SWEEP_COUNTS]
    seen, out = set(), []
    for name, grids in items:
        if name not in seen:
            seen.add(name)
            out.append((name, grids))
    return out


def flops(cfg: vitjax.VisionConfig, grids) -> tuple[float, float]:
    """(GEMM FLOPs, attention FLOPs) of one tower call on these grids (multiply-add = 2)."""
    d, inter, out = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size
    tokens = sum(t * h * w for t, h, w in grids)
    per_block = 2 * tokens * (d * 3 * d + d * d + 2 * d * inter)
    mergers = (1 + len(cfg.deepstack_visual_indexes)) * 2 * (tokens // 4) * (16 * d * d + 4 * d * out)
    gemm = 2 * tokens * cfg.patch_dim * d + cfg.depth * per_block + mergers
    attn = cfg.depth * 4 * d * sum(t * (h * w) ** 2 for t, h, w in grids)
    return float(gemm), float(attn)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_time(fn, reps: int) -> tuple[float, list[float]]:
    fn()
    times = [_timed(fn) for _ in range(reps)]
    return float(np.median(times)), times


def device_events(call, calls: int = 3, hlo: bool = False) -> list[tuple[str, str, float, float]]:
    """(device line, op, start µs, duration µs) of every GPU op of `calls` runs of `call` (which waits for its
    results) under JAX's profiler, in time order. XLA's device lines name each op (fusions, custom calls, GEMMs)
    as in the optimized HLO; a library kernel (cuBLAS's) goes by its own name, so `hlo` appends the HLO op that
    launched it (which GEMM of the block a kernel ran)."""
    jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(call())
        trace = json.loads(gzip.decompress(next(Path(folder).rglob("perfetto_trace.json.gz")).read_bytes()))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {}  # (pid, tid or None) -> name
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    ops = []
    for e in events:
        process = names.get((e.get("pid"), None), "")
        if e.get("ph") == "X" and ("GPU" in process or "gpu" in process):
            op = e["name"]
            if hlo:
                op = f"{op} @ {e.get('args', {}).get('hlo_op', '?')}"
            ops.append((names.get((e["pid"], e.get("tid")), "?"), op, float(e["ts"]), float(e.get("dur", 0))))
    return sorted(ops, key=lambda op: op[2])


def op_times(call, calls: int = 3, hlo: bool = False) -> list[tuple[str, str, float]]:
    """(device line, op, ms per call) of `calls` runs of `call` under JAX's profiler, largest first (`hlo`: as in
    `device_events`)."""
    total: dict[tuple[str, str], float] = collections.defaultdict(float)
    for line, op, _, dur in device_events(call, calls, hlo):
        total[(line, op)] += dur / 1e3 / calls
    return sorted(((line, op, ms) for (line, op), ms in total.items()), key=lambda r: -r[2])


class GpuSampler:
    """The first GPU's SM clock, board power and temperature, sampled by nvidia-smi every 100 ms while a workload
    runs: an H200 holds its 700 W limit by lowering the clock, so the same program runs slower on a hotter or busier
    board, and these medians say which (empty where nvidia-smi is missing). With `calls`, the board's energy counter
    (NVML) gives the joules each of that many calls took, gaps between them included, beside the enforced power
    limit; only over windows of `MIN_ENERGY_WINDOW_S` or more, since the counter advances in coarse steps (70 ms
    windows read 0 J)."""

    def __init__(self, calls: int = 0):
        self.calls = calls

    def __enter__(self) -> GpuSampler:
        self.stats: dict[str, float] = {}
        fields = "clocks.sm,power.draw,temperature.gpu"
        query = ["nvidia-smi", "-i", "0", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
        try:
            self._proc = subprocess.Popen([*query, "-lms", "100"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self._proc = None
        self._energy = _nvml_energy() if self.calls else None
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        window = time.perf_counter() - self._start
        end = _nvml_energy() if self._energy and window >= MIN_ENERGY_WINDOW_S else None
        if end:
            joules = (end[0] - self._energy[0]) / 1e3 / self.calls
            self.stats.update(energy_j_per_call=joules, power_limit_w=end[1])
        if self._proc is None:
            return
        self._proc.terminate()
        values = []
        for line in self._proc.communicate()[0].splitlines():
            try:
                values.append([float(v) for v in line.split(",")])
            except ValueError:  # "[N/A]" on boards that do not report one of them
                continue
        if values:
            clock, power, celsius = np.median(np.array(values), axis=0)
            self.stats.update(
                sm_mhz_median=float(clock), power_w_median=float(power), temperature_c_median=float(celsius)
            )


def sustained(call, seconds: float, call_s: float, window_s: float = 5.0) -> list[dict]:
    """`call` back to back for `seconds`, in windows of about `window_s` (`call_s` a call): each window's median call
    (ms) with the board's energy per call, clock, power and temperature (`GpuSampler`). A server under steady load
    runs where the last windows do, on a warmer board than the first calls'."""
    calls = max(3, round(window_s / call_s))
    windows, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        with GpuSampler(calls=calls) as gpu:
            times = [_timed(call) for _ in range(calls)]
        windows.append(
            {"ms": round(float(np.median(times)) * 1e3, 3), **{k: round(v, 2) for k, v in gpu.stats.items()}}
        )
    return windows


def _nvml_energy() -> tuple[float, float] | None:
    """The first GPU's energy counter (mJ since the driver loaded) and enforced power limit (W), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)), limit
    except Exception:  # no NVML here (a CPU run), or a board without the counter
        return None


def spare_slot_run_blocks(self, x, inputs, impl="reference"):
    """The previous tap path (before `vitjax.taps`): every block writes its output into the tap buffer, a block that
    is not a tap into a spare last slot (XLA's dynamic update copies the whole state in every block)."""
    return taps_run_blocks(self, x, inputs, impl, 1, lambda t, h, s: jax.lax.dynamic_update_index_in_dim(t, h, s, 0))


def taps_run_blocks(self, x, inputs, impl, spare, write):
    """`VisionTower.run_blocks` with another tap write `write(tapped, h, slot)`, into a buffer of `spare` more slots
    than taps."""
    cfg = self.cfg
    cos, sin = rotary_tables(inputs.rope_pos, cfg.head_dim, cfg.rope_theta)
    k = len(cfg.deepstack_visual_indexes)
    slots = np.full(cfg.depth, k, np.int32)
    slots[list(cfg.deepstack_visual_indexes)] = np.arange(k)
    graph, params = nnx.split(self.blocks)

    def step(carry, xs):
        h, tapped = carry
        block_params, slot = xs
        h = nnx.merge(graph, block_params)(h, cos, sin, inputs.segments, impl)
        return (h, write(tapped, h, slot)), None

    tapped = jnp.zeros((k + spare, *x.shape), x.dtype)
    (x, tapped), _ = jax.lax.scan(step, (x, tapped), (params, jnp.asarray(slots)))
    return x, tapped[:k]


def previous_device_pieces(self, pixels, row, rows, tokens, chunk):
    """`Engine._device_pieces` before 2026-11-26: one row view at a time (the per-array lookups repeated), the
    partial chunk's offset and length copied to the device with every call."""
    pieces = []
    for start in range(row, row + tokens, chunk):
        end = min(start + chunk, row + rows)
        if end - start == chunk:
            pieces.append(row_view(pixels, start, chunk))
        elif end > start:
            window = min(start, pixels.shape[0] - chunk)
            pieces.append(vitjax.engine._partial_chunk(row_view(pixels, window, chunk), start - window, end - start))
        else:
            pieces.append(self._zero(self.devices[0], chunk, np.dtype(pixels.dtype)))
    return tuple(pieces)


def threaded_encode(self, pixel_values, grids):
    """`DataParallel.encode` before 2026-11-26: every engine's group through the device threads, empty ones too."""
    sizes = [layout.grid_tokens(g) for g in grids]
    groups = split_balanced(sizes, len(self.engines))
    first_rows = np.concatenate([[0], np.cumsum(sizes)]).tolist()

    def work(pair):
        engine, group = pair
        if not group:
            return []
        rows, first = group_rows(pixel_values, first_rows[group.start], first_rows[group.stop])
        return engine.encode(rows, [grids[i] for i in group], first)

    pairs = list(zip(self.engines, groups, strict=True))
    outs = [work(pairs[0])] if self._pool is None else list(self._pool.map(work, pairs))
    return [out for group_outs in outs for out in group_outs]


def rotary_then_widen(x, cos, sin, extra=()):
    """q's and k's rotary as before 2026-11-26's seventh session: rotate_half's concatenation inside the elementwise
    pass, then the extra columns appended by a second concatenation."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = (xf * cos[:, None] + jnp.concatenate([-x2, x1], axis=-1) * sin[:, None]).astype(x.dtype)
    return widen(out, extra)


def wide_output_attention(self, x, cos, sin, segments, impl):
    """The block's attention as before 2026-11-26's eighth session: fa4 under a value-sums schedule wrote its output
    as wide as v (80 at head_dim 72), whose appended columns met zero rows of the projection (K = 1280)."""
    extra = vitjax.attention.value_columns(impl, self.head_dim)
    qk, v = self.qk_v(x, extra)
    scale, q_extra, k_extra = vitjax.attention.query_key_columns(impl, self.head_dim, qk.dtype)
    q = vitjax.model.apply_rotary(qk[:, 0], cos * scale, sin * scale, q_extra)
    k = vitjax.model.apply_rotary(qk[:, 1], cos, sin, k_extra)
    out = vitjax.attention.attention(q, k, v, segments, impl, self.head_dim).reshape(x.shape[0], -1)
    if out.shape[1] == self.num_heads * self.head_dim:
        return self.proj(out)
    w = self.proj.kernel[...].reshape(self.num_heads, self.head_dim, -1)
    w = jnp.pad(w, ((0, 0), (0, len(extra)), (0, 0))).reshape(out.shape[1], -1)
    return jnp.dot(out, w, precision=self.proj.precision) + self.proj.bias[...]


# Code paths a vitjax run can take (`--paths`): attributes replaced while its executables are traced and run.
PATHS = {
    "shipped": {},
    "spare_slot": {(VisionTower, "run_blocks"): spare_slot_run_blocks},  # the tap write before `vitjax.taps`
    "previous": {  # before 2026-11-26: zeroed tap buffer, jax.nn.gelu's erfc form in the mergers, the host path above
        (vitjax.model, "tap_buffer"): lambda shape, dtype: jnp.zeros(shape, dtype),
        (vitjax.model, "exact_gelu"): lambda h: jax.nn.gelu(h.astype(jnp.float32), approximate=False).astype(h.dtype),
        (vitjax.engine.Engine, "_device_pieces"): previous_device_pieces,
    },
    "threaded": {(DataParallel, "encode"): threaded_encode},  # a one-image request through a device thread
    "rotary_then_widen": {(vitjax.model, "apply_rotary"): rotary_then_widen},
    "shift_threshold_1e8": {(vitjax.fa4, "FA4_FIXED_SHIFT_MIN_WORK"): 10**8},  # before 2026-11-26's 7th session
    # cuBLASLt's first N kernels for each GEMM, timed by XLA's autotuner (0, shipped: every kernel cuBLASLt offers)
    **{
        f"gemm_top{n}": {(vitjax.engine, "COMPILER_OPTIONS"): {**COMPILER_OPTIONS, "xla_gpu_autotune_max_solutions": n}}
        for n in (2, 3, 4, 8)
    },
    "wide_output": {
        (vitjax.fa4, "_output_width"): lambda mask, width: width,
        (vitjax.model.Attention, "__call__"): wide_output_attention,
    },
}


def code_path(name: str) -> contextlib.AbstractContextManager:
    """Executables traced and calls run inside take the code path `PATHS[name]` (`patched`)."""
    return patched(PATHS[name])


@contextlib.contextmanager
def patched(changes: dict):
    """Inside, each `(owner, attribute)` of `changes` is set to its value. JAX's trace caches are cleared on the way in
    and out: a primitive's lowering (fa4-jax's forward) is traced once per config and reused, which would carry one
    path's output shape into another's."""
    saved = {(owner, attr): getattr(owner, attr) for owner, attr in changes}
    for (owner, attr), value in changes.items():
        setattr(owner, attr, value)
    jax.clear_caches()
    try:
        yield
    finally:
        for (owner, attr), value in saved.items():
            setattr(owner, attr, value)
        jax.clear_caches()


def reps_for(tokens: int) -> int:
    return 20 if tokens < 10_000 else 5 if tokens < 150_000 else 3


def versions() -> dict:
    import importlib.metadata as md

    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for name in ("jaxlib", "flax", "torch", "transformers", "pillow", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    out["libc"] = " ".join(platform.libc_ver())  # the allocator the host side runs on
    out["date"] = datetime.date.today().isoformat()
    out["run"] = datetime.datetime.now().isoformat(timespec="seconds")  # several runs may share a day's file
    out.update(code_revision.revision())  # which code ran: bench/code_revision.py maps the digest to a commit
    return out


def results_file(out_dir: Path | str, meta: dict) -> Path:
    """<out_dir>/<device>-<date>.jsonl, the device by its model name ("h100", "h200", "cpu"), from `versions()`."""
    return Path(out_dir) / f"{meta['device'].lower().replace('nvidia ', '').split()[0]}-{meta['date']}.jsonl"


def jpegs(count: int = 20, size: tuple[int, int] = (960, 1280)) -> list[bytes]:
    """`count` distinct JPEGs of width x height, each a different crop of a shipped photograph."""
    photos = [Image.open(p).convert("RGB") for p in sorted(PHOTOS.glob("*.[jp][pn]g"))]
    out = []
    for k in range(count):
        img = photos[k % len(photos)].resize((size[0] + 40, size[1] + 40), Image.BICUBIC)
        img = img.crop((k, 2 * k % 40, k + size[0], 2 * k % 40 + size[1]))
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def pixel_pools(kind: str, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """`rows` pixel rows as HF's processor gives them (float32) and as `encode` sends them (uint8 levels).
    "noise": random rows (normal values, uniform levels). "photos": the rows of `jpegs()`'s 20 photos (exactly the
    20 x 960x1280 workload's input; other workloads take them in order, repeated): at the board's power limit the
    energy of a call, so its time, depends on the data, and users send photos."""
    if kind == "noise":
        values = np.random.default_rng(0).standard_normal((rows, 1536), dtype=np.float32)
        return values, np.random.default_rng(0).integers(0, 256, values.shape, np.uint8)
    values, levels = [], []
    for data in jpegs():
        photo, _ = preprocess_image(data)
        values.append(photo)
        levels.append(preprocess_image(data, out=np.empty(photo.shape, LEVELS))[0])
    return tuple(np.resize(np.concatenate(parts), (rows, 1536)) for parts in (values, levels))


# ----------------------------------------------------------------------------------------------- HF


def run_hf(cfg: vitjax.VisionConfig, weights_dir: Path, items, pool: np.ndarray, emit, sustain: float = 0.0) -> None:
    """HF's tower on the workloads, its input already on the GPU; `sustain` as `run_vitjax`'s."""
    import torch
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    hf_cfg = Qwen3VLVisionConfig(**{k: v for k, v in cfg.to_hf().items() if k != "model_type"})
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3VLVisionModel._from_config(hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    model.save_pretrained(weights_dir)
    emit({"phase": "hf_weights", "params": sum(p.numel() for p in model.parameters())})
    for name, grids in items:
        tokens = sum(t * h * w for t, h, w in grids)
        x = torch.from_numpy(pool[:tokens]).to(device, torch.bfloat16)
        grid = torch.tensor(grids, device=device)

        def step(x=x, grid=grid, model=model):
            with torch.inference_mode():
                model(x, grid_thw=grid)
            sync()

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t, times = median_time(step, reps_for(tokens))
        gemm, attn = flops(cfg, grids)
        row = {
            "impl": "hf",
            "workload": name,
            "images": len(grids),
            "patches": tokens,
            "ms": t * 1e3,
            "ms_all": [round(v * 1e3, 3) for v in times],
            "tflops": (gemm + attn) / t / 1e12,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
            "torch_cuda": torch.version.cuda,
            "torch_cudnn": torch.backends.cudnn.version(),
        }
        if sustain and name in MAIN_NAMES:
            row["sustained"] = sustained(step, sustain, t)
        emit(row)
        del x
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- vitjax


def part_times(enc: vitjax.Encoder, bucket: Bucket, grids, pool: np.ndarray) -> dict:
    """Per-part device times on this bucket's shapes, each part a separately jitted function."""
    graph, state, impl = enc._graph, enc._state, enc.attention
    cfg = enc.cfg
    packed = layout.pack(grids, *bucket, side=cfg.grid_side, merge=cfg.spatial_merge_size)
    tokens = sum(t * h * w for t, h, w in grids)
    pixels = np.zeros((bucket.tokens, cfg.patch_dim), np.float32)
    pixels[:tokens] = pool[:tokens]
    dev = jax.device_put((pixels, *packed))
    from vitjax.attention import Segments

    engine = enc.parallel.engines[0]
    max_length = engine._max_length(bucket, max(h * w for _, h, w in grids))
    inputs = TowerInputs(dev[1], dev[2], dev[3], Segments(dev[4], dev[5], dev[6], max_length))

    def compiled(fn, *args):  # with the bucket executables' XLA options
        options = vitjax.engine.COMPILER_OPTIONS if jax.default_backend() == "gpu" else None
        return jax.jit(fn).lower(*args).compile(compiler_options=options)

    x = compiled(lambda s, p, inp: nnx.merge(graph, s).embed(p, inp), state, dev[0], inputs)(state, dev[0], inputs)
    blocks = compiled(lambda s, x, inp: nnx.merge(graph, s).run_blocks(x, inp, impl), state, x, inputs)
    hidden, taps = blocks(state, x, inputs)
    patch = compiled(lambda s, p: nnx.merge(graph, s).patch_embed(p), state, dev[0])
    pos = compiled(lambda s, i, w: nnx.merge(graph, s).position_embedding(i, w), state, dev[1], dev[2])
    merge = compiled(lambda s, x, taps: nnx.merge(graph, s).merge(x, taps), state, hidden, taps)
    out = {}
    for key, fn in (
        ("patch_embed", lambda: patch(state, dev[0])),
        ("position_embedding", lambda: pos(state, dev[1], dev[2])),
        ("blocks", lambda: blocks(state, x, inputs)),
        ("mergers", lambda: merge(state, hidden, taps)),
    ):
        out[key] = median_time(lambda fn=fn: jax.block_until_ready(fn()), 5)[0] * 1e3
    out["host_layout_uncached"] = (
        median_time(lambda: layout._pack.__wrapped__(tuple(grids), *bucket, cfg.grid_side, 2), 5)[0] * 1e3
    )
    out["host_layout_cached"] = median_time(lambda: layout.pack(grids, *bucket, side=cfg.grid_side), 20)[0] * 1e3
    host = pool[:tokens]
    transfer = median_time(lambda: jax.block_until_ready(engine._inputs(host, 0, tokens, grids, bucket)), 5)[0]
    out["host_to_device"] = transfer * 1e3
    exe = engine.executable(bucket, np.float32, max_length)
    args = engine._inputs(host, 0, tokens, grids, bucket)
    out["executable"] = median_time(lambda: jax.block_until_ready(exe(state, *args)), 5)[0] * 1e3
    packed_out = jax.block_until_ready(exe(state, *args))
    spans = layout.split_points(grids, cfg.merge_unit)
    out["split_views"] = median_time(lambda: [row_view(packed_out, s, r) for s, r in spans], 20)[0] * 1e3
    return out


def run_vitjax(
    cfg: vitjax.VisionConfig,
    weights_dir: Path,
    items,
    pool: np.ndarray,
    emit,
    parts: bool,
    policy=None,
    devices: int = 1,
    sequence_parallel: int = 1,
    attention: str | None = None,
    profile: bool = False,
    max_call_tokens: int = 0,
    fit_under_load: bool = False,
    sustain: float = 0.0,
    levels: bool = False,
) -> dict:
    """vitjax on the workloads; on several devices (data parallel, or Ulysses in groups of `sequence_parallel`)
    `encode_patches` only: the first call compiles; device-only times and parts are one-device measurements.
    `profile`: the device-only call's device ops too (`tower_op` rows, largest first). `max_call_tokens`: the
    token ladder cut there, so a larger request runs as several calls (rows then carry the cap). `fit_under_load`:
    calls go on while a fitted bucket compiles, as a server's would (their times in `ms_during_fit`), instead of
    waiting for it on an idle GPU. `sustain`: that many seconds more of device-only calls of each main workload
    (`sustained`). `levels`: the pool holds uint8 levels, sent as `encode` sends a 16-bit tower's rows."""
    start = time.perf_counter()
    parallel = {"devices": devices, "sequence_parallel": sequence_parallel}
    impl, _, tile = (attention or "").partition(":")  # "fa4:128x176rs": fa4 with that schedule, "fa4:upstream": FA3's
    if impl in ("fa4", "auto"):
        schedule = SHIPPED_TILES.get(cfg.head_dim) if not tile else None if tile == "upstream" else Fa4Tile.parse(tile)
        set_fa4_tile(cfg.head_dim, schedule)
    impl = "" if impl == "auto" else impl  # the machine's choice, per bucket, as the library makes it by default
    if max_call_tokens:
        policy = policy or BucketPolicy()
        policy = dataclasses.replace(policy, tokens=tuple(t for t in policy.tokens if t <= max_call_tokens))
    enc = vitjax.Encoder.from_pretrained(
        weights_dir, dtype="bfloat16", buckets=policy, attention=impl or None, **parallel
    )
    label = attention or enc.attention
    cap = {"max_call_tokens": max_call_tokens} if max_call_tokens else {}
    emit({"phase": "vitjax_load", "s": time.perf_counter() - start, "attention": label, **parallel})
    engine = enc.parallel.engines[0]
    compiled: dict = {}
    for name, grids in items:
        tokens = sum(t * h * w for t, h, w in grids)
        plan = engine.policy.plan(grids)
        for bucket, images in plan if devices == 1 else ():
            if bucket not in compiled:
                longest = max(grids[i][1] * grids[i][2] for i in images)
                start = time.perf_counter()
                exe = engine.executable(bucket, pool.dtype, engine._max_length(bucket, longest))
                compiled[bucket] = time.perf_counter() - start
                if os.environ.get("HLO_DIR"):  # the optimized program, to read which kernels XLA chose
                    name_parts = [label.replace(":", "_"), *map(str, bucket), pool.dtype.name]
                    (Path(os.environ["HLO_DIR"]) / f"tower_{'_'.join(name_parts)}.hlo.txt").write_text(exe.as_text())
                mem = exe.memory_analysis()
                emit(
                    {
                        "phase": "compile",
                        "bucket": list(bucket),
                        "cold_compile_s": compiled[bucket],
                        "temp_gib": getattr(mem, "temp_size_in_bytes", 0) / 2**30,
                    }
                )
        pixels = pool[:tokens]
        grid = np.array(grids)

        def call(pixels=pixels, grid=grid) -> None:
            jax.block_until_ready(enc.encode_patches(pixels, grid, levels=levels))

        sightings = []
        for _ in range(FIT_AFTER):  # a size seen again moves to its fitted bucket once that is compiled
            sightings.append(_timed(call))
        during, fit_start = [], time.perf_counter()
        while fit_under_load and not all(e.settle(timeout=0) for e in enc.parallel.engines):
            during.append(_timed(call))  # requests served while the fitted bucket compiles (and autotunes)
        fit_wait = time.perf_counter() - fit_start
        for e in enc.parallel.engines:
            e.settle()
        first = _timed(call)  # the first call in a newly fitted bucket (its first execution)
        t, times = median_time(call, reps_for(tokens))
        gemm, attn = flops(cfg, grids)
        stats = jax.devices()[0].memory_stats() or {}
        row = {
            "impl": "vitjax",
            "attention": label,
            **parallel,
            **cap,
            "workload": name,
            "images": len(grids),
            "patches": tokens,
            "ms": t * 1e3,
            "ms_all": [round(v * 1e3, 3) for v in times],
            "ms_first_after_fit": first * 1e3,
            "ms_sightings": [round(v * 1e3, 3) for v in sightings],
            "tflops": (gemm + attn) / t / 1e12,
            "gemm_tflop": gemm / 1e12,
            "attention_tflop": attn / 1e12,
            "peak_gpu_gib_process": stats.get("peak_bytes_in_use", 0) / 2**30,
            **({"rows": "levels"} if levels else {}),
        }
        if fit_under_load:
            row.update(ms_during_fit=[round(v * 1e3, 3) for v in during], fit_wait_s=fit_wait)
        if devices == 1:
            on_device = jax.device_put(pixels)  # the host path's dtype: the same executable

            def device_only(on_device=on_device, grids=grids):
                jax.block_until_ready([c.output for c in engine.run(on_device, grids, levels=levels)])

            with GpuSampler(calls=reps_for(tokens) + 1) as gpu:  # median_time calls once more, untimed
                t_dev, _ = median_time(device_only, reps_for(tokens))
            if profile and name in MAIN_NAMES:
                ops = op_times(device_only, hlo=True)
                row["device_busy_ms"] = sum(ms for _, _, ms in ops)
                for line, op, ms in ops[:40]:
                    emit(
                        {
                            "bench": "tower_op",
                            "attention": label,
                            **cap,
                            "workload": name,
                            "line": line,
                            "op": op,
                            "ms": ms,
                        }
                    )
            if sustain and name in MAIN_NAMES:
                row["sustained"] = sustained(device_only, sustain, t_dev)
            ran = [c.bucket.tokens for c in engine.run(on_device, grids, levels=levels)]
            del on_device
            row.update(
                buckets=[list(b) for b, _ in plan],
                bucket_tokens_run=ran,
                ms_device_only=t_dev * 1e3,
                tflops_device_only=(gemm + attn) / t_dev / 1e12,
                **{f"device_only_{k}": v for k, v in gpu.stats.items()},
            )
            if parts and not levels and len(plan) == 1 and name in MAIN_NAMES:
                row["parts_ms"] = part_times(enc, plan[0][0], grids, pool)
        emit(row)
    return {"buckets": [list(b) for b in compiled], "attention": label}


def warm_start(weights_dir: Path, buckets: list, emit) -> None:
    """A second process: load weights, warm the same buckets from the persistent cache, encode once."""
    code = f"""
import time, json, os
t0 = time.perf_counter()
import numpy as np, jax, vitjax
t_import = time.perf_counter() - t0
enc = vitjax.Encoder.from_pretrained({str(weights_dir)!r}, dtype="bfloat16")
t_load = time.perf_counter() - t0
times = enc.warmup([tuple(b) for b in {buckets!r}], pixel_dtype="float32")  # the rows timed below
t_warm = time.perf_counter() - t0
grids = [(1, 80, 60)] * 20
x = np.random.default_rng(0).standard_normal((96000, 1536), dtype=np.float32)
s = time.perf_counter(); jax.block_until_ready(enc.encode_patches(x, np.array(grids))); first = time.perf_counter() - s
print("WARM " + json.dumps({{"import_s": t_import, "load_s": t_load, "ready_s": t_warm,
    "warmup_s": sum(times.values()), "buckets": len(times), "first_20x960x1280_ms": first * 1e3}}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("WARM ")), None)
    if line is None:
        emit({"phase": "warm_start", "error": proc.stderr[-2000:]})
    else:
        emit({"phase": "warm_start", **json.loads(line[5:])})


# --------------------------------------------------------------------------------------------- main


def latest(rows: list[dict]) -> list[dict]:
    """The last row of each (impl, attention, call cap, token ladder, fit granule, segment ladder, tap write, rows,
    pixels, devices, workload): a later run of the same day supersedes an earlier one."""
    keys = {
        (
            r.get("impl"),
            r.get("attention"),
            r.get("max_call_tokens"),
            r.get("tokens_ladder"),
            r.get("fit_granule"),
            str(r.get("segments_ladder")),
            r.get("path") or r.get("taps"),
            r.get("rows"),
            r.get("pixels"),
            _gpus(r),
            r.get("workload"),
        ): r
        for r in rows
        if r.get("impl")
    }
    return list(keys.values())


def _gpus(row: dict) -> str:
    """ "2" for two devices data-parallel, "2 sp2" for two devices in Ulysses pairs."""
    sp = row.get("sequence_parallel", 1)
    return f"{row.get('devices', 1)}" + (f" sp{sp}" if sp > 1 else "")


def table(rows: list[dict]) -> str:
    rows = latest(rows)
    hf = {(r["workload"], r.get("pixels")): r for r in rows if r.get("impl") == "hf"}
    lines = [
        f"{'workload':<16}{'patches':>8}{'HF ms':>10}{'TF/s':>7}{'GPUs':>7}{'attention':>26}{'vitjax ms':>11}"
        f"{'TF/s':>7}{'dev ms':>9}{'x HF':>7}{'dev x HF':>9}"
    ]
    for r in rows:
        if r.get("impl") != "vitjax":
            continue
        h = hf.get((r["workload"], r.get("pixels")), {})
        ratio = f"{r['ms'] / h['ms']:.2f}" if h else "-"
        dev_ratio = f"{r['ms_device_only'] / h['ms']:.3f}" if h and "ms_device_only" in r else "-"
        hf_ms, hf_tf = h.get("ms", float("nan")), h.get("tflops", float("nan"))
        label = r.get("attention", "") + (f" <={r['max_call_tokens']}" if r.get("max_call_tokens") else "")
        label += f" t{r['tokens_ladder']}" if r.get("tokens_ladder") else ""
        label += f" fit{r['fit_granule']}" if r.get("fit_granule") is not None else ""
        label += f" s<={r['segments_ladder'][-1]}" if r.get("segments_ladder") else ""
        label += f" {r.get('path') or r['taps']}" if r.get("path") or r.get("taps") else ""
        label += " levels" if r.get("rows") == "levels" else ""
        label += f" {r['pixels']}" if r.get("pixels") else ""
        lines.append(
            f"{r['workload']:<16}{r['patches']:>8}{hf_ms:>10.1f}{hf_tf:>7.0f}{_gpus(r):>7}{label:>26}"
            f"{r['ms']:>11.1f}{r['tflops']:>7.0f}{r.get('ms_device_only', float('nan')):>9.1f}{ratio:>7}"
            f"{dev_ratio:>9}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = latest(rows)
    fig, axes = plt.subplots(1, len(SWEEP_RES), figsize=(5 * len(SWEEP_RES), 4), sharey=False)
    for ax, res in zip(axes, SWEEP_RES, strict=True):
        for impl, style in (("hf", "o-"), ("vitjax", "s-")):
            pts = sorted(
                (r["images"], r["ms"])
                for r in rows
                if r.get("impl") == impl
                and _gpus(r) == "1"
                and r["workload"].endswith(f"x{res}")
                and not r.get("pixels")
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label="HF transformers (sdpa)" if impl == "hf" else "vitjax")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("images per request")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{res} ({RESOLUTIONS[res][1] * RESOLUTIONS[res][2]} patches each)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    device = rows[0].get("device", "")
    fig.suptitle(f"Qwen3-VL 8B vision tower, bf16, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--sweep", action="store_true", help="also 1..32 images at 720p, 1080p and 2K")
    ap.add_argument("--video", action="store_true", help="also clips of 60 to 257 s at HF's video defaults")
    ap.add_argument("--many", action="store_true", help="also requests of 65 to 200 images of one size")
    ap.add_argument("--scaling", action="store_true", help="also 64 x 1080p and one 4096x4096 image (several GPUs)")
    ap.add_argument(
        "--workloads", help="run only these of the workloads the other options give, comma-separated (e.g. 64x1080p)"
    )
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument(
        "--rows",
        choices=("float32", "levels"),
        default="float32",
        help="vitjax's pixel rows: float32 values as HF's processor gives them, or uint8 levels as `encode` sends them",
    )
    ap.add_argument(
        "--pixels",
        default="noise",
        help=f"the pixel rows, comma-separated, repeats allowed (HF runs once per kind): {', '.join(PIXELS)} "
        "(photos: the rows of the 20 960x1280 JPEGs bench_encode times; rows carry any but noise)",
    )
    ap.add_argument("--no-parts", action="store_true")
    ap.add_argument("--no-warm-start", action="store_true")
    ap.add_argument("--profile", action="store_true", help="device time per op of each device-only tower call")
    ap.add_argument("--smoke", action="store_true", help="tiny config and images: check the script on a CPU")
    ap.add_argument(
        "--sustain",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after each main workload's measured calls (HF's, and vitjax's device-only ones), calls back to back for "
        "this long, in 5 s windows (the row's `sustained`: the call time, energy, clock and temperature of a board "
        "under steady load)",
    )
    ap.add_argument(
        "--devices", default="1", help="vitjax runs: device counts, 'spN' for N devices in one Ulysses group: 1,2,sp2"
    )
    ap.add_argument(
        "--attention",
        help="vitjax runs: attention paths, comma-separated (default, or 'auto': the automatic choice); fa4:TILE "
        "(e.g. fa4:128x176rs) or fa4:upstream runs fa4 with that schedule",
    )
    ap.add_argument(
        "--max-call-tokens",
        default="0",
        help="vitjax runs: the token ladder cut at each of these (0: as shipped), comma-separated, so larger "
        "requests run as several calls",
    )
    ap.add_argument(
        "--token-ladders",
        help="vitjax runs, in this order: token ladders, ';'-separated, each the shipped one ('') or it plus some "
        "sizes ('+96256'); rows carry any but the shipped one",
    )
    ap.add_argument(
        "--fit-granules",
        help="vitjax runs, in this order: BucketPolicy.fit_granule values, ';'-separated (0: the ladder's buckets "
        "only; default: the shipped one); rows carry any but the shipped one",
    )
    ap.add_argument(
        "--fit-under-load",
        action="store_true",
        help="calls go on while each fitted bucket compiles, as a server's would (rows get ms_during_fit), instead "
        "of waiting for the compile on an idle GPU",
    )
    ap.add_argument(
        "--segment-ladders",
        help="vitjax runs: segment-slot ladders, ';'-separated (e.g. '1,4,16,64;1,4,16,64,128,256,384'; default: "
        "the shipped one); rows carry the ladder",
    )
    ap.add_argument(
        "--paths",
        default="shipped",
        help=f"vitjax runs: code paths, comma-separated, of {', '.join(PATHS)} (spare_slot: the tap write before "
        "vitjax.taps; previous: the tower before 2026-11-26), repeats allowed; rows carry any but the shipped one",
    )
    ap.add_argument("--plot", metavar="JSONL", help="only draw the plot of an earlier run's results")
    args = ap.parse_args()
    if args.plot:
        path = Path(args.plot)
        plot([json.loads(line) for line in path.read_text().splitlines()], path.with_suffix(".png"))
        return
    cfg, policy = vitjax.VisionConfig.preset(PRESET), None
    if args.smoke:
        cfg = vitjax.VisionConfig(2, 144, 2, 80, 48, (0,))
        policy = BucketPolicy(tokens=(64, 256, 1024, 2048), segments=(1, 4, 16, 64), granule=64)
    meta = {**versions(), "script": "bench_vit"}
    out_file = results_file(args.out, meta)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def emit(row: dict) -> None:
        row = {**meta, **row}
        rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        with out_file.open("a") as f:
            f.write(line + "\n")

    items = workloads(args.sweep, args.smoke, args.video, args.many, args.scaling)
    if args.workloads:
        wanted = args.workloads.split(",")
        if unknown := set(wanted) - {name for name, _ in items}:
            raise SystemExit(f"--workloads: no workload {sorted(unknown)} among {[name for name, _ in items]}")
        items = [(name, grids) for name, grids in items if name in wanted]
    most = max(sum(t * h * w for t, h, w in g) for _, g in items)
    kinds = args.pixels.split(",")
    if unknown := set(kinds) - set(PIXELS):
        raise SystemExit(f"--pixels: no kind {sorted(unknown)} among {list(PIXELS)}")
    pools = {kind: pixel_pools(kind, most) for kind in dict.fromkeys(kinds)}
    levels = args.rows == "levels"

    def pixels_emit(kind: str, emit):
        return emit if kind == "noise" else lambda row: emit({**row, "pixels": kind})

    work = Path(tempfile.mkdtemp(prefix="vitjax-bench-"))
    os.environ["VITJAX_CACHE_DIR"] = str(work / "xla-cache")
    weights = work / "weights"
    for n, kind in enumerate(pools):  # the weights come from the HF model (seeded: the same each time)
        if n == 0 or not args.no_hf:
            run_hf(cfg, weights, [] if args.no_hf else items, pools[kind][0], pixels_emit(kind, emit), args.sustain)
    infos = {}
    ladders = [tuple(map(int, v.split(","))) for v in args.segment_ladders.split(";")] if args.segment_ladders else []
    token_ladders = args.token_ladders.split(";") if args.token_ladders else [""]
    fits = [int(v) for v in args.fit_granules.split(";")] if args.fit_granules else [None]
    for spec in args.devices.split(","):
        n = int(spec.removeprefix("sp"))
        parallel = {"devices": n, "sequence_parallel": n if spec.startswith("sp") else 1}
        for extra, fit, ladder in itertools.product(token_ladders, fits, ladders or [None]):
            base = policy or BucketPolicy()
            changes, marks = {}, {}
            if extra:
                changes["tokens"] = tuple(sorted({*base.tokens, *map(int, extra.removeprefix("+").split(","))}))
                marks["tokens_ladder"] = extra
            if fit is not None:
                changes["fit_granule"] = marks["fit_granule"] = fit
            if ladder:
                changes["segments"], marks["segments_ladder"] = ladder, list(ladder)
            run_policy = dataclasses.replace(base, **changes) if changes else policy
            run_emit = (lambda row, marks=marks: emit({**row, **marks})) if marks else emit
            for kind, impl, cap, path in itertools.product(
                kinds,
                args.attention.split(",") if args.attention else [None],
                map(int, args.max_call_tokens.split(",")),
                args.paths.split(","),
            ):
                path_emit = pixels_emit(kind, run_emit)
                path_emit = path_emit if path == "shipped" else lambda row, e=path_emit, p=path: e({**row, "path": p})
                with code_path(path):
                    infos[spec] = run_vitjax(
                        cfg,
                        weights,
                        items,
                        pools[kind][1 if levels else 0],
                        path_emit,
                        not args.no_parts,
                        run_policy,
                        **parallel,
                        attention=impl,
                        profile=args.profile,
                        max_call_tokens=cap,
                        fit_under_load=args.fit_under_load,
                        sustain=args.sustain,
                        levels=levels,
                    )
    if "1" in infos and not (args.no_warm_start or args.smoke or levels):
        warm_start(weights, infos["1"]["buckets"], emit)
    print(table(rows), flush=True)
    if args.sweep:
        try:
            plot(rows, out_file.with_suffix(".png"))
        except ImportError:
            print(f"matplotlib missing here: plot elsewhere with --plot {out_file}", flush=True)


if __name__ == "__main__":
    main()
