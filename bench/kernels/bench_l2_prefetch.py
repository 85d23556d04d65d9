"""The decode router's L2 prefetch of the next layer's first projection, on the H200.

A decode step's layer ends router -> MoE (gate|up, down, slot sum) -> next layer's norm -> its FP8 input projection.
At small batches the MoE moves ~16 MB in ~25 us (HBM mostly idle), and the projection then reads 19-25 MB from HBM.
Here: chains of L "layers" (distinct router, FP8 weight and routing each; one expert set, whose experts the random
routings mostly find outside L2) of ``fused_route`` -> ``fused_moe`` -> ``fp8_linear_mma`` (the GDN qkv|z shape,
12288 x 2048), with the router launch prefetching that layer's FP8 weight (``fused_route(prefetch=)``) and without;
plus the FP8 GEMM alone reading its weight from HBM (L distinct copies) and from L2 (one copy, again and again): the
ceiling the prefetch can reach. CUDA-graph replays (early launch up to 32 tokens, as decode graphs); us per layer.
The prefetching chain's outputs are checked equal to the plain chain's.

    python bench/kernels/bench_l2_prefetch.py [--ts 1,8,32] [--layers 8]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import TOP_K, E, H, I, time_graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,8,32")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    from vibeqwen_kernels import pdl
    from vibeqwen_kernels.fp8 import prepack_fp8
    from vibeqwen_kernels.fp8 import mma as FM
    from vibeqwen_kernels.moe import fused as F
    from vibeqwen_kernels.moe import route_cuda as R

    from vibeqwen.checkpoint.quant import nvfp4_quantize

    dev = torch.device("cuda")
    torch.manual_seed(0)
    n_layers, n_fp8 = args.layers, 12288
    trip = []
    for n, k in ((I, H), (I, H), (H, I)):
        w = torch.randn(E + 1, n, k, device=dev) / k**0.5
        p, s, g = nvfp4_quantize(w)
        trip.append([(p[e], s[e], g[e]) for e in range(E + 1)])
        del w
    experts = F.prepack_moe_nvfp4(*trip, device=dev)
    del trip
    routers = [R.prepack_router((torch.randn(E, H, device=dev) / H**0.5).to(torch.bfloat16),
                                (torch.randn(1, H, device=dev) / H**0.5).to(torch.bfloat16)) for _ in range(n_layers)]
    fp8s = [FM.prepack_fp8_mma(prepack_fp8((torch.randn(n_fp8, H, device=dev) * 0.5).to(torch.float8_e4m3fn),
                                           torch.full((n_fp8,), 0.02, device=dev), dev)) for _ in range(n_layers)]
    rows = []
    for t in (int(v) for v in args.ts.split(",")):
        xs = [torch.randn(t, H, device=dev).to(torch.bfloat16) for _ in range(n_layers)]
        outs = [torch.empty(t, n_fp8, device=dev, dtype=torch.bfloat16) for _ in range(n_layers)]
        cfg = F.pick_moe_config(t)

        def layer(i: int, prefetch: bool):
            tw, ids, sorted_ids, bexp, _ = R.fused_route(xs[i], routers[i], TOP_K, cfg["BLOCK_M"],
                                                         prefetch=fp8s[i].codes if prefetch else None)
            y = F.fused_moe(xs[i], tw, ids, experts, cfg, align=(sorted_ids, bexp, cfg["BLOCK_M"]))
            FM.fp8_linear_mma(y, fp8s[i], out=outs[i])

        with pdl.early_launch(t <= pdl.EARLY_MAX_TOKENS):
            us = {}
            for pf in (False, True):
                us[pf] = time_graph([functools.partial(layer, i, pf) for i in range(n_layers)], reps=30) * 1e6
                if not pf:
                    plain = [o.clone() for o in outs]
            same = all(torch.equal(a, b) for a, b in zip(plain, outs))
            cold = time_graph([functools.partial(FM.fp8_linear_mma, xs[i], fp8s[i], out=outs[i])
                               for i in range(n_layers)], reps=30) * 1e6
            hot = time_graph([functools.partial(FM.fp8_linear_mma, xs[0], fp8s[0], out=outs[0])
                              for _ in range(n_layers)], reps=30) * 1e6
        rows.append((t, us[False], us[True], cold, hot, same))
        print(f"T={t}: layer tail {us[False]:.2f} us, with the prefetch {us[True]:.2f} us; the FP8 GEMM alone "
              f"{cold:.2f} us from HBM, {hot:.2f} us from L2{'' if same else '  OUTPUTS DIFFER'}", flush=True)
    print("\n| T | route + MoE + FP8 GEMM, us | with the prefetch | FP8 GEMM from HBM | from L2 |")
    print("|---|---|---|---|---|")
    for t, a, b, c, d, _ in rows:
        print(f"| {t} | {a:.2f} | {b:.2f} | {c:.2f} | {d:.2f} |")


if __name__ == "__main__":
    main()
