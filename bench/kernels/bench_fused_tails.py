"""The two reduce launches that decode steps fold into the GEMM before them, on the H200: fused against separate.

* FP8 split-K fix-up (``csrc/fp8_mma.cu``): the output projections' shape (2048 x 4096, split by ``launch_plan``)
  at M rows, the last CTA of each row group summing the splits (``fp8_linear_mma(fixup=True)``) against the GEMM
  plus ``_fp8_splitk_reduce_kernel`` (``fixup=False``).
* MoE slot sum in the down GEMM (``csrc/moe_mma.cu``): ``fused_moe`` of T tokens (E' = 257, k' = 9, H = 2048,
  I = 512, random NVFP4 experts, ``fused_router`` routings) with ``VIBEQWEN_MOE_SUM_MAX_T=64`` (the sum in the down
  GEMM's last CTAs) against ``0`` (the Triton slot sum after it).

Both timed as replays of one CUDA graph of R calls (distinct weight copies / routings, so weights come from HBM),
captured inside ``pdl.early_launch()`` up to ``pdl.EARLY_MAX_TOKENS`` rows as the decode graphs are; us per call,
the fused result checked equal to the separate one bit for bit. The last lines are a table.

    python bench/kernels/bench_fused_tails.py [--ms 1,2,4,8,16,32,64] [--ts 1,2,4,8,16,32,64] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import TOP_K, E, H, I, time_graph

COPIES = 8


def _timed(calls, rows: int) -> float:
    """us per call, the graph captured with early launch where decode graphs of that size use it."""
    from vibeqwen_kernels import pdl

    with pdl.early_launch(rows <= pdl.EARLY_MAX_TOKENS):
        return time_graph(calls, reps=30) * 1e6


def bench_fp8(ms: list[int]) -> list[dict]:
    from vibeqwen_kernels.fp8 import prepack_fp8
    from vibeqwen_kernels.fp8 import mma as FM

    dev = torch.device("cuda")
    n, k = 2048, 4096
    ws = []
    for _ in range(COPIES):
        q = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
        ws.append(FM.prepack_fp8_mma(prepack_fp8(q, torch.full((n,), 0.02, device=dev), dev)))
    rows = []
    for m in ms:
        xs = [torch.randn(m, k, device=dev).to(torch.bfloat16) for _ in ws]
        outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in ws]
        us = {}
        for fixup in (False, True):
            calls = [functools.partial(FM.fp8_linear_mma, x, w, out=o, fixup=fixup) for x, w, o in zip(xs, ws, outs)]
            us[fixup] = _timed(calls, m)
        same = torch.equal(FM.fp8_linear_mma(xs[0], ws[0], fixup=True), FM.fp8_linear_mma(xs[0], ws[0], fixup=False))
        row = {"m": m, "plan": FM.launch_plan(m, n, k), "reduce_us": round(us[False], 2), "fixup_us": round(us[True], 2),
               "same": same}
        rows.append(row)
        print(f"fp8 {n}x{k} M={m} plan {row['plan']}: GEMM + reduce {us[False]:.2f} us, fix-up {us[True]:.2f} us"
              f"{'' if same else '  VALUES DIFFER'}", flush=True)
    return rows


def bench_moe(ts: list[int]) -> list[dict]:
    from vibeqwen_kernels.moe import fused as F

    from vibeqwen.checkpoint.quant import nvfp4_quantize

    dev = torch.device("cuda")
    trip = []
    for n, k in ((I, H), (I, H), (H, I)):
        w = torch.randn(E + 1, n, k, device=dev) / k**0.5
        p, s, g = nvfp4_quantize(w)
        trip.append([(p[e], s[e], g[e]) for e in range(E + 1)])
        del w
    weights = F.prepack_moe_nvfp4(*trip, device=dev)
    del trip
    rows = []
    for t in ts:
        xs = [torch.randn(t, H, device=dev).to(torch.bfloat16) for _ in range(COPIES)]
        routes = [F.fused_router(torch.randn(t, E + 1, device=dev).to(torch.bfloat16), TOP_K) for _ in range(COPIES)]
        outs = [torch.empty(t, H, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
        us, ys = {}, {}
        for bound in ("0", "64"):
            os.environ["VIBEQWEN_MOE_SUM_MAX_T"] = bound
            calls = [functools.partial(F.fused_moe, x, r[0], r[1], weights, out=o) for x, r, o in zip(xs, routes, outs)]
            us[bound] = _timed(calls, t)
            ys[bound] = F.fused_moe(xs[0], routes[0][0], routes[0][1], weights)
        os.environ.pop("VIBEQWEN_MOE_SUM_MAX_T")
        same = torch.equal(ys["0"], ys["64"])
        row = {"t": t, "separate_us": round(us["0"], 2), "fused_us": round(us["64"], 2), "same": same}
        rows.append(row)
        print(f"fused_moe T={t}: slot sum separate {us['0']:.2f} us, in the down GEMM {us['64']:.2f} us"
              f"{'' if same else '  VALUES DIFFER'}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--ts", default="1,2,4,8,16,32,64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    fp8 = bench_fp8([int(v) for v in args.ms.split(",") if v])
    moe = bench_moe([int(v) for v in args.ts.split(",") if v])
    print("\n| rows | FP8 2048x4096 GEMM + reduce | fix-up | fused_moe, slot sum separate | in the down GEMM |")
    print("|---|---|---|---|---|")
    by_t = {r["t"]: r for r in moe}
    for m in sorted({r["m"] for r in fp8} | set(by_t)):
        f = next((r for r in fp8 if r["m"] == m), None)
        mo = by_t.get(m)
        print(f"| {m} | {f['reduce_us'] if f else '-'} | {f['fixup_us'] if f else '-'} | "
              f"{mo['separate_us'] if mo else '-'} | {mo['fused_us'] if mo else '-'} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "fp8_fixup": fp8, "moe_slot_sum": moe}, fh, indent=1)


if __name__ == "__main__":
    main()
