"""Does the decode step's expert MLP (``moe_mlp``) wait on its busiest SMs? Its CTAs in 2, 4 and 8 slices of I.

A ``moe_mlp`` launch runs one CTA per (16-pair block, slice of I[, n8 half]), each streaming the same bytes (its
slice of the expert's gate|up and down weights) whatever its pair count. At 32 tokens ~165 blocks in 2 slices make
~334 CTAs for 396 CTA slots (3 an SM): every CTA starts at once, 70 SMs run 3 and 62 run 2. If a CTA's rate is held
by its SM's issue (the dequantization), the launch lasts as long as the SMs with 3, ~19% longer than the same bytes
spread evenly; in 4 or 8 slices each CTA streams a half or a quarter as much, the scheduler hands out the later
CTAs as slots free, and the SMs end closer together (for 2x / 4x the fp32 partials the slot sum reads).

Two measurements, model shapes (E' = 257 experts, k' = 9 slots, H = 2048, I = 512), random NVFP4 experts (the
e4m3 block-scale copy streamed, as the engine does):

* ``--distinct N,...``: 32 tokens routed round-robin over N distinct experts (a fresh random set a call), ``moe_mlp``
  alone, us a call and the rate of its bytes against the copy rate, for each slice count and CTA shape. If the time
  steps with the busiest SM's CTA count (max CTAs an SM) rather than growing with the bytes, the SMs' imbalance
  holds the kernel.
* ``--ts T,...``: ``fused_router`` routings of T tokens; ``fused_moe`` (align, ``moe_mlp``, slot sum) us a call for
  each slice count with the CTA shape the rule picks, and its output's largest difference from 2 slices' (fp32
  sums in another order: ~1e-6 relative).

All timed as replays of one CUDA graph of 8 calls with distinct routings and inputs.

    python bench/kernels/bench_moe_mlp_slices.py [--distinct 100,132,150,165,180,198,230] [--ts 16,24,32,48,64]

Needs the CUDA MoE kernels (sm_90, nvcc).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from bench_moe import TOP_K, E, H, time_graph
from bench_moe_decode import _env, random_experts
from h200_reference import copy_bandwidth_tbs

REPS = 8
SPLITS = (2, 4, 8)


def _slots(cols: str, sms: int) -> int:
    """CTA slots of the GPU for a moe_mlp CTA shape: 3 an SM with 8 columns, 2 with 16 (shared memory)."""
    return sms * (3 if cols == "8" else 2)


def distinct_sweep(ns: list[int], weights, copy: float, sms: int) -> None:
    """moe_mlp alone at 32 tokens routed over N distinct experts, per slice count and CTA shape."""
    from vibeqwen_kernels.moe import fused as F
    from vibeqwen_kernels.moe import mma_cuda as M

    dev = torch.device("cuda")
    t, kp, n_exp = 32, TOP_K + 1, E + 1
    n_pairs = t * kp
    w13, w2 = weights.w13_mma, weights.w2_mma
    chunk = 512 + (64 if w13.scales_e4m3 is not None else 128)  # bytes a 64-k chunk of 16 rows streams
    expert_mb = (w13.n // 16 * w13.k // 64 + w2.n // 16 * w2.k // 64) * chunk / 1e6
    xs = [torch.randn(t, H, device=dev).to(torch.bfloat16) for _ in range(REPS)]
    print("| N experts | blocks | split | CTA | CTAs with pairs | CTAs an SM | us | TB/s | % of copy |\n"
          "|---|---|---|---|---|---|---|---|---|", flush=True)
    for n in ns:
        gen = torch.Generator().manual_seed(n)
        aligned = []
        for _ in range(REPS):
            chosen = torch.randperm(E, generator=gen)[:n]
            slot = torch.arange(t * TOP_K).view(t, TOP_K)
            ids = torch.cat([chosen[slot % n], torch.full((t, 1), E)], 1).to(torch.int32).to(dev)
            aligned.append(F.moe_align(ids, n_exp, 16))
        blocks = int((aligned[0][1] >= 0).sum())
        mb = blocks * expert_mb
        for cols in M.MLP_CTAS:
            for split in SPLITS:
                first = aligned[0][0].view(-1, 16)[: aligned[0][1].numel()]
                real = aligned[0][1] >= 0
                halves = int((real & (first[:, 0] < n_pairs)).sum()) + (
                    int((real & (first[:, 8] < n_pairs)).sum()) if cols == "8" else 0)
                ctas = halves * split
                # one wave when the CTAs fit the slots (the busiest SM runs ceil(CTAs / SMs) of them), else the
                # scheduler refills slots as CTAs end
                waves = ctas / _slots(cols, sms)
                load = f"{math.ceil(ctas / sms)} (1 wave)" if waves <= 1 else f"{ctas / sms:.1f} ({waves:.2f} waves)"
                outs = [torch.empty(split, n_pairs, H, device=dev) for _ in range(REPS)]
                with _env({"VIBEQWEN_MOE_MLP_CTA": cols}):
                    calls = [functools.partial(M.moe_mlp, x, kp, w13, weights.w13_gscale, w2, weights.w2_gscale,
                                               a[0], a[1], n_pairs, split, o) for x, a, o in zip(xs, aligned, outs)]
                    us = time_graph(calls, reps=20) * 1e6
                # bytes: a CTA per n8 half streams its expert's slice again (mostly from L2 for the second half)
                print(f"| {n} | {blocks} | {split} | {cols} | {ctas} | {load} | {us:.1f} | "
                      f"{mb / us:.2f} | {100 * mb / us / copy:.0f}% |", flush=True)


def routed_sweep(ts: list[int], weights) -> None:
    """fused_moe (align, moe_mlp, slot sum) per slice count at T tokens of fused_router routings."""
    from vibeqwen_kernels.moe import fused as F
    from vibeqwen_kernels.moe import mma_cuda as M

    dev = torch.device("cuda")
    kp, n_exp = TOP_K + 1, E + 1
    print("| T | CTA (rule) | " + " | ".join(f"split {s} us" for s in SPLITS) + " | max rel. diff from split 2 |\n"
          "|---|---|" + "---|" * len(SPLITS) + "---|", flush=True)
    for t in ts:
        n_pairs = t * kp
        xs = [torch.randn(t, H, device=dev).to(torch.bfloat16) for _ in range(REPS)]
        routes = [F.fused_router(torch.randn(t, n_exp, device=dev).to(torch.bfloat16), TOP_K) for _ in range(REPS)]
        outs = [torch.empty(t, H, device=dev, dtype=torch.bfloat16) for _ in range(REPS)]
        cfg = dict(F.pick_moe_config(t, kp, n_exp), BLOCK_M=16, MMA=1, GEMV=0, SPLIT_GU=0)
        times, ys = [], []
        for split in SPLITS:
            env = {"VIBEQWEN_MOE_MLP": "1", "VIBEQWEN_MOE_MLP_MIN_PAIRS": "1", "VIBEQWEN_MOE_MLP_SPLIT": str(split)}
            with _env(env):
                calls = [functools.partial(F.fused_moe, x, tw, ti, weights, cfg, out=o)
                         for x, (tw, ti), o in zip(xs, routes, outs)]
                times.append(time_graph(calls, reps=20) * 1e6)
                ys.append(F.fused_moe(xs[0], *routes[0], weights, cfg).float())
        scale = ys[0].abs().max().item()
        diff = max((y - ys[0]).abs().max().item() for y in ys[1:]) / scale
        print(f"| {t} | {M.mlp_cta(n_pairs)} | " + " | ".join(f"{v:.1f}" for v in times) + f" | {diff:.1e} |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--distinct", default="100,132,150,165,180,198,230",
                    help="distinct routed experts of the 32-token sweep (empty: skip it)")
    ap.add_argument("--ts", default="16,24,32,48,64", help="tokens of the routed sweep (empty: skip it)")
    args = ap.parse_args()
    from vibeqwen_kernels.moe import mma_cuda as M

    dev = torch.device("cuda")
    if M.mma_library(dev) is None:
        sys.exit("the CUDA MoE kernels are not available here (sm_90+ and nvcc needed)")
    os.environ.pop("VIBEQWEN_MOE_MLP_EARLY_SCALES", None)
    copy = copy_bandwidth_tbs("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"copy rate {copy:.2f} TB/s, {sms} SMs", flush=True)
    weights = random_experts(dev)
    if args.distinct:
        distinct_sweep([int(v) for v in args.distinct.split(",")], weights, copy, sms)
    if args.ts:
        routed_sweep([int(v) for v in args.ts.split(",")], weights)


if __name__ == "__main__":
    main()
