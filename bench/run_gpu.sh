#!/usr/bin/env bash
# Everything that needs the GPU, in one command (device time is scarce: one machine start, one call).
#   OUT=/tmp/out bash bench/run_gpu.sh [STEP...]     steps: env parity attention gemm block vit vit2 sweep bridge encode decode h2d
# Each step has its own time limit so one slow step cannot starve the rest; logs go to $OUT/<step>.log,
# the benchmark's JSON lines and plot to $OUT/results/.
set -u -o pipefail
OUT=${OUT:-/tmp/vitjax-gpu}
mkdir -p "$OUT/results"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
STEPS=${*:-env vit attention block parity}

run() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) ==="
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s ==="
}

for step in $STEPS; do
    case $step in
    env)
        run env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv;
            python3 -c "import jax, jaxlib, flax, torch, transformers, matplotlib;
print(jax.devices(), jax.__version__, jaxlib.__version__, flax.__version__, torch.__version__,
      transformers.__version__, matplotlib.__version__)"' ;;
    parity) run parity 150 env JAX_PLATFORMS=cuda python3 -m pytest -m gpu -q -s tests/test_gpu_parity.py ;;
    attention) run attention 200 python3 bench/bench_attention.py --sweep --out "$OUT/results" ;;
    gemm) run gemm 150 python3 bench/bench_gemm.py ;;
    h2d) run h2d 200 python3 bench/bench_h2d.py --out "$OUT/results" ;;
    block) run block 200 python3 bench/bench_block.py ;;
    vit) run vit 250 python3 bench/bench_vit.py --out "$OUT/results" ;;
    vit2) run vit2 300 python3 bench/bench_vit.py --out "$OUT/results" --devices 1,2,sp2 --no-parts --no-warm-start ;;
    sweep) run sweep 420 python3 bench/bench_vit.py --out "$OUT/results" --sweep ;;
    bridge) run bridge-test 300 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -m gpu -q -s tests/test_gpu_bridge.py
        run bridge 200 python3 bench/bench_bridge.py --out "$OUT/results" ;;
    encode) run encode 300 python3 bench/bench_encode.py --out "$OUT/results" --devices "${ENCODE_DEVICES:-1}" \
        --decoders "${ENCODE_DECODERS:-auto}" ;;
    # needs NVIDIA DALI importable there (nvidia-dali-cuda130, not in the device image)
    decode) for size in 960x1280 1000x1333; do
            run "decode-$size" 300 python3 bench/bench_decode.py --size "$size" --out "$OUT/results"; done ;;
    *) echo "unknown step $step" ;;
    esac
done
