"""Segment-masked attention on one GPU: each path's accuracy against the fp32 reference, and its speed.

The Qwen3-VL workloads of the tower's buckets, 16 heads, forward, bf16: 20 frames of 4800 tokens (20 photos of
960x1280, bucket 98,304 tokens / 64 slots), 20 mixed frames of 3584..5712 (98,304 / 32), one 720p frame of
3520 (bucket 3584 / 1), and the 60 and 120 slices of 480 tokens of a 1- and a 2-minute video clip. Every path
that runs here (`fa4` where fa4-jax is installed on Hopper, `cudnn_packed`, `cudnn_padded`) is timed in the
same process, in two alternating rounds (their spread is the noise), and checked on each workload against
`reference` (fp32 scores and softmax): max abs error and ||out - ref|| / ||ref|| over the real rows. The
correctness cases add odd frame sizes, a 2x2 frame, unused slots, tail padding and NaN in the padding rows
(real rows must not see it). `--sweep` also runs the earlier studies: the cost of unused segment slots, and
head_dim 72 zero-padded to 80/96/128 for cuDNN; `--slots` the clips in buckets of up to 512 slots;
`--many` calls of more than 64 frames (many images, a clip) in their default buckets; `--clocks` the kernel's
own device time on 20 x 4800 in calls made after an idle pause and at the end of a long back-to-back run.

    PYTHONPATH=. python bench/bench_attention.py [--impls fa4,cudnn_packed] [--head-dims 72,64] [--sweep] [--slots]
        [--many] [--clocks]

One JSON object per line, also appended to bench/results/<device>-<date>.jsonl; a short table last.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_vit import GpuSampler, device_events, results_file, versions  # bench/ is on sys.path when run as a script

from vitjax import attention, buckets, layout

HEADS = 16
MIXED = [(1, 56, 64 + 2 * i) for i in range(20)]  # 3584 .. 5712 tokens per frame, 92,960
# name: (grids, bucket tokens, segment slots)
CASES = {
    "20x4800": ([(1, 80, 60)] * 20, 98304, 64),
    "20xmixed": (MIXED, 98304, 32),
    "1x3520": ([(1, 44, 80)], 3584, 1),
    # Videos at HF's defaults: a 1- and a 2-minute clip, 60 and 120 temporal slices of 16x30 patches (the tower's
    # buckets: 32,768 tokens / 64 slots; 65,536 / 120, past the segment ladder).
    "60x480": ([(1, 16, 30)] * 60, 32768, 64),
    "120x480": ([(1, 16, 30)] * 120, 65536, 120),
}
# Segment slot counts priced for the clips (`--slots`): what a longer segment ladder would cost them.
CLIP_SLOTS = {"60x480": (64, 128, 256, 512), "120x480": (120, 128, 256, 512)}
# Calls of more than 64 frames (`--many`): many images of one request, or a clip's slices, each in the bucket the
# default policy gives it (tokens per slot in brackets), where the automatic choice runs cuDNN packed, not fa4.
MANY = {
    "200x256": [(1, 16, 16)] * 200,  # 256x256 images: 65,536 / 256 (256)
    "120x480": CASES["120x480"][0],  # a 2-minute clip: 65,536 / 128 (512)
    "128x576": [(1, 24, 24)] * 128,  # 384x384: 81,920 / 128 (640)
    "80x1200": [(1, 30, 40)] * 80,  # 480x640: 98,304 / 128 (768)
    "200x640": [(1, 20, 32)] * 200,  # 320x512: 131,072 / 256 (512)
    "100x1024": [(1, 32, 32)] * 100,  # 512x512: 131,072 / 128 (1,024)
    "65x1536": [(1, 32, 48)] * 65,  # 512x768: 131,072 / 128 (1,024)
    # 100 frames of 16..48 x 16..48 patches (even sides), ~1,060 on average: 131,072 / 128
    "100xmixed": [(1, int(h), int(w)) for h, w in 2 * np.random.default_rng(7).integers(8, 25, (100, 2))],
}
PACKAGES = ("fa4-jax", "cutejax", "nvidia-cutlass-dsl", "jax-tvm-ffi", "apache-tvm-ffi")


def segments(grids, tokens, slots, max_length=0) -> attention.Segments:
    packed = layout.pack(grids, tokens, slots)
    return attention.Segments(*(jnp.asarray(a) for a in packed[3:]), max_length=max_length)


def case_segments(grids, tokens, slots) -> attention.Segments:
    """A case's segments, with the padded path's row length the longest frame rounded up to 128."""
    longest = max(h * w for _, h, w in grids)
    return segments(grids, tokens, slots, max_length=-(-longest // 128) * 128)


def timed(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def pipelined_ms(fn, *args, reps: int = 50) -> float:
    """Mean ms over back-to-back calls: dispatch overlaps the GPU as inside a program, so a short kernel is not
    charged a host round trip each time (as `timed` charges it)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3


