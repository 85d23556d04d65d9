"""The decode step's expert MLP (``moe_mlp``, 2 slices of I) in each CTA shape and ring-step group, on the GPU.

A ``moe_mlp`` launch runs one CTA per (16-pair block, slice[, n8 half]); each CTA streams its slice of the expert's
gate|up and down weights through per-warp cp.async rings: a CTA per block (16 columns of x, 2 CTAs an SM) or per n8
half (8 columns, 3 an SM). A ring step covers 1, 2 or 4 row tiles (``VIBEQWEN_MOE_MLP_GROUP``, ``--groups``); with
``--prefetch 0,1`` each shape runs without and with its next ring step prefetched into L2 (``VIBEQWEN_MOE_MLP_PREFETCH``
0 / 1; built for the rule's group of each CTA shape only: the other groups run without; the engine's default
prefetches for the 16-column CTA only). The default, ``--prefetch 0``, runs every shape without.

Two measurements, model shapes (E' = 257 experts, k' = 9 slots, H = 2048, I = 512), random NVFP4 experts (the
e4m3 block-scale copy streamed, as the engine does):

* ``--distinct N,...``: 32 tokens routed round-robin over N distinct experts (a fresh random set a call),
  ``moe_mlp`` alone, us a call and the rate of its bytes against the copy rate, for each shape.
* ``--ts T,...``: ``fused_router`` routings of T tokens; ``fused_moe`` (align, ``moe_mlp``, slot sum) us a call for
  each shape, and whether every shape's output equals the first's bit for bit (the same sums, whatever the shape).

All timed as replays of one CUDA graph of 8 calls with distinct routings and inputs. (The forty-fourth session's
versions of this script, at f08dc4d and 730e2a6, also ran 4 and 8 slices of I and a CTA per quarter block with
12-slot rings: slower on an H100.)

    python bench/kernels/bench_moe_mlp_shapes.py [--distinct 64,128,165,194,256] [--ts 16,24,32,48,64] [--groups 1,2,4]
        [--prefetch 0,1]

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
#: CTA shapes (VIBEQWEN_MOE_MLP_CTA); each runs with every ring-step group of --groups (VIBEQWEN_MOE_MLP_GROUP)
CTA_SHAPES = ("16", "8")


def _slots(cols: str, sms: int) -> int:
    """CTA slots of the GPU for a moe_mlp CTA shape: 3 an SM with 8 columns, 2 with 16 (shared memory)."""
    return sms * (2 if cols == "16" else 3)


def distinct_sweep(ns: list[int], weights, copy: float, sms: int, shapes: list[tuple[str, str, str]]) -> None:
    """moe_mlp alone at 32 tokens routed over N distinct experts, per (CTA shape, ring-step group, prefetch) of
    `shapes`."""
    from vibeqwen_kernels.moe import fused as F
    from vibeqwen_kernels.moe import mma_cuda as M

    dev = torch.device("cuda")
    t, kp, n_exp = 32, TOP_K + 1, E + 1
    n_pairs = t * kp
    w13, w2 = weights.w13_mma, weights.w2_mma
    chunk = 512 + (64 if w13.scales_e4m3 is not None else 128)  # bytes a 64-k chunk of 16 rows streams
    expert_mb = (w13.n // 16 * w13.k // 64 + w2.n // 16 * w2.k // 64) * chunk / 1e6
    xs = [torch.randn(t, H, device=dev).to(torch.bfloat16) for _ in range(REPS)]
    print("| N experts | blocks | CTA | group | prefetch | CTAs with pairs | CTAs an SM | us | TB/s | % of copy |\n"
          "|---|---|---|---|---|---|---|---|---|---|", flush=True)
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
        for cols, group, pf in shapes:
            first = aligned[0][0].view(-1, 16)[: aligned[0][1].numel()]
            real = aligned[0][1] >= 0
            per = 16 // int(cols)  # CTAs a block at most
            ctas = 2 * sum(int((real & (first[:, q * int(cols)] < n_pairs)).sum()) for q in range(per))
            # one wave when the CTAs fit the slots (the busiest SM runs ceil(CTAs / SMs) of them), else the
            # scheduler refills slots as CTAs end
            waves = ctas / _slots(cols, sms)
            load = f"{math.ceil(ctas / sms)} (1 wave)" if waves <= 1 else f"{ctas / sms:.1f} ({waves:.2f} waves)"
            outs = [torch.empty(2, n_pairs, H, device=dev) for _ in range(REPS)]
            with _env({"VIBEQWEN_MOE_MLP_CTA": cols, "VIBEQWEN_MOE_MLP_GROUP": group, "VIBEQWEN_MOE_MLP_PREFETCH": pf}):
                calls = [functools.partial(M.moe_mlp, x, kp, w13, weights.w13_gscale, w2, weights.w2_gscale,
                                           a[0], a[1], n_pairs, 2, o) for x, a, o in zip(xs, aligned, outs)]
                us = time_graph(calls, reps=20) * 1e6
            print(f"| {n} | {blocks} | {cols} | {group} | {pf} | {ctas} | {load} | {us:.1f} | "
                  f"{mb / us:.2f} | {100 * mb / us / copy:.0f}% |", flush=True)


def routed_sweep(ts: list[int], weights, shapes: list[tuple[str, str, str]]) -> None:
    """fused_moe (align, moe_mlp, slot sum) per (CTA shape, ring-step group, prefetch) of `shapes` at T tokens of
    fused_router routings."""
    from vibeqwen_kernels.moe import fused as F
    from vibeqwen_kernels.moe import mma_cuda as M

    dev = torch.device("cuda")
    kp, n_exp = TOP_K + 1, E + 1
    names = [f"CTA {c} group {g}" + (" prefetch" if p == "1" else "") for c, g, p in shapes]
    print("| T | CTA rule | " + " | ".join(names)
          + " | equal bits |\n|---|---|" + "---|" * len(shapes) + "---|", flush=True)
    for t in ts:
        n_pairs = t * kp
        xs = [torch.randn(t, H, device=dev).to(torch.bfloat16) for _ in range(REPS)]
        routes = [F.fused_router(torch.randn(t, n_exp, device=dev).to(torch.bfloat16), TOP_K) for _ in range(REPS)]
        outs = [torch.empty(t, H, device=dev, dtype=torch.bfloat16) for _ in range(REPS)]
        cfg = dict(F.pick_moe_config(t, kp, n_exp), BLOCK_M=16, MMA=1, GEMV=0, SPLIT_GU=0)
        times, ys = [], []
        for cols, group, pf in shapes:
            env = {"VIBEQWEN_MOE_MLP": "1", "VIBEQWEN_MOE_MLP_MIN_PAIRS": "1", "VIBEQWEN_MOE_MLP_CTA": cols,
                   "VIBEQWEN_MOE_MLP_GROUP": group, "VIBEQWEN_MOE_MLP_PREFETCH": pf}
            with _env(env):
                calls = [functools.partial(F.fused_moe, x, tw, ti, weights, cfg, out=o)
                         for x, (tw, ti), o in zip(xs, routes, outs)]
                times.append(time_graph(calls, reps=20) * 1e6)
                ys.append(F.fused_moe(xs[0], *routes[0], weights, cfg))
        same = all(torch.equal(y, ys[0]) for y in ys[1:])
        print(f"| {t} | {M.mlp_cta(n_pairs)} | " + " | ".join(f"{v:.1f}" for v in times)
              + f" | {'yes' if same else 'NO'} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--distinct", default="64,128,165,194,256",
                    help="distinct routed experts of the 32-token sweep (empty: skip it)")
    ap.add_argument("--ts", default="16,24,32,48,64", help="tokens of the routed sweep (empty: skip it)")
    ap.add_argument("--groups", default="1", help="ring-step groups to run for each CTA shape (1, 2, 4)")
    ap.add_argument("--prefetch", default="0",
                    help="L2 prefetch settings to run for each shape and group (0, 1: VIBEQWEN_MOE_MLP_PREFETCH)")
    args = ap.parse_args()
    from vibeqwen_kernels.moe import mma_cuda as M

    if not set(args.prefetch.split(",")) <= {"0", "1"}:
        ap.error(f"--prefetch takes 0 and / or 1, got {args.prefetch!r}")
    # the prefetch is built for each CTA shape's rule group only (mma_cuda.mlp_prefetch): elsewhere it would time the
    # plain kernel under a "prefetch" label, so those combinations are left out
    shapes = [(c, g, p) for c in CTA_SHAPES for g in args.groups.split(",") for p in args.prefetch.split(",")
              if p == "0" or int(g) == M.MLP_RULE_GROUP[c]]

    dev = torch.device("cuda")
    if M.mma_library(dev) is None:
        sys.exit("the CUDA MoE kernels are not available here (sm_90+ and nvcc needed)")
    os.environ.pop("VIBEQWEN_MOE_MLP_EARLY_SCALES", None)
    os.environ.pop("VIBEQWEN_MOE_MLP_E4M3", None)
    copy = copy_bandwidth_tbs("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"copy rate {copy:.2f} TB/s, {sms} SMs", flush=True)
    weights = random_experts(dev)
    if args.distinct:
        distinct_sweep([int(v) for v in args.distinct.split(",")], weights, copy, sms, shapes)
    if args.ts:
        routed_sweep([int(v) for v in args.ts.split(",")], weights, shapes)


if __name__ == "__main__":
    main()
