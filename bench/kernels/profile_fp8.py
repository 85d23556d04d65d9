"""Run the FP8 decode GEMMs once per shape and row count for Nsight Compute (model shapes, random E4M3 weights).

Each (shape, M) calls ``fp8_linear_mma`` once with ``launch_plan``'s plan (split launches also run the reduce
kernel), so the profiled launches are those a decode step makes. From the repo root on the GPU host:

    ncu --clock-control none -k regex:fp8_ --section SpeedOfLight --section WarpStateStats \
        python3 bench/kernels/profile_fp8.py --ms 1,8,32
"""

from __future__ import annotations

import argparse

import torch
from vibeqwen_kernels.fp8 import prepack_fp8
from vibeqwen_kernels.fp8 import mma as FM

SHAPES = [(12288, 2048), (9216, 2048), (2048, 4096)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,32", help="row counts, comma-separated")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for n, k in SHAPES:
        q = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
        w = FM.prepack_fp8_mma(prepack_fp8(q, torch.full((n,), 0.02, device=dev), dev))
        for m in (int(v) for v in args.ms.split(",")):
            print(f"{n}x{k} M={m}: plan {FM.launch_plan(m, n, k)}", flush=True)
            FM.fp8_linear_mma(torch.randn(m, k, device=dev).to(torch.bfloat16), w)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