def rotating_rounds(names: list, rounds: int):
    """(round, name) for `rounds` rounds over `names`, each round starting one later: the first call after a pause
    runs at a higher clock (a loaded board sits at its power limit), which would otherwise favour the first name."""
    for r in range(rounds):
        first = r % len(names)
        for name in names[first:] + names[:first]:
            yield r + 1, name


def available(impls: list[str]) -> list[str]:
    runs = {"fa4": attention.fa4_available, "cudnn_packed": attention.cudnn_packed_available}
    return [i for i in impls if runs.get(i, lambda: True)()]


def random_qkv(seed: int, tokens: int, dim: int) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((tokens, HEADS, dim)), jnp.bfloat16) for _ in range(3))


def errors(got: jax.Array, ref: np.ndarray, real: np.ndarray) -> dict:
    """`got` (its first columns, as many as `ref` has) against `ref` over the real rows."""
    diff = np.asarray(got, np.float32)[real][..., : ref.shape[-1]] - ref[real]
    return {
        "max_abs_err": float(np.abs(diff).max()),
        "rel_l2_err": float(np.linalg.norm(diff) / np.linalg.norm(ref[real])),
        "finite": bool(np.isfinite(diff).all()),
    }


def run_fn(impl: str, seg: attention.Segments):
    """`impl`'s jitted call on q, k, v at head_dim, with them first made as the tower hands them to the path
    (`attention.value_columns` and `attention.query_key_columns` under the fa4 schedule of the first call, which traces
    it; once per input, outside the call, since the tower's GEMMs and rotary write them so). The output comes back as
    wide as v; `errors` reads its first head_dim columns. Where q goes in scaled (fa4's shift column), the bf16 q is
    scaled and rounded again here (the tower scales it before its one rounding): `call.query(q)` is the q the path
    then sees, for the fp32 reference (`reference`)."""
    fn = jax.jit(attention.attention, static_argnums=(4, 5))
    pinned: dict = {}
    made: dict = {}

    def forms(q):
        dim = q.shape[-1]
        wanted = (attention.value_columns(impl, dim), attention.query_key_columns(impl, dim, q.dtype))
        return pinned.setdefault(dim, wanted)

    def scaled(q):
        """q as the path takes it: in log2 units where `query_key_columns` says so (rounded a second time here)."""
        scale = forms(q)[1][0]
        return q if scale == 1.0 else (q.astype(jnp.float32) * scale).astype(q.dtype)

    def query(q):
        scale = forms(q)[1][0]
        return q if scale == 1.0 else scaled(q).astype(jnp.float32) / scale

    def call(q, k, v):
        columns, (_, q_extra, k_extra) = forms(q)
        if made.get("of") != (id(q), id(k), id(v)):
            inputs = (attention.widen(scaled(q), q_extra), attention.widen(k, k_extra), attention.widen(v, columns))
            made.update(of=(id(q), id(k), id(v)), keep=(q, k, v), inputs=inputs)
        return fn(*made["inputs"], seg, impl, q.shape[-1])

    call.query = query
    return call


