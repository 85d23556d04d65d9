"""Run a few NVFP4 linear launches for Nsight Compute (one launch per case after a warm-up).

    ncu --clock-control none -k regex:nvfp4 --launch-skip 1 --launch-count 3 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy python3 bench/kernels/profile_nvfp4.py
"""

from __future__ import annotations

import torch
from vibeqwen_kernels.nvfp4 import nvfp4_linear, prepack_nvfp4

from vibeqwen.checkpoint.quant import nvfp4_quantize


def main() -> None:
    torch.manual_seed(0)
    w = prepack_nvfp4(*nvfp4_quantize(torch.randn(248320, 2048, device="cuda")))
    for m in (1, 1024):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        nvfp4_linear(x, w)  # warm-up launch (compile), skipped by --launch-skip
        nvfp4_linear(x, w)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
