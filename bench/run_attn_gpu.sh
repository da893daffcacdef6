#!/usr/bin/env bash
# fa4 (FlashAttention-4's Hopper kernel through fa4-jax) on one H100/H200, in as few device calls as the lease
# allows. Run from the project root on the GPU machine:
#   OUT=/tmp/out bash bench/run_attn_gpu.sh [STEP...]
# steps: unpack smoke tiles block profile widths fp8 attention parity vit fit (default: unpack smoke attention parity vit)
# The GPU machine has no internet: the packages travel as one archive, .fa4/site.tar.xz (the device tool's carry),
# made here from the wheels of
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_24_x86_64 fa4-jax==0.1.0 cutejax==0.1.5 nvidia-cutlass-dsl==4.8.1 \
#     nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
#     jax-tvm-ffi==0.1.3 apache-tvm-ffi==0.1.15.post2
# each unzipped into one folder, less what nothing imports (tvm_ffi/3rdparty, the iket profiler, the aarch64
# runtime stubs; libtvm_ffi_testing.so travels beside the archive), packed with `tar cf - . | xz --x86 --lzma2=preset=9e,dict=256MiB`
# (53 MiB). `unpack` puts it in $FA4_SITE. Settings: VIT_ATTENTION (bench_vit's --attention), ATTN_FLAGS (more flags
# for bench_attention), TILES
# (bench_fa4_tiles' --variants), BLOCK_VARIANTS (bench_block's --variants; "fa4=<schedule>" runs the shipped scan
# with another fa4 schedule), TILE_FLAGS, BLOCK_FLAGS and VIT_FLAGS (more flags for bench_fa4_tiles, bench_block,
# bench_vit), PROFILE_TILES (schedules ncu reads), PAIRS (bench_fa4_widths' --pairs).
set -u -o pipefail
OUT=${OUT:-/tmp/vitjax-gpu}
SITE=${FA4_SITE:-/tmp/fa4site}
mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# The .pth that would put cutlass on the path is not read from a plain folder, hence dsl_packages.
export PYTHONPATH=.:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
STEPS=${*:-unpack smoke attention parity vit}

run() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) ==="
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start))s ==="
    return "$rc"
}

SMOKE='
import jax, jax.numpy as jnp, numpy as np, importlib.metadata as md
from vitjax import attention, fa4, layout
print(jax.devices(), {p: md.version(p) for p in ("fa4-jax", "cutejax", "nvidia-cutlass-dsl", "jax-tvm-ffi")})
packed = layout.pack([(1, 12, 20), (1, 8, 8), (1, 2, 2)], 512, 4)
seg = attention.Segments(*(jnp.asarray(a) for a in packed[3:]))
q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((512, 16, 72)), jnp.bfloat16) for i in range(3))
run = lambda impl: np.asarray(jax.jit(lambda q, k, v: attention.attention(q, k, v, seg, impl))(q, k, v), np.float32)
real = packed.segment_ids >= 0
print("default:", attention.default_implementation(), "tiles:", {h: str(t) for h, t in fa4.FA4_TILES.items()},
      "max abs err vs reference:", float(np.abs(run("fa4")[real] - run("reference")[real]).max()))
'

# One fa4 call on 20 x 4800 under each schedule in $PROFILE_TILES, for ncu (its kernel is the only CuTe one).
PROFILE='
import sys, jax
sys.path.insert(0, "bench")
from bench_attention import CASES, random_qkv, run_fn, segments
from vitjax import fa4
fa4.set_fa4_tile(72, fa4.Fa4Tile.parse(sys.argv[1]))
grids, tokens, slots = CASES["20x4800"]
fn = run_fn("fa4", segments(grids, tokens, slots))
jax.block_until_ready(fn(*random_qkv(0, tokens, 72)))
'

for step in $STEPS; do
    case $step in
    unpack)
        [ -d "$SITE/fa4_jax" ] || { mkdir -p "$SITE" && xz -dc .fa4/site.tar.xz | tar xf - -C "$SITE"; } || exit 1
        cp .fa4/libtvm_ffi_testing.so "$SITE/tvm_ffi/lib/" || exit 1  # tvm_ffi's core links it
        du -sh "$SITE" ;;
    smoke) export SMOKE && run smoke 240 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm \
        --format=csv && python3 -c "$SMOKE"' || exit 1 ;;
    tiles) run tiles 420 python3 bench/bench_fa4_tiles.py --out "$OUT/results" ${TILES:+--variants "$TILES"} \
        ${TILE_FLAGS:-} ;;
    block) mkdir -p "$OUT/hlo" && run block 420 env HLO_DIR="$OUT/hlo" python3 bench/bench_block.py --no-parts \
        --variants "${BLOCK_VARIANTS:-shipped,cudnn_layer_norm,triton_block_level,shipped_again}" ${BLOCK_FLAGS:-}
        tar czf "$OUT/hlo.tar.gz" -C "$OUT" hlo && rm -r "$OUT/hlo" ;;  # the device tool brings back few files
    profile)
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        for tile in ${PROFILE_TILES:-192x144ss}; do
            run "profile-${tile//:/-}" 120 "$NCU" --clock-control none --kernel-name regex:kernel_cutlass_kernel \
                --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
                --section InstructionStats --section Occupancy --section MemoryWorkloadAnalysis_Tables \
                python3 -c "$PROFILE" "$tile"
        done ;;
    widths) run widths 240 python3 bench/bench_fa4_widths.py --out "$OUT/results" ${PAIRS:+--pairs "$PAIRS"} ;;
    fp8) run fp8 300 python3 bench/bench_fp8.py --out "$OUT/results" ;;
    attention) run attention 300 python3 bench/bench_attention.py --impls fa4,cudnn_packed --out "$OUT/results" \
        ${ATTN_FLAGS:-} ;;
    parity) run parity 300 env JAX_PLATFORMS=cuda python3 -m pytest -m gpu -q -s tests/test_gpu_parity.py ;;
    fit) run fit 480 python3 bench/bench_fit_start.py --out "$OUT/results" ;;  # fitted compiles beside served calls
    vit) run vit 540 python3 bench/bench_vit.py --out "$OUT/results" --no-parts --no-warm-start \
        --attention "${VIT_ATTENTION:-cudnn_packed,fa4}" ${VIT_FLAGS:-} ;;
    *) echo "unknown step $step" ;;
    esac
done