def reference(seg: attention.Segments, q, k, v, fn=None) -> np.ndarray:
    """The fp32 reference on the inputs `fn` (a `run_fn` call) gives its path; on q, k, v as they are without it."""
    return np.asarray(run_fn("reference", seg)(fn.query(q) if fn else q, k, v), np.float32)


def checked(impls: list[str], seg: attention.Segments, q, k, v) -> tuple[dict, dict]:
    """Each path's jitted call and its errors against the fp32 reference on (q, k, v) as the path sees them."""
    real = np.asarray(seg.ids) >= 0
    fns = {impl: run_fn(impl, seg) for impl in impls}
    return fns, {impl: errors(fn(q, k, v), reference(seg, q, k, v, fn), real) for impl, fn in fns.items()}


def correctness(impls: list[str], dims: list[int], emit) -> None:
    """Odd frames, a 2x2 frame, unused slots, tail padding; one frame in a one-slot bucket; then NaN padding."""
    for dim in dims:
        for n, (grids, slots) in enumerate(
            [([(1, 38, 54), (2, 20, 26), (1, 2, 2), (1, 46, 30)], 8), ([(1, 44, 80)], 1)]
        ):
            tokens = 6144
            q, k, v = random_qkv(100 * dim + n, tokens, dim)
            seg = segments(grids, tokens, slots, max_length=4096)
            real = np.asarray(seg.ids) >= 0
            poison = jnp.asarray(~real)[:, None, None]
            nan_qkv = [jnp.where(poison, jnp.nan, x) for x in (q, k, v)]
            for impl in impls:
                fn = run_fn(impl, seg)
                ref = reference(seg, q, k, v, fn)
                row = {"check": "attention", "impl": impl, "head_dim": dim, "frames": len(grids), "slots": slots}
                emit({**row, **errors(fn(q, k, v), ref, real)})
                emit({**row, "padding": "nan", **errors(fn(*nan_qkv), ref, real)})


def speed(impls: list[str], dims: list[int], emit) -> None:
    """Each workload: the fp32 reference once, then every path in two rounds of rotating order."""
    for name, (grids, tokens, slots) in CASES.items():
        useful = sum(t * (h * w) ** 2 for t, h, w in grids)
        seg = case_segments(grids, tokens, slots)
        for dim in dims if name == "20x4800" else dims[:1]:
            q, k, v = random_qkv(dim, tokens, dim)
            fns, acc = checked(impls, seg, q, k, v)
            for rnd, impl in rotating_rounds(list(fns), 2):
                t = timed(fns[impl], q, k, v)
                ms = pipelined_ms(fns[impl], q, k, v)
                row = {"bench": "attention", "frames": name, "impl": impl, "head_dim": dim, "slots": slots}
                row.update(round=rnd, ms=round(t * 1e3, 3), ms_pipelined=round(ms, 3))
                row.update(tflops=round(4 * HEADS * dim * useful / t / 1e12, 1))
                row.update(tflops_pipelined=round(4 * HEADS * dim * useful / ms / 1e9, 1), **acc[impl])
                emit(row)


def clip_slots(impls: list[str], emit) -> None:
    """The clips in buckets with more segment slots than they use, each path in two rounds of rotating order."""
    for name, counts in CLIP_SLOTS.items():
        grids, tokens, _ = CASES[name]
        useful = sum(t * (h * w) ** 2 for t, h, w in grids)
        q, k, v = random_qkv(0, tokens, 72)
        fns = {(impl, n): run_fn(impl, case_segments(grids, tokens, n)) for impl in impls for n in counts}
        for rnd, (impl, n) in rotating_rounds(list(fns), 2):
            ms = pipelined_ms(fns[impl, n], q, k, v)
            row = {"bench": "attention_slots", "frames": name, "impl": impl, "head_dim": 72, "slots": n, "round": rnd}
            tflops = round(4 * HEADS * 72 * useful / ms / 1e9, 1)
            emit({**row, "ms_pipelined": round(ms, 4), "tflops_pipelined": tflops})


