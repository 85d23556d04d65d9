#!/usr/bin/env bash
# One device call for the NVFP4 linear kernels: GPU tests, then (optionally tuning and) the benchmark.
# Run from the repo root on the GPU machine:  bash bench/kernels/run_h200.sh [--tune] [bench args...]
# Logs, the results JSON and tuned configs go to $OUT (default /tmp/nvfp4_out).
set -uo pipefail
OUT=${OUT:-/tmp/nvfp4_out}
mkdir -p "$OUT"
# The package is not installed there: expose kernels/ and configs/ under their import names.
shim=$(mktemp -d)
ln -s "$PWD/kernels" "$shim/vibeqwen_kernels"
ln -s "$PWD/configs" "$shim/vibeqwen_configs"
export PYTHONPATH="$PWD:$shim${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton_cache}"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# Smoke test both kernels once; if the repacked nibble order does not compile with this Triton, fall
# back to the checkpoint's order (prepack_nvfp4 reads VIBEQWEN_NVFP4_REPACK) for the rest of the run.
smoke='import torch; from vibeqwen.checkpoint.quant import nvfp4_quantize as q; from vibeqwen_kernels.nvfp4 import *
p, s, g = q(torch.randn(256, 512, device="cuda")); w = prepack_nvfp4(p, s, g)
for m in (1, 200):
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16); r = nvfp4_linear_ref(x, p, s, g)
    e = ((nvfp4_linear(x, w).float() - r).norm() / r.norm()).item(); print("smoke M", m, "rel err", e); assert e < 4e-3'
if ! python3 -c "$smoke" > "$OUT/smoke.log" 2>&1; then
    tail -n 5 "$OUT/smoke.log"; echo "repacked order failed: falling back to VIBEQWEN_NVFP4_REPACK=0"
    export VIBEQWEN_NVFP4_REPACK=0
    python3 -c "$smoke" 2>&1 | tail -n 5
else
    cat "$OUT/smoke.log"
fi

timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_nvfp4_linear.py 2>&1 | tee "$OUT/pytest.log"
test_rc=${PIPESTATUS[0]}
echo "pytest exit code: $test_rc"

python3 bench/kernels/bench_nvfp4.py "$@" --json "$OUT/nvfp4_h200.json" \
    --configs-out "$OUT/nvfp4_h200_configs.json" > "$OUT/table.md" 2> "$OUT/bench.log"
bench_rc=$?
grep -E "Error|FAILED" "$OUT/bench.log" | tail -n 5
if [ "${PROFILE:-0}" = 1 ]; then
    # Nsight Compute on lm_head decode (M=1) and prefill (M=1024); clocks left as they are
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    timeout 240 "$NCU" --clock-control none -k regex:nvfp4 --launch-skip 1 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 bench/kernels/profile_nvfp4.py > "$OUT/ncu.txt" 2>&1
    grep -E "nvfp4_|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Stall|Issue Slots|Executed Ipc" "$OUT/ncu.txt" | head -n 60
fi
echo "pytest rc $test_rc, bench rc $bench_rc"
cat "$OUT/table.md"
