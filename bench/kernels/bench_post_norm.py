"""A decoder layer's output projection, residual add and post-attention RMSNorm on the H200: the three launches
(``fp8_linear_mma``'s split-K GEMM and reduce, then ``rms_norm``) against the two of
``fp8_linear_mma_add_rms_norm`` (the reduce, the add and the norm in one program per row), with 4 and 8 warps in
that program.

The model's shape (FP8 2048 x 4096, per-row scales; the plan splits K), M rows of x (the decode batch). Timed as
replays of one CUDA graph of 8 calls, each with its own weight copy (read from HBM) and captured with early launch
as the decode graphs are; us per call. The bytes (8.4 MB of codes) take ~2.0 us at 4.2 TB/s: the rest is latency.
Also checks the fused outputs against the three launches (h bit for bit, y up to one bf16 ulp).

    python bench/kernels/bench_post_norm.py [--ms 1,8,16,32,64]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import time_graph

COPIES = 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,16,32,64")
    args = ap.parse_args()
    from vibeqwen_kernels.fp8 import mma as FM
    from vibeqwen_kernels.fp8 import prepack_fp8
    from vibeqwen_kernels.norm_fused import rms_norm
    from vibeqwen_kernels.pdl import early_launch

    dev = torch.device("cuda")
    if FM.fp8_mma_library(dev) is None:
        sys.exit("csrc/fp8_mma.cu does not build here (sm_90+ and nvcc needed)")
    torch.manual_seed(0)
    n, k = 2048, 4096
    ws = []
    for _ in range(COPIES):
        q = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
        ws.append(FM.prepack_fp8_mma(prepack_fp8(q, (torch.rand(n, device=dev) + 0.5) / 64, dev)))
    nw = torch.randn(n, device=dev).to(torch.bfloat16) * 0.1

    def three(x, w, r):
        return rms_norm(FM.fp8_linear_mma(x, w), nw, 1e-6, residual=r)

    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        xs = [torch.randn(m, k, device=dev).to(torch.bfloat16) for _ in range(COPIES)]
        r = torch.randn(m, n, device=dev).to(torch.bfloat16)
        y3, h3 = three(xs[0], ws[0], r)
        row = {"m": m, "split": FM.launch_plan(m, n, k)[2]}
        for warps in (4, 8):
            y2, h2 = FM.fp8_linear_mma_add_rms_norm(xs[0], ws[0], r, nw, 1e-6, norm_warps=warps)
            assert torch.equal(h2, h3), f"M={m}, {warps} warps: h differs"
            diff = (y2.float() - y3.float()).abs()
            assert bool((diff <= 2.0**-7 * y3.float().abs() + 1e-6).all()), f"M={m}, {warps} warps: y differs"
            row[f"flips_{warps}"] = int((diff > 0).sum())
        with early_launch():
            row["three_us"] = time_graph([functools.partial(three, x, w, r) for x, w in zip(xs, ws)], reps=50) * 1e6
            for warps in (4, 8):
                row[f"fused{warps}_us"] = time_graph(
                    [functools.partial(FM.fp8_linear_mma_add_rms_norm, x, w, r, nw, 1e-6, norm_warps=warps)
                     for x, w in zip(xs, ws)], reps=50) * 1e6
        rows.append(row)
        print(row, flush=True)
    print("| M | split | three launches us | fused, 4 warps | fused, 8 warps | y values flipped (4 / 8 warps) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['m']} | {r['split']} | {r['three_us']:.2f} | {r['fused4_us']:.2f} | {r['fused8_us']:.2f} | "
              f"{r['flips_4']} / {r['flips_8']} |")


if __name__ == "__main__":
    main()
