"""Run one fused-MoE call per token count for Nsight Compute (model shapes, random NVFP4 experts).

Each T runs `fused_router` + `fused_moe` once with the tuned config (`pick_moe_config`), so the profiled
GEMM/GEMV launches are those the engine makes at that T. From the repo root on the GPU host:

    ncu --clock-control none -k regex:_moe_gem --section SpeedOfLight --section WarpStateStats \
        --section MemoryWorkloadAnalysis python3 bench/kernels/profile_moe.py --ts 1,32,1024

``--mlp-cta 16,8`` runs each T once per CTA shape of the one-launch expert MLP (``VIBEQWEN_MOE_MLP_CTA``; from 16
tokens, kernel ``moe_mlp_kernel``), in that order, to compare them launch for launch.
"""

from __future__ import annotations

import argparse
import os

import torch
from vibeqwen_kernels.moe import fused as F

from vibeqwen.checkpoint.quant import nvfp4_quantize

E, TOP_K, H, I = 256, 8, 2048, 512


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,32,1024", help="token counts, comma-separated")
    ap.add_argument("--mlp-cta", default="", help="CTA shapes of the one-launch expert MLP to run each T with, "
                                                   "comma-separated (16, 8); unset: the rule's")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    trip = []
    for n, k in ((I, H), (I, H), (H, I)):
        p, s, g = nvfp4_quantize(torch.randn(E + 1, n, k, device=dev) / k**0.5)
        trip.append([(p[e], s[e], g[e]) for e in range(E + 1)])
    weights = F.prepack_moe_nvfp4(*trip, device=dev)
    for t in (int(v) for v in args.ts.split(",")):
        x = torch.randn(t, H, device=dev).to(torch.bfloat16)
        tw, ti = F.fused_router(torch.randn(t, E + 1, device=dev).to(torch.bfloat16), TOP_K)
        cfg = F.pick_moe_config(t, TOP_K + 1, E + 1)
        for cta in args.mlp_cta.split(",") if args.mlp_cta else [None]:
            if cta is not None:
                os.environ["VIBEQWEN_MOE_MLP_CTA"] = cta
            print(f"T={t}{'' if cta is None else f' mlp cta {cta}'}: {cfg}", flush=True)
            F.fused_moe(x, tw, ti, weights, cfg)
        os.environ.pop("VIBEQWEN_MOE_MLP_CTA", None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