def many_frames(impls: list[str], emit, rounds: int = 3) -> None:
    """`MANY` in their default buckets: every path checked against the reference, then timed in rotating rounds."""
    policy = buckets.BucketPolicy()
    for name, grids in MANY.items():
        tokens, slots = policy.fit(sum(h * w for _, h, w in grids), len(grids))
        useful = sum((h * w) ** 2 for _, h, w in grids)
        q, k, v = random_qkv(1, tokens, 72)
        fns, acc = checked(impls, case_segments(grids, tokens, slots), q, k, v)
        for rnd, impl in rotating_rounds(list(fns), rounds):
            ms = pipelined_ms(fns[impl], q, k, v)
            row = {"bench": "attention_many", "frames": name, "impl": impl, "head_dim": 72, "tokens": tokens}
            row.update(slots=slots, round=rnd, ms_pipelined=round(ms, 4))
            emit({**row, "tflops_pipelined": round(4 * HEADS * 72 * useful / ms / 1e9, 1), **acc[impl]})


def kernel_ms(events: list[tuple[str, str, float, float]]) -> list[float]:
    """Durations (ms, in time order) of the op that took the most device time: the attention kernel."""
    runs: dict[str, list[float]] = {}
    for _, op, _, dur in events:
        runs.setdefault(op, []).append(dur / 1e3)
    return max(runs.values(), key=sum)


