"""The decode MoE block on the H200: the one-launch kernel (``csrc/moe_decode.cu``) against the four launches it
replaces (``fused_route`` + ``fused_moe``'s gate|up, down and slot sum).

Model shapes (256 routed NVFP4 experts + the shared one, H 2048, I 512, top-8), random weights, T tokens (1, 2, 4,
8). Timed as replays of one CUDA graph of 8 calls, each with its own router and input (so each call routes to its
own experts and reads them from HBM: 8 x 9+ experts is more than the 50 MB L2), captured with early launch as the
decode graphs are; us per call. Each row also gives the bytes a call must read (the router, and the codes and bf16
scales of the distinct experts its tokens chose, the shared one included) over the copy bandwidth measured here (a 2
GiB copy, bench_nvfp4.copy_bandwidth), and compares the two paths' outputs (the routing must be equal bit for bit;
the outputs differ by bf16 roundings of fp32 sums taken in another order: relative L2 difference and the share of
equal values). Then the kernel's phases at T = 1 and 8 (CTA 0's timestamps of one eager launch after a warm-up, and
the spread of the CTAs' end times).

    python bench/kernels/bench_moe_fused_decode.py [--ts 1,2,4,8]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import time_graph
from bench_nvfp4 import copy_bandwidth

COPIES = 8
#: (timestamp index, what ends there), in kernel order (csrc/moe_decode.cu's stamps)
PHASES = ((1, "pdl wait"), (2, "phase 0 (router, shared gate|up)"), (3, "barrier 1"), (8, "routing"),
          (9, "lists"), (10, "stream listed"), (4, "stream started"), (5, "routed gate|up"), (6, "barrier 2"),
          (7, "down + slot sum"))
#: the one-token routing's clock stamps (debug[16 + i], csrc/moe_decode.cu and bf16_route.cuh route_tokens)
ROUTE_STEPS = ((18, "logits loaded"), (19, "sorted"), (20, "top-k rounds"), (21, "softmax sums"),
               (22, "weights stored + listed"), (23, "CTA barrier"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,2,4,8")
    args = ap.parse_args()
    from vibeqwen_kernels.moe import decode_cuda as D
    from vibeqwen_kernels.moe import fused as F
    from vibeqwen_kernels.moe import route_cuda as R
    from vibeqwen_kernels.pdl import early_launch

    from vibeqwen.checkpoint.quant import nvfp4_quantize

    dev = torch.device("cuda")
    if D.decode_library(dev) is None:
        sys.exit("csrc/moe_decode.cu does not build here (sm_90+ and nvcc needed)")
    torch.manual_seed(0)
    trip = []
    for n, k in ((512, 2048), (512, 2048), (2048, 512)):
        p, sc, g = nvfp4_quantize(torch.randn(257, n, k, device=dev) / k**0.5)
        trip.append([(p[i], sc[i], g[i]) for i in range(257)])
    experts = F.prepack_moe_nvfp4(*trip, device=dev)
    del trip
    routes = [R.prepack_router((torch.randn(256, 2048, device=dev) * 0.05).to(torch.bfloat16),
                               (torch.randn(1, 2048, device=dev) * 0.05).to(torch.bfloat16)) for _ in range(COPIES)]
    ws = D.make_workspace(routes[0].tiles, 8, 512, dev)
    bw = copy_bandwidth() / 1e12
    # bytes of one expert in the kernels' copy: gate|up codes + bf16 scales, down codes + bf16 scales
    per_expert = sum(m.codes[0].numel() + 2 * m.scales[0].numel() for m in (experts.w13_mma, experts.w2_mma))
    router_bytes = routes[0].packed.numel() * 2
    print(f"{torch.cuda.get_device_name(dev)}: copy {bw:.2f} TB/s, {per_expert / 1e6:.2f} MB per expert, grid "
          f"{D._grid(dev, 1, 8)} CTAs", flush=True)

    def chain(x, route):
        cfg = F.pick_moe_config(x.shape[0], 9, 257, hidden=2048, intermediate=512)
        tw, ti, s, b, _ = R.fused_route(x, route, 8, cfg["BLOCK_M"])
        return F.fused_moe(x, tw, ti, experts, cfg, align=(s, b, cfg["BLOCK_M"]))

    rows = []
    for t in (int(v) for v in args.ts.split(",")):
        xs = [torch.randn(t, 2048, device=dev).to(torch.bfloat16) for _ in range(COPIES)]
        routing_same, rel, frac, distinct = True, 0.0, 1.0, []
        for x, r in zip(xs, routes):
            tw, ti = torch.empty(t, 9, device=dev), torch.empty(t, 9, device=dev, dtype=torch.int32)
            got = D.moe_decode(x, r, experts, 8, ws, topk=(tw, ti))
            want = chain(x, r)
            ref_w, ref_i = R.fused_route(x, r, 8, 16)[:2]
            routing_same &= torch.equal(tw, ref_w) and torch.equal(ti, ref_i)
            rel = max(rel, ((got.float() - want.float()).norm() / want.float().norm()).item())
            frac = min(frac, (got == want).float().mean().item())
            distinct.append(int(ti.unique().numel()))
        with early_launch():
            old = time_graph([functools.partial(chain, x, r) for x, r in zip(xs, routes)], reps=30) * 1e6
            new = time_graph([functools.partial(D.moe_decode, x, r, experts, 8, ws) for x, r in zip(xs, routes)],
                             reps=30) * 1e6
        nbytes = router_bytes + statistics.mean(distinct) * per_expert
        floor = nbytes / (bw * 1e12) * 1e6
        rows.append((t, old, new, floor, routing_same, rel, frac))
        print(f"T={t}: 4 launches {old:.2f} us, one launch {new:.2f} us ({old / new:.2f}x); "
              f"{nbytes / 1e6:.1f} MB -> floor {floor:.2f} us ({new / floor:.2f}x); routing equal {routing_same}, "
              f"output rel. L2 difference {rel:.2e}, {100 * frac:.2f}% of values equal", flush=True)

    for t in (1, 8):
        x = torch.randn(t, 2048, device=dev).to(torch.bfloat16)
        grid = D._grid(dev, t, 8, D.ring_slots(t))
        dbg = torch.zeros(D.DEBUG_HEAD + grid, dtype=torch.int64, device=dev)
        for _ in range(3):
            D.moe_decode(x, routes[1], experts, 8, ws, debug=dbg)
        torch.cuda.synchronize()
        d = dbg.cpu().tolist()
        prev, steps = 0, []
        for i, name in PHASES:
            steps.append(f"{name} {(d[i] - d[prev]) / 1e3:.2f}")
            prev = i
        ends = [(v - d[0]) / 1e3 for v in d[D.DEBUG_HEAD:D.DEBUG_HEAD + grid]]
        print(f"T={t} phases (CTA 0, us): " + ", ".join(steps)
              + f"; CTA ends {min(ends):.2f}-{max(ends):.2f} us after CTA 0's start", flush=True)
        if t == 1 and d[17] and d[23]:  # the one-token routing warp's clocks (debug[16 + i])
            prev, steps = 17, []
            for i, name in ROUTE_STEPS:
                steps.append(f"{name} {d[i] - d[prev]}")
                prev = i
            print(f"T={t} routing (CTA 0's routing warp, SM clocks): " + ", ".join(steps)
                  + f"; total {d[23] - d[17]}", flush=True)

    print("| T | four launches us | one launch us | speedup | bytes floor us | ratio | routing equal | rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for t, old, new, floor, same, rel, _frac in rows:
        print(f"| {t} | {old:.2f} | {new:.2f} | {old / new:.2f}x | {floor:.2f} | {new / floor:.2f}x | {same} | "
              f"{rel:.1e} |")


if __name__ == "__main__":
    main()
