"""FP8 W8A16 decode GEMMs on the H200: the Triton kernel against the CUDA MMA kernel (``csrc/fp8_mma.cu``).

For the FP8 projections' decode shapes (GDN qkv|z 12288 x 2048, attention q|k|v 9216 x 2048, the output
projections 2048 x 4096) and M in 1, 8, 32, 64 rows of bf16 x: :func:`vibeqwen_kernels.fp8.fp8_linear` (Triton) and
:func:`vibeqwen_kernels.fp8.mma.fp8_linear_mma` with :func:`~vibeqwen_kernels.fp8.mma.launch_plan`'s plan and every
other (warps, k slices, split). Timed as replays of one CUDA graph calling it once per copy of the weight (6 copies:
each call reads its weight from HBM, not L2); us per call, TB/s of the weight's bytes, the six fastest plans, and
the relative Frobenius error of the default plan against the fp32 reference. Needs the CUDA library (nvcc).

    python bench/kernels/bench_fp8_mma.py [--ms 1,8,32,64] [--json PATH]

(The eleventh session's table in bench/results/h200_notes.md and kernels/fp8/mma.py came from the same
measurements run as an ad-hoc script; this script repeats them and has not itself run on a GPU yet.)
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

SHAPES = [(12288, 2048), (9216, 2048), (2048, 4096)]
COPIES = 6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,32,64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from vibeqwen_kernels.fp8 import fp8_linear, fp8_linear_ref, prepack_fp8
    from vibeqwen_kernels.fp8 import mma as FM

    dev = torch.device("cuda")
    if FM.fp8_mma_library(dev) is None:
        sys.exit("the CUDA FP8 kernel is not available here (sm_90+ and nvcc needed)")
    torch.manual_seed(0)
    rows = []
    for n, k in SHAPES:
        ws = []
        for _ in range(COPIES):
            q = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
            w = prepack_fp8(q, torch.full((n,), 0.02, device=dev), dev)
            ws.append((w, FM.prepack_fp8_mma(w)))
        mb = n * k / 1e6
        for m in (int(v) for v in args.ms.split(",")):
            xs = [torch.randn(m, k, device=dev).to(torch.bfloat16) for _ in ws]
            triton_us = time_graph([functools.partial(fp8_linear, x, w[0]) for x, w in zip(xs, ws)], reps=20) * 1e6
            plans = [None] + [(w_, ks, sp) for w_ in FM.WARPS for ks in (1, 2, 4) for sp in (1, 2, 4, 8)
                              if k % (FM.PIECE_K * sp) == 0]
            times = {}
            for plan in plans:
                calls = [functools.partial(FM.fp8_linear_mma, x, w[1], plan=plan) for x, w in zip(xs, ws)]
                times[str(plan) if plan else "default " + str(FM.launch_plan(m, n, k))] = time_graph(calls, reps=20) * 1e6
            ref = fp8_linear_ref(xs[0], ws[0][0])
            err = ((FM.fp8_linear_mma(xs[0], ws[0][1]).float() - ref).norm() / ref.norm()).item()
            default = next(v for p, v in times.items() if p.startswith("default"))
            best = sorted(times.items(), key=lambda kv: kv[1])[:6]
            row = {"n": n, "k": k, "m": m, "MB": mb, "triton_us": round(triton_us, 1), "mma_us": round(default, 1),
                   "triton_tbs": round(mb / triton_us, 2), "mma_tbs": round(mb / default, 2), "rel_err": err,
                   "fastest": [(p, round(v, 1)) for p, v in best]}
            rows.append(row)
            print(f"{n}x{k} M={m}: triton {triton_us:.1f} us ({mb / triton_us:.2f} TB/s), mma {default:.1f} us "
                  f"({mb / default:.2f} TB/s), err {err:.1e}; fastest: "
                  + ", ".join(f"{p} {v:.1f}" for p, v in best), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