def clocks(impls: list[str], emit, calls: int = 5, pause_s: float = 0.5, burst: int = 300) -> None:
    """20 x 4800 at head_dim 72, the kernel's device time (profiler) two ways: single calls each after an idle pause,
    when the board runs at its boost clock, and the last third of `burst` back-to-back calls (~1.5 s), when a Hopper
    board holds its 700 W limit by lowering the clock (nvidia-smi's median clock and power over the burst)."""
    grids, tokens, slots = CASES["20x4800"]
    flop = 4 * HEADS * 72 * sum(t * (h * w) ** 2 for t, h, w in grids)
    q, k, v = random_qkv(72, tokens, 72)
    fns = {impl: run_fn(impl, case_segments(grids, tokens, slots)) for impl in impls}

    for rnd, impl in rotating_rounds(list(fns), 2):
        fn = fns[impl]

        def paused(fn=fn):
            time.sleep(pause_s)
            return jax.block_until_ready(fn(q, k, v))

        def back_to_back(fn=fn):
            for _ in range(burst):
                out = fn(q, k, v)
            return jax.block_until_ready(out)

        alone = float(np.median(kernel_ms(device_events(paused, calls))))
        with GpuSampler() as sampler:
            loaded = kernel_ms(device_events(back_to_back, 1))
        tail = float(np.median(loaded[-(len(loaded) // 3) :]))
        row = {"bench": "attention_clock", "frames": "20x4800", "impl": impl, "head_dim": 72, "round": rnd}
        row.update(paused_ms=round(alone, 4), paused_tflops=round(flop / alone / 1e9, 1))
        row.update(first_ms=round(float(np.median(loaded[:5])), 4), loaded_ms=round(tail, 4))
        emit({**row, "loaded_tflops": round(flop / tail / 1e9, 1), "burst": len(loaded), **sampler.stats})


def sweep(emit) -> None:
    """The first session's studies: unused segment slots, and cuDNN with head_dim 72 zero-padded."""
    for name in ("20x4800", "20xmixed"):
        grids, tokens, _ = CASES[name]
        useful = sum((h * w) ** 2 for _, h, w in grids)
        for dim in (72, 64):
            q, k, v = random_qkv(0, tokens, dim)
            for slots in (20, 32, 64, 256) if name == "20x4800" else (32,):
                for impl in ("cudnn_packed", "cudnn_padded"):
                    t = timed(run_fn(impl, case_segments(grids, tokens, slots)), q, k, v)
                    row = {"bench": "attention_slots", "frames": name, "impl": impl, "head_dim": dim, "slots": slots}
                    emit({**row, "ms": round(t * 1e3, 3), "tflops": round(4 * HEADS * dim * useful / t / 1e12, 1)})
        q, k, v = random_qkv(0, tokens, 72)
        seg = segments(grids, tokens, 32)
        attend = jax.jit(attention.attention, static_argnums=4)
        for padded_dim in (80, 96, 128):
            # Padded once, outside the timing, as a tower would write q, k and v at this width (zero columns in its
            # qkv weights): the kernel alone is timed, as on the native path (its output stays padded_dim wide).
            pad = ((0, 0), (0, 0), (0, padded_dim - 72))
            qp, kp, vp = (jnp.pad(x, pad) for x in (q * (padded_dim / 72) ** 0.5, k, v))
            t = timed(attend, qp, kp, vp, seg, "cudnn_packed")
            row = {"bench": "attention_pad", "frames": name, "impl": f"cudnn_packed_pad{padded_dim}", "head_dim": 72}
            emit({**row, "slots": 32, "ms": round(t * 1e3, 3), "tflops": round(4 * HEADS * 72 * useful / t / 1e12, 1)})


def table(rows: list[dict]) -> str:
    lines = [f"{'frames':<10}{'hd':>4}{'impl':>14}{'ms':>9}{'TF/s':>7}{'pipelined':>11}{'TF/s':>7}{'max err':>9}"]
    for r in rows:
        if r.get("bench") == "attention":
            lines.append(
                f"{r['frames']:<10}{r['head_dim']:>4}{r['impl']:>14}{r['ms']:>9.3f}{r['tflops']:>7.0f}"
                f"{r['ms_pipelined']:>11.3f}{r['tflops_pipelined']:>7.0f}{r['max_abs_err']:>9.4f}"
            )
    return "\n".join(lines)


def recorder(script: str, out_dir: str):
    """(rows, emit): `emit(row)` keeps the row, prints it as JSON with the device, versions (attention packages
    too) and date, and appends it to <out_dir>/<device>-<date>.jsonl."""
    meta = {**versions(), "script": script}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            meta[name] = importlib.metadata.version(name)
    out_file = results_file(out_dir, meta)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        line = json.dumps({**meta, **row})
        print(line, flush=True)
        with out_file.open("a") as f:
            f.write(line + "\n")

    return rows, emit


def run_cases(script: str, run_case, cases: str = "20x4800,1x3520") -> list[dict]:
    """The command line of the benches that time one workload at a time (`--rounds`, `--cases`, `--out`):
    `run_case(case, rounds, emit)` for each case, the rows kept."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default=cases)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rows, emit = recorder(script, args.out)
    for case in args.cases.split(","):
        run_case(case, args.rounds, emit)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impls", default="fa4,cudnn_packed,cudnn_padded", help="paths to run, where they can")
    ap.add_argument("--head-dims", default="72,64", help="the first is timed on every workload, the rest on 20x4800")
    ap.add_argument("--sweep", action="store_true", help="also the slot-count and padded-head_dim studies")
    ap.add_argument("--slots", action="store_true", help="also the clips in buckets with more segment slots")
    ap.add_argument("--many", action="store_true", help="also calls of more than 64 frames, in their buckets")
    ap.add_argument("--clocks", action="store_true", help="also the kernel after idle pauses and under load")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rows, emit = recorder("bench_attention", args.out)
    impls = available(args.impls.split(","))
    dims = [int(d) for d in args.head_dims.split(",")]
    emit({"phase": "start", "impls": impls})
    correctness(impls, dims, emit)
    speed(impls, dims, emit)
    if args.many:
        many_frames([i for i in impls if i != "cudnn_padded"], emit)
    if args.clocks:
        clocks([i for i in impls if i != "cudnn_padded"], emit)
    if args.slots:
        clip_slots([i for i in impls if i != "cudnn_padded"], emit)
    if args.sweep:
        sweep(emit)
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
