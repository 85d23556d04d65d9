"""The expert alignment of prefill-sized batches on the H200: the one-launch CUDA kernel (``csrc/moe_align.cu``)
against the three Triton launches it replaces, and the Triton top-k before it for scale.

For T tokens routed by :func:`~vibeqwen_kernels.moe.fused.fused_router` (k' = 9 with the shared expert, E' = 257) and
block_m 64 (the prefill GEMM's blocks; 16 up to 64 tokens, the decode GEMM's): us per call of the Triton path of
:func:`~vibeqwen_kernels.moe.fused.moe_align` and of :func:`~vibeqwen_kernels.moe.align_cuda.moe_align_cuda`,
timed as replays of one CUDA graph calling it once per copy of the ids (6 copies); the outputs of both paths are
compared too.

    python bench/kernels/bench_align.py [--ts 64,256,512,1024,8192] [--block-m 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import time_graph

COPIES = 6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="64,256,512,1024,8192")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from vibeqwen_kernels.moe import align_cuda
    from vibeqwen_kernels.moe import fused as F

    dev = torch.device("cuda")
    if not align_cuda.align_supported(257, dev):
        sys.exit("the CUDA alignment is not available here (sm_90+ and nvcc needed)")
    torch.manual_seed(0)
    rows = []
    for t in (int(v) for v in args.ts.split(",")):
        logits = [torch.randn(t, 257, device=dev) for _ in range(COPIES)]
        ids = [F.fused_router(lg, 8)[1] for lg in logits]
        topk = time_graph([functools.partial(F.fused_router, lg, 8) for lg in logits], reps=30) * 1e6
        bm = 16 if t <= 64 else args.block_m  # the decode GEMM's blocks up to 64 tokens
        os.environ["VIBEQWEN_CUDA_ALIGN"] = "0"
        try:
            tri = time_graph([functools.partial(F.moe_align, i, 257, bm) for i in ids], reps=30) * 1e6
            want = F.moe_align(ids[0], 257, bm)
        finally:
            del os.environ["VIBEQWEN_CUDA_ALIGN"]
        outs = [tuple(torch.empty_like(w) for w in want) for _ in ids]
        cu = time_graph([functools.partial(align_cuda.moe_align_cuda, i.view(-1), 257, bm, *o)
                         for i, o in zip(ids, outs)], reps=30) * 1e6
        same = all(torch.equal(a, b) for a, b in zip(outs[0], want))
        rows.append({"t": t, "block_m": bm, "topk_us": round(topk, 2), "align_triton_us": round(tri, 2),
                     "align_cuda_us": round(cu, 2), "same": same})
        print(f"T={t}: top-k {topk:.2f} us; align Triton {tri:.2f} -> CUDA {cu:.2f} us; outputs equal: {same}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
