"""Device-to-device copies of one size after another on the H200: what a transfer of a decode kernel's size reaches.

The roofline floor divides a step's bytes by the copy bandwidth of one large copy (4.2-4.3 TB/s); a decode step is
~500 dependent kernels of 1-25 MB each. Here: replays of one CUDA graph of 6 copies of S MB (distinct buffers, so
each reads HBM), us per copy and TB/s counting the bytes read plus written, for S in 4, 8, 16, 25, 64, 256.

    python bench/kernels/bench_copy_sizes.py [--sizes-mb 4,8,16,25,64,256]

(Sixteenth session, H200: 4 MB 3.77 us = 2.22 TB/s, 8 MB 2.73, 16 MB 3.31, 25 MB 3.53, 64 MB 3.98, 256 MB 4.20: about
1.3 us a copy plus the bytes at ~4.3 TB/s.)
"""

from __future__ import annotations

import argparse
import statistics

import torch

COPIES = 6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="4,8,16,25,64,256")
    args = ap.parse_args()
    dev = torch.device("cuda")
    for mb in (int(v) for v in args.sizes_mb.split(",")):
        n = mb << 20
        srcs = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev) for _ in range(COPIES)]
        dsts = [torch.empty_like(s) for s in srcs]
        for d, s in zip(dsts, srcs):
            d.copy_(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for d, s in zip(dsts, srcs):
                d.copy_(s)
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / COPIES)
        us = statistics.median(times)
        print(f"copy {mb} MB: {us:.2f} us per copy, {2 * n / us / 1e6:.2f} TB/s (read + write)", flush=True)
        del g, srcs, dsts


if __name__ == "__main__":
    main()
