"""Where one transformer block's time goes, and what the candidate changes to the tower buy (one GPU).

Part times of one 8B block at the 20x960x1280 shape (each part compiled alone with the bucket executables' XLA
options, inputs resident), beside each part's floor (GEMM FLOPs at the measured matmul rate, bytes at the
measured copy rate); then the whole 27-block scan under variants: as shipped; XLA's default options; without
deepstack taps (the cost of writing the tap carry); one scan per run of blocks between taps; the blocks
unrolled (no loop); without CUDA graphs; the previous paths (the MLP's hidden width not padded, one qkv GEMM,
XLA's two-pass LayerNorm, every block writing the tap buffer); the tap write under XLA's `cond`; the MLP weights
padded once outside the program; XLA's dynamic-slice fusion; cuDNN's LayerNorm; XLA's block-level (Triton)
fusions; cuBLASLt's first heuristic choices; and, named "fa4=<schedule>" in --variants, the shipped scan with fa4
under another schedule (`vitjax.fa4.Fa4Tile`). With $HLO_DIR set, each 20-photo scan variant's optimized
HLO is written there. With --profile, each scan also runs under JAX's profiler and its device ops' times per call
are reported (`scan_op` rows, largest first). Every variant's last state and taps are compared with the shipped
scan's on the same weights and input (`max_abs_diff_vs_shipped`). One JSON object per line.

    PYTHONPATH=. python bench/bench_block.py [--profile] [--variants shipped,fa4=192x144ss,shipped_again]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_attention import pipelined_ms, rotating_rounds, timed  # bench/ is on sys.path when run as a script
from bench_vit import GpuSampler, op_times, spare_slot_run_blocks, taps_run_blocks, versions
from flax import nnx

import vitjax
from vitjax import attention, fa4, layout, model
from vitjax.engine import COMPILER_OPTIONS
from vitjax.model import TowerInputs, apply_rotary, rotary_tables
from vitjax.taps import skipping


def emit(**row) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def ceilings() -> tuple[float, float]:
    """Measured bf16 matmul FLOP/s and device copy bytes/s."""
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    t = pipelined_ms(jax.jit(lambda a: a @ a), a) / 1e3
    x = jax.random.normal(jax.random.key(1), (1 << 30,), jnp.bfloat16)
    c = pipelined_ms(jax.jit(lambda x: x * 2), x) / 1e3
    flops, bw = 2 * 8192**3 / t, 2 * x.nbytes / c
    emit(bench="ceiling", matmul_tflops=flops / 1e12, copy_tbs=bw / 1e12)
    return flops, bw


def inputs_for(cfg, grids, tokens, slots):
    packed = layout.pack(grids, tokens, slots, side=cfg.grid_side)
    dev = jax.device_put(packed)
    seg = attention.Segments(dev.segment_ids, dev.segment_starts, dev.segment_lengths, 0)
    return TowerInputs(dev.pos_index, dev.pos_weight, dev.rope_pos, seg)


def block_parts(cfg, tower, inputs, impl, flops_rate, bw) -> None:
    tokens, d, inter = inputs.pos_index.shape[0], cfg.hidden_size, cfg.intermediate_size
    graph, params = nnx.split(tower.blocks)
    blk = nnx.merge(graph, jax.tree.map(lambda a: a[0], params))
    bgraph, bstate = nnx.split(blk)
    x = jax.random.normal(jax.random.key(2), (tokens, d), jnp.bfloat16)
    cos, sin = rotary_tables(inputs.rope_pos, cfg.head_dim, cfg.rope_theta)
    seg = inputs.segments

    def qkv(s, x):
        b = nnx.merge(bgraph, s)
        return b.attn.qk_v(b.norm1(x))

    def rot(s, qk):
        return apply_rotary(qk[:, 0], cos, sin), apply_rotary(qk[:, 1], cos, sin)

    def attn(s, q, k, v):
        return attention.attention(q, k, v, seg, impl)

    def proj(s, o, x):
        return x + nnx.merge(bgraph, s).attn.proj(o.reshape(tokens, d))

    def mlp_up(s, x):
        b = nnx.merge(bgraph, s)
        return b.mlp.up(b.norm2(x))

    def mlp_down(s, h, x):
        return x + nnx.merge(bgraph, s).mlp.down(h)

    def whole(s, x):
        return nnx.merge(bgraph, s)(x, cos, sin, seg, impl)

    qk, v = jax.jit(qkv)(bstate, x)
    q, k = jax.jit(rot)(bstate, qk)
    o = jax.jit(attn)(bstate, q, k, v)
    h = jax.jit(mlp_up)(bstate, x)
    row_bytes = tokens * 2
    useful = sum(int(n) ** 2 for n in np.asarray(seg.lengths))
    parts = {
        "ln1+qkv": (jax.jit(qkv), (bstate, x), 2 * tokens * d * 3 * d, row_bytes * (d + 3 * d)),
        "rotary": (jax.jit(rot), (bstate, qk), 0, row_bytes * 4 * d),
        "attention": (jax.jit(attn), (bstate, q, k, v), 4 * d * useful, row_bytes * 4 * d),
        "proj+residual": (jax.jit(proj), (bstate, o, x), 2 * tokens * d * d, row_bytes * 3 * d),
        "ln2+fc1+gelu": (jax.jit(mlp_up), (bstate, x), 2 * tokens * d * inter, row_bytes * (d + inter)),
        "fc2+residual": (jax.jit(mlp_down), (bstate, h, x), 2 * tokens * d * inter, row_bytes * (inter + 2 * d)),
        "whole_block": (jax.jit(whole), (bstate, x), 0, 0),
    }
    for name, (fn, args, fl, by) in parts.items():
        t = pipelined_ms(fn.lower(*args).compile(compiler_options=COMPILER_OPTIONS), *args) / 1e3
        floor = max(fl / flops_rate, by / bw)
        emit(bench="block_part", part=name, tokens=tokens, ms=t * 1e3, floor_ms=floor * 1e3, tflops=fl / t / 1e12)


def fused_qkv_call(self, x, cos, sin, segments, impl):
    """The previous path: one qkv GEMM, q, k and v sliced out of it (v copied for the attention kernel)."""
    qkv = self.qkv(x).reshape(x.shape[0], 3, self.num_heads, self.head_dim)
    q, k = model.apply_rotary(qkv[:, 0], cos, sin), model.apply_rotary(qkv[:, 1], cos, sin)
    return self.proj(attention.attention(q, k, qkv[:, 2], segments, impl).reshape(x.shape))


def segmented_run_blocks(self, x, inputs, impl="reference"):
    """Candidate: one scan per run of blocks between deepstack taps, the taps being the runs' last hidden states,
    instead of one scan whose every block writes its output to a tap slot."""
    cfg = self.cfg
    cos, sin = rotary_tables(inputs.rope_pos, cfg.head_dim, cfg.rope_theta)
    graph, params = nnx.split(self.blocks)

    def step(h, block_params):
        return nnx.merge(graph, block_params)(h, cos, sin, inputs.segments, impl), None

    taps, start = [], 0
    for end in [*(i + 1 for i in cfg.deepstack_visual_indexes), cfg.depth]:
        if end > start:
            x, _ = jax.lax.scan(step, x, jax.tree.map(lambda a, start=start, end=end: a[start:end], params))
        taps.append(x)
        start = end
    return x, jnp.stack(taps)


def unrolled_run_blocks(self, x, inputs, impl="reference"):
    """Candidate: the blocks unrolled into one program (27 blocks compiled), the taps being the tap blocks' outputs:
    no loop, no tap buffer written by every block."""
    cfg = self.cfg
    cos, sin = rotary_tables(inputs.rope_pos, cfg.head_dim, cfg.rope_theta)
    graph, params = nnx.split(self.blocks)
    taps = []
    for i in range(cfg.depth):
        block = nnx.merge(graph, jax.tree.map(lambda a, i=i: a[i], params))
        x = block(x, cos, sin, inputs.segments, impl)
        if i in cfg.deepstack_visual_indexes:
            taps.append(x)
    return x, jnp.stack(taps)


def cond_taps_run_blocks(self, x, inputs, impl="reference"):
    """The tap write as `vitjax.taps` makes it off CUDA GPUs: the dynamic update under a `cond`."""
    return taps_run_blocks(self, x, inputs, impl, 0, skipping)


def padded_mlp_state(state):
    """The blocks' MLP weights zero-padded to `model.GEMM_WIDTH_MULTIPLE` once, outside the program (the shipped
    program pads them on every call)."""
    pure = nnx.to_pure_dict(state)
    mlp = pure["blocks"]["mlp"]
    pad = -mlp["linear_fc1"]["kernel"].shape[-1] % model.GEMM_WIDTH_MULTIPLE
    widen = jax.jit(
        lambda a, axis: jnp.pad(a, [(0, pad if i == axis % a.ndim else 0) for i in range(a.ndim)]), static_argnums=1
    )
    mlp["linear_fc1"]["kernel"] = widen(mlp["linear_fc1"]["kernel"], -1)
    mlp["linear_fc1"]["bias"] = widen(mlp["linear_fc1"]["bias"], -1)
    mlp["linear_fc2"]["kernel"] = widen(mlp["linear_fc2"]["kernel"], -2)
    nnx.replace_by_pure_dict(state, pure)
    return state


SLICE_FUSION = {"xla_gpu_enable_dynamic_slice_fusion": True}


def scan_variants(cfg, grids, tokens, slots, impl, shape_name, hlo_dir, only=None, profile=False, rounds=3) -> None:
    """The 27-block scan as the bucket executables compile it, and candidate changes to it (`only`: these), all
    compiled first, then timed in `rounds` rotating rounds (median ms); `profile`: each one's device ops too
    (`device_busy_ms`: the sum over all of them)."""
    inputs = inputs_for(cfg, grids, tokens, slots)
    variants = {"shipped": (cfg, None, COMPILER_OPTIONS)}
    if shape_name == "20x960x1280":
        variants["xla_defaults"] = (cfg, None, {})
        variants["no_taps"] = (dataclasses.replace(cfg, deepstack_visual_indexes=()), None, COMPILER_OPTIONS)
    # the memory-bound passes (LayerNorms, rotary, residuals): cuDNN's LayerNorm, XLA's block-level (Triton) fusions
    variants["cudnn_layer_norm"] = (cfg, "xla_ln", {**COMPILER_OPTIONS, "xla_gpu_enable_cudnn_layer_norm": True})
    variants["triton_block_level"] = (
        cfg,
        None,
        {**COMPILER_OPTIONS, "xla_gpu_experimental_enable_fusion_block_level_rewriter": True},
    )
    variants["mlp_unpadded"] = (cfg, "unpadded", COMPILER_OPTIONS)
    variants["fused_qkv"] = (cfg, fused_qkv_call, COMPILER_OPTIONS)
    variants["xla_layer_norm"] = (cfg, "xla_ln", COMPILER_OPTIONS)
    variants["segmented_taps"] = (cfg, "segmented", COMPILER_OPTIONS)
    variants["unrolled"] = (cfg, "unrolled", COMPILER_OPTIONS)
    # every kernel launched alone instead of through CUDA graphs (XLA's command buffers)
    no_graphs = {**COMPILER_OPTIONS, "xla_gpu_enable_command_buffer": ""}
    variants["unrolled_no_graphs"] = (cfg, "unrolled", no_graphs)
    variants["no_graphs"] = (cfg, None, no_graphs)
    # cuBLASLt's first heuristic choice for every GEMM instead of the one XLA's autotuner timed fastest
    variants["autotune_level_0"] = (cfg, None, {**COMPILER_OPTIONS, "xla_gpu_autotune_level": 0})
    # fa4 under another schedule (`vitjax.fa4.Fa4Tile`), named "fa4=<schedule>" in `only`
    for name in sorted(n for n in only or () if n.startswith("fa4=")):
        variants[name] = (cfg, fa4.Fa4Tile.parse(name.removeprefix("fa4=")), COMPILER_OPTIONS)
    # the per-call weight work (per-block weight copies out of the stacked weights, the MLP pads) and the tap writes
    variants["padded_mlp_state"] = (cfg, "padded", COMPILER_OPTIONS)
    variants["slice_fusion"] = (cfg, None, {**COMPILER_OPTIONS, **SLICE_FUSION})
    variants["padded_slice_fusion"] = (cfg, "padded", {**COMPILER_OPTIONS, **SLICE_FUSION})
    variants["spare_slot_taps"] = (cfg, "spare_slot_taps", COMPILER_OPTIONS)
    variants["cond_taps"] = (cfg, "cond_taps", COMPILER_OPTIONS)
    variants["shipped_again"] = (cfg, None, COMPILER_OPTIONS)
    original, width, norm = model.Attention.__call__, model.GEMM_WIDTH_MULTIPLE, model._LayerNorm.__call__
    run_blocks, shipped_tile = model.VisionTower.run_blocks, fa4.FA4_TILES.get(cfg.head_dim)
    built = {}  # name -> (executable, weights, x, compile seconds, optimized HLO)
    for name, (c, patch, options) in variants.items():
        if only and name not in only:
            continue
        model.Attention.__call__ = patch if callable(patch) else original
        model.GEMM_WIDTH_MULTIPLE = 1 if patch == "unpadded" else width
        model._LayerNorm.__call__ = model._LayerNorm.xla if patch == "xla_ln" else norm
        model.VisionTower.run_blocks = {
            "segmented": segmented_run_blocks,
            "unrolled": unrolled_run_blocks,
            "spare_slot_taps": spare_slot_run_blocks,
            "cond_taps": cond_taps_run_blocks,
        }.get(patch if isinstance(patch, str) else "", run_blocks)
        if isinstance(patch, fa4.Fa4Tile):
            fa4.set_fa4_tile(cfg.head_dim, patch)
        try:
            tower = nnx.eval_shape(lambda c=c: model.VisionTower(c, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
            graph, abstract = nnx.split(tower)
            state = random_state(abstract)
            if patch == "padded":
                state = padded_mlp_state(state)
            x = jax.random.normal(jax.random.key(3), (tokens, cfg.hidden_size), jnp.bfloat16)
            fn = jax.jit(lambda s, x, inp, graph=graph: nnx.merge(graph, s).run_blocks(x, inp, impl))
            start = time.perf_counter()
            exe = fn.lower(state, x, inputs).compile(compiler_options=options or None)
            built[name] = (exe, state, x, time.perf_counter() - start, exe.as_text())
        except Exception as e:  # a variant the installed XLA rejects is reported, not fatal
            emit(bench="scan_variant", shape=shape_name, variant=name, error=repr(e)[:300])
        finally:
            model.Attention.__call__, model.GEMM_WIDTH_MULTIPLE, model._LayerNorm.__call__ = original, width, norm
            model.VisionTower.run_blocks = run_blocks
            if isinstance(patch, fa4.Fa4Tile):
                fa4.set_fa4_tile(cfg.head_dim, shipped_tile)
    times, stats = collections.defaultdict(list), collections.defaultdict(list)
    for _, name in rotating_rounds(list(built), rounds):
        exe, state, x, _, _ = built[name]
        with GpuSampler(calls=6) as gpu:  # timed calls once more, untimed
            times[name].append(timed(exe, state, x, inputs, reps=5) * 1e3)
        stats[name].append(gpu.stats)
    reference = built["shipped"][0](*built["shipped"][1:3], inputs) if "shipped" in built else None
    for name, (exe, state, x, compile_s, hlo) in built.items():
        if hlo_dir and shape_name == "20x960x1280":
            (hlo_dir / f"scan_{shape_name}_{name}.hlo.txt").write_text(hlo)
        row = {}
        if reference is not None:  # the same weights and input: how far the variant's last state and taps are
            out = exe(state, x, inputs)
            kept = min(reference[1].shape[0], out[1].shape[0], len(cfg.deepstack_visual_indexes))
            pairs = [(reference[0], out[0]), (reference[1][:kept], out[1][:kept])]
            row["max_abs_diff_vs_shipped"] = max(
                float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in pairs
            )
        if profile:
            ops = op_times(lambda exe=exe, state=state, x=x: exe(state, x, inputs))
            for line, op, ms in ops[:40]:
                emit(bench="scan_op", shape=shape_name, variant=name, line=line, op=op, ms=ms)
            row["device_busy_ms"] = sum(ms for _, _, ms in ops)
        gpu_medians = {k: float(np.median([s[k] for s in stats[name] if k in s])) for k in stats[name][0]}
        emit(
            bench="scan_variant",
            shape=shape_name,
            variant=name,
            ms=float(np.median(times[name])),
            ms_rounds=[round(t, 3) for t in times[name]],
            compile_s=compile_s,
            **gpu_medians,
            **row,
            epilogues=sorted(set(re.findall(r'"epilogue":"(\w+)"', hlo))),
            gemms={k: hlo.count(k) for k in ("__cublas$gemm", "__cublas$lt$matmul", "__triton_gemm")},
        )


def random_state(abstract):
    """Random bf16 weights (timing on constants or zeros can flatter a kernel)."""
    leaves, tree = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree.unflatten(
        tree, [(jax.random.normal(k, s.shape) * 0.02).astype(s.dtype) for k, s in zip(keys, leaves, strict=True)]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="a tiny config and shapes, to check the script on a CPU")
    ap.add_argument("--variants", help="scan variants to run, comma-separated (default: all)")
    ap.add_argument("--no-parts", action="store_true", help="skip the per-part times")
    ap.add_argument("--profile", action="store_true", help="device time per op of each scan variant")
    ap.add_argument("--rounds", type=int, default=3, help="rotating timing rounds over the scan variants")
    args = ap.parse_args()
    emit(**versions())
    cfg = vitjax.VisionConfig.preset("qwen3-vl-8b")
    big, small, tokens, small_tokens = [(1, 80, 60)] * 20, [(1, 44, 80)], 98304, 4096
    if args.smoke:
        cfg = vitjax.VisionConfig(2, 144, 2, 80, 48, (0,))
        big, small, tokens, small_tokens = [(1, 8, 6)] * 3, [(1, 4, 8)], 256, 64
    flops_rate, bw = (1e12, 1e11) if args.smoke else ceilings()
    impl = attention.default_implementation()
    emit(bench="attention_path", impl=impl)
    if not args.no_parts:
        tower = nnx.eval_shape(lambda: model.VisionTower(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        graph, abstract = nnx.split(tower)
        tower = nnx.merge(graph, random_state(abstract))
        block_parts(cfg, tower, inputs_for(cfg, big, tokens, 64), impl, flops_rate, bw)
    hlo_dir = Path(os.environ["HLO_DIR"]) if "HLO_DIR" in os.environ else None
    only = set(args.variants.split(",")) if args.variants else None
    scan_variants(cfg, big, tokens, 64, impl, "20x960x1280", hlo_dir, only, args.profile, args.rounds)
    scan_variants(cfg, small, small_tokens, 1, impl, "1x720p", hlo_dir, only, args.profile, args.rounds)


if __name__ == "__main__":
    main()
