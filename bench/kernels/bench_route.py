"""The decode router and the small bf16 GEMMs on the H200: cuBLAS + Triton against the CUDA kernels of
``csrc/bf16_mma.cu``.

* Router, T in 1, 8, 32, 64 tokens: the path it replaces (cuBLAS GEMM of the 264 padded router rows,
  :func:`~vibeqwen_kernels.moe.fused.fused_router`, :func:`~vibeqwen_kernels.moe.fused.moe_align` with 16-pair
  blocks) against :func:`~vibeqwen_kernels.moe.route_cuda.fused_route`.
* GDN's b|a projection (64 x 2048 bf16), M in 1, 8, 32, 64 rows: cuBLAS against
  :func:`~vibeqwen_kernels.bf16_mma.bf16_linear_mma`.

Timed as replays of one CUDA graph calling each path once per copy of the weights (8 copies, as 8 layers: each call
reads its weight from HBM); us per call. The bytes (1.1 MB router, 0.26 MB b|a) take 0.26 / 0.06 us at 4.2 TB/s:
these calls are latency, and the graph's back-to-back launches show what a decode step pays.

    python bench/kernels/bench_route.py [--ts 1,8,32,64] [--json PATH] [--phases]

``--phases`` instead prints the fused router's in-kernel timeline per T (``fused_route(debug=)``, the median of 20
single launches): the spread of the CTAs' GEMM start and end after the first CTA's start (%globaltimer, ns), when
the last CTA began routing and ended, and its routing / scan / scatter phases in SM clocks (the routing split at
its first warp's stamps: keys built from the logits, sorted, top-k rounds, softmax sums, stores and barrier; with
the routing split by token group, from the aligning CTA's own group routing to every token's ids read back).
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

COPIES = 8


def _old_route(x, rows, top_k):
    from vibeqwen_kernels.moe.fused import fused_router, moe_align

    logits = x @ rows.t()
    _w, ids = fused_router(logits[:, :257], top_k)
    return moe_align(ids, 257, 16)


def _phases(ts, routers, dev) -> None:
    from vibeqwen_kernels.moe import route_cuda as R

    w = routers[0][1]
    for t in ts:
        x = torch.randn(t, 2048, device=dev).to(torch.bfloat16)
        rows = []
        n = w.tiles * R.route_groups(t)  # the grid's CTAs
        for _ in range(25):
            dbg = torch.zeros(16 + 2 * n, device=dev, dtype=torch.int64)
            R.fused_route(x, w, 8, 16, debug=dbg)
            torch.cuda.synchronize(dev)
            d = dbg.tolist()
            t0 = min(d[16:16 + n])
            rows.append([max(d[16:16 + n]) - t0, min(d[16 + n:16 + 2 * n]) - t0, max(d[16 + n:16 + 2 * n]) - t0,
                         d[0] - t0, d[1] - t0, d[9] - d[8], d[11] - d[9], d[12] - d[11],
                         d[2] - d[8], d[3] - d[2], d[4] - d[3], d[5] - d[4], d[9] - d[5]])
        med = [sorted(c)[len(c) // 2] for c in zip(*rows[5:])]
        line = (f"T={t} phases: last CTA start {med[0]} ns, GEMM end first/last {med[1]}/{med[2]} ns, routing "
                f"start {med[3]} ns, end {med[4]} ns; routing {med[5]} clk, scan {med[6]} clk, scatter {med[7]} clk")
        if R.route_split(t, R.route_groups(t)):  # routing = the aligning CTA's group routing + the hand-off
            line += " (routing split by token group)"
        else:
            line += (f"; routing warp 0: keys {med[8]}, sort {med[9]}, top-k rounds {med[10]}, softmax {med[11]}, "
                     f"stores + barrier {med[12]} clk")
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,8,32,64")
    ap.add_argument("--json", default=None)
    ap.add_argument("--phases", action="store_true")
    args = ap.parse_args()
    from vibeqwen_kernels import bf16_mma as B
    from vibeqwen_kernels.moe import route_cuda as R

    dev = torch.device("cuda")
    if B.bf16_mma_library(dev) is None:
        sys.exit("the CUDA bf16 kernels are not available here (sm_90+ and nvcc needed)")
    torch.manual_seed(0)
    routers = []
    for _ in range(COPIES):
        router = (torch.randn(256, 2048, device=dev) * 0.03).to(torch.bfloat16)
        gate = (torch.randn(1, 2048, device=dev) * 0.03).to(torch.bfloat16)
        rows = torch.cat([router, gate, gate.new_zeros(7, 2048)])  # the model's padded cuBLAS weight
        routers.append((rows, R.prepack_router(router, gate)))
    bas = []
    for _ in range(COPIES):
        w = (torch.randn(64, 2048, device=dev) * 0.03).to(torch.bfloat16)
        bas.append((w, B.prepack_bf16_mma(w)))
    if args.phases:
        _phases([int(v) for v in args.ts.split(",")], routers, dev)
        return
    rows_out = []
    for t in (int(v) for v in args.ts.split(",")):
        xs = [torch.randn(t, 2048, device=dev).to(torch.bfloat16) for _ in range(COPIES)]
        old = time_graph([functools.partial(_old_route, x, r[0], 8) for x, r in zip(xs, routers)], reps=50) * 1e6
        new = time_graph([functools.partial(R.fused_route, x, r[1], 8, 16) for x, r in zip(xs, routers)],
                         reps=50) * 1e6
        ba_cublas = time_graph([functools.partial(torch.matmul, x, w[0].t()) for x, w in zip(xs, bas)], reps=50) * 1e6
        ba_mma = time_graph([functools.partial(B.bf16_linear_mma, x, w[1]) for x, w in zip(xs, bas)], reps=50) * 1e6
        row = {"t": t, "route_old_us": round(old, 2), "route_fused_us": round(new, 2),
               "ba_cublas_us": round(ba_cublas, 2), "ba_mma_us": round(ba_mma, 2)}
        rows_out.append(row)
        print(f"T={t}: router {old:.2f} -> {new:.2f} us; b|a {ba_cublas:.2f} -> {ba_mma:.2f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
