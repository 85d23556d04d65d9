"""Fused NVFP4 MoE on the GPU: correctness against the fp32 reference, time, bytes/s against HBM.

Model shapes: E = 256 routed experts + 1 shared (E' = 257), top-8 (+ shared = 9 slots), H = 2048,
I = 512, random weights quantized with `nvfp4_quantize` on the GPU. For T in 1, 8, 32, 64, 1024, 8192:

* check: `fused_moe` on `fused_router`'s routing against `moe_experts_ref` on the dequantized (fp32)
  experts, shared expert included as expert E (relative Frobenius error; the test bound is 5e-3;
  the router itself is checked in tests/kernels/test_fused_moe.py);
* time: replays of one CUDA graph holding R calls of `fused_moe` (moe_align + 2 grouped GEMMs + slot
  sum), each call with its own routing (different experts, so decode weights come from HBM rather
  than L2); the router kernel is timed the same way, separately;
* bytes = distinct experts the call hits x bytes per expert (codes + e4m3 scales + fp32 global scales: the
  checkpoint's bytes, the floor; the CUDA kernels' shuffled copy holds bf16 scales, 11% more)
  + x read + output written (the h / per-pair intermediates are not counted); GB/s and the fraction
  of 4.3 TB/s (an H200's achievable copy bandwidth); TFLOP/s = 2 * T * 9 * 3 * H * I / time.

With --tune it first tries a few block configs per T and writes the fastest correct one to
--configs-out (default configs/moe_nvfp4_h200.json, read by `pick_moe_config`; entries carry SPLIT_K1 /
SPLIT_K2, the split-K factors, which decode candidates vary). Runs in ~3-5 minutes with --tune.

With --tune it also prints, per T, the fastest correct Triton and CUDA (MMA = 1) candidates side by side (us,
TFLOP/s, GB/s of the distinct-expert bytes); `--tune --pool mma --ts 128,256,512,1024,2048` times only the
CUDA kernels' configs (decode kernel up to T = 64, fused.MMA_MAX_T: beyond it the runtime would run such an
entry's Triton fallback; the 32/64-pair prefill kernel from T = 64) against the
current entry (and its Triton fallback).

    python bench/kernels/bench_moe.py [--tune] [--pool all|mma] [--ts 1,8,32] [--json PATH] [--configs-out PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

E, TOP_K, H, I = 256, 8, 2048, 512
TS = [1, 8, 32, 64, 1024, 8192]
HBM_BW = 4.3e12
REL_OK = 5e-3

# Candidate pools (shared across T so compiled kernels are reused): BLOCK_M, (N1, K1, warps1, stages1),
# (N2, K2, warps2, stages2)[, (SPLIT_K1, SPLIT_K2)] (no split when left out).
_DECODE = [
    (16, (32, 256, 4, 1), (64, 256, 4, 1)),
    (16, (64, 256, 4, 1), (64, 128, 4, 1)),
    (16, (32, 128, 4, 1), (32, 256, 4, 1)),
    (16, (64, 128, 8, 1), (128, 128, 8, 1)),
    (16, (32, 256, 4, 3), (64, 128, 4, 3)),
    (16, (16, 256, 4, 3), (32, 256, 4, 3)),
    (16, (64, 128, 4, 3), (128, 128, 4, 3)),
    (16, (32, 512, 4, 2), (64, 256, 4, 2)),
    (16, (64, 256, 4, 2), (128, 64, 4, 3)),
]
# Split-K for decode (T <= 64): GEMM1 K = 2048 in 2/4/8 splits of BLOCK_K1 128 or 256 (>= 256 per split),
# GEMM2 K = 512 in 1/2/4 splits; the tuned decode block sizes (BLOCK_N1 64, 4 warps), fewer stages since a
# split walks only 1-8 K blocks; plus a few narrower-N1 variants.
_DECODE_SPLIT = [
    (16, (64, k1, 4, 2), (64, 128, 4, 2), (s1, s2))
    for s1 in (2, 4, 8)
    for k1 in (128, 256)
    for s2 in (1, 2, 4)
] + [
    # GEMM1 variants without register spills (ptxas, sm_90): 8 warps, BLOCK_K1 64, or BLOCK_N1 32
    (16, (64, 128, 8, 2), (64, 128, 4, 2), (8, 2)),
    (16, (64, 128, 8, 2), (64, 128, 4, 2), (4, 2)),
    (16, (64, 64, 4, 2), (64, 128, 4, 2), (8, 2)),
    (16, (32, 128, 4, 2), (64, 128, 4, 2), (8, 2)),
    (16, (32, 128, 4, 2), (64, 128, 4, 2), (4, 1)),
    (16, (32, 256, 4, 2), (64, 128, 4, 2), (4, 2)),
    (16, (64, 128, 4, 1), (64, 256, 4, 1), (8, 2)),
]
# CUDA-core decode (GEMV = 1): one program per (token, expert) pair, no alignment. GEMM1 K = 2048, GEMM2
# K = 512; BLOCK_M is unused.
_GEMV = [
    (16, (n1, k1, w1, 1), (n2, k2, w2, 1), (s1, s2), 1)
    for (n1, k1, w1, s1), (n2, k2, w2, s2) in [
        ((16, 256, 4, 1), (16, 256, 4, 1)),
        ((8, 256, 2, 1), (8, 512, 4, 1)),
        ((16, 512, 4, 1), (16, 512, 4, 1)),
        ((32, 256, 4, 1), (32, 256, 4, 1)),
        ((16, 256, 4, 2), (16, 256, 4, 2)),
        ((16, 256, 4, 4), (32, 256, 4, 2)),
        ((32, 256, 4, 4), (16, 256, 4, 2)),
        ((8, 512, 4, 2), (8, 512, 4, 1)),
        ((32, 512, 8, 2), (32, 512, 8, 1)),
        ((64, 256, 4, 8), (64, 256, 4, 2)),
    ]
] + [
    # software-pipelined K loops (num_stages 2-3: the next K block's loads in flight during this block's math)
    (16, (n1, k1, 4, st), (n2, k2, 4, st), (s1, s2), 1)
    for st in (2, 3)
    for (n1, k1, s1), (n2, k2, s2) in [((16, 256, 2), (16, 256, 2)), ((16, 256, 1), (16, 256, 1)),
                                       ((16, 128, 2), (32, 128, 1))]
]
# Tensor-core GEMM1 with gate and up rows in separate programs (SPLIT_GU = 1: one accumulator each, no
# register spills; the SiLU-mul kernel finishes): (..., (SPLIT_K1, SPLIT_K2), GEMV 0, SPLIT_GU 1).
_GU = [
    (16, (128, 128, 8, 2), (64, 128, 4, 2), (1, 1), 0, 1),
    (16, (64, 128, 4, 3), (64, 128, 4, 3), (1, 1), 0, 1),
    (32, (128, 128, 8, 3), (128, 64, 4, 3), (1, 1), 0, 1),
    (32, (64, 128, 4, 3), (128, 64, 4, 3), (2, 1), 0, 1),
    (64, (128, 64, 8, 3), (128, 64, 8, 3), (1, 1), 0, 1),
    (128, (128, 64, 8, 3), (128, 64, 8, 3), (1, 1), 0, 1),
    (128, (256, 64, 8, 3), (128, 64, 8, 3), (1, 1), 0, 1),
]
# The CUDA decode kernel (MMA = 1, csrc/moe_mma.cu): only SPLIT_K1 / SPLIT_K2 matter (BLOCK_M is 16). From
# mma_cuda.MLP_MIN_PAIRS pairs fused_moe runs these configs as one moe_mlp launch whatever the splits: the tuner sets
# VIBEQWEN_MOE_MLP=0 (in main) so that the splits it compares are the ones that run without it.
_MMA = [
    (16, (64, 128, 4, 1), (64, 128, 4, 1), (s1, s2), 0, 0, 1)
    for s1, s2 in [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2)]
]
# The CUDA prefill kernel (MMA = 1, BLOCK_M 32 or 64): BLOCK_M and the splits matter (a split adds fp32
# partials, [split, T*k', N] written and read back, but more CTAs where few blocks are full).
_MMA_LARGE = [
    (bm, (64, 128, 4, 1), (64, 128, 4, 1), (s1, s2), 0, 0, 1)
    for bm in (32, 64)
    for s1, s2 in [(1, 1), (2, 1), (2, 2), (4, 1)]
]
#: from this T on, the tuner also tries the CUDA prefill kernel's configs
MMA_LARGE_MIN_T = 64
_MID = [
    (32, (64, 128, 4, 1), (128, 128, 4, 1)),
    (16, (64, 256, 4, 1), (64, 256, 4, 1)),
    (32, (64, 128, 4, 3), (128, 64, 4, 3)),
    (32, (32, 256, 4, 3), (64, 128, 4, 3)),
]
_PREFILL = [
    (64, (64, 128, 4, 1), (128, 128, 8, 1)),
    (128, (64, 128, 8, 1), (128, 128, 8, 1)),
    (128, (128, 64, 8, 1), (128, 64, 8, 1)),
    (64, (64, 64, 4, 3), (128, 64, 8, 3)),
    (128, (64, 64, 8, 3), (128, 64, 8, 3)),
    (64, (128, 64, 8, 3), (128, 64, 8, 3)),
    (128, (128, 64, 8, 3), (256, 64, 8, 3)),
]


def _cfg(c) -> dict[str, int]:
    bm, (n1, k1, w1, s1), (n2, k2, w2, s2), *rest = c
    sk1, sk2 = rest[0] if rest else (1, 1)
    gemv = rest[1] if len(rest) > 1 else 0
    split_gu = rest[2] if len(rest) > 2 else 0
    mma = rest[3] if len(rest) > 3 else 0
    keys = (
        "BLOCK_M",
        "BLOCK_N1",
        "BLOCK_K1",
        "WARPS1",
        "STAGES1",
        "BLOCK_N2",
        "BLOCK_K2",
        "WARPS2",
        "STAGES2",
        "SPLIT_K1",
        "SPLIT_K2",
        "GEMV",
        "SPLIT_GU",
        "MMA",
    )
    return dict(zip(keys, (bm, n1, k1, w1, s1, n2, k2, w2, s2, sk1, sk2, gemv, split_gu, mma)))


def candidates(t: int, pool: str = "all") -> list[dict[str, int]]:
    from vibeqwen_kernels.moe.fused import MMA_MAX_T  # beyond it pick_moe_config runs a 16-pair entry's fallback

    large = _MMA_LARGE if t >= MMA_LARGE_MIN_T else []
    decode_mma = _MMA if t <= MMA_MAX_T else []
    if pool == "mma":
        return [_cfg(c) for c in decode_mma + large]
    if t <= 64:
        pool = _GEMV + _DECODE + _DECODE_SPLIT + (_MID + _GU[:4] if t >= 32 else []) + decode_mma + large
    elif t <= 512:
        pool = _DECODE[:2] + _MID + _PREFILL[:1] + _GU[2:5] + large
    else:
        pool = _MID[:1] + _PREFILL + _GU[4:] + large
    return [_cfg(c) for c in pool]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def time_graph(calls, reps: int = 10) -> float:
    """Median seconds per call over replays of one CUDA graph that runs `calls` (closures) in order."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / len(calls))
    del g
    return statistics.median(times)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(y).all()):
        return float("inf")
    return ((y.float() - ref).norm() / ref.norm()).item()


def run_config(F, weights, xs, routes, outs, ref, cfg) -> tuple[float, float]:
    """(seconds per fused_moe call over the graph of len(xs) calls, relative error of one poisoned call)."""
    outs[0].fill_(float("nan"))
    F.fused_moe(xs[0], *routes[0], weights, cfg, out=outs[0])
    err = rel_err(outs[0], ref)
    calls = [
        functools.partial(F.fused_moe, x, tw, ti, weights, cfg, out=o)
        for x, (tw, ti), o in zip(xs, routes, outs)
    ]
    return time_graph(calls), err


def _summary(best, nbytes: float, flops: float) -> dict | None:
    """us / TFLOP/s / GB/s of a (seconds, config) tuning result, or None."""
    if best is None:
        return None
    sec, c = best
    return {"us": round(sec * 1e6, 1), "TFLOP/s": round(flops / sec / 1e12, 1), "GB/s": round(nbytes / sec / 1e9),
            "blocks": f"{c['BLOCK_M']}, {c.get('SPLIT_K1', 1)}/{c.get('SPLIT_K2', 1)}", "config": c}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true", help="try block configs per T first")
    ap.add_argument("--pool", choices=("all", "mma"), default="all",
                    help="with --tune: all candidates, or only the CUDA kernel's (against the current entry)")
    ap.add_argument("--ts", default=",".join(map(str, TS)))
    ap.add_argument("--json", default="bench/results/moe_h200.json")
    ap.add_argument("--configs-out", default="configs/moe_nvfp4_h200.json")
    args = ap.parse_args()
    os.environ["VIBEQWEN_MOE_MLP"] = "0"  # the split configs as they run without the one-launch MLP (see _MMA)
    ts = [int(v) for v in args.ts.split(",")]

    import triton
    from vibeqwen_kernels.moe import fused as F
    from vibeqwen_kernels.moe.naive import moe_experts_ref

    from vibeqwen.checkpoint.quant import nvfp4_dequantize, nvfp4_quantize

    t_start = time.time()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    n_exp = E + 1

    # random experts, quantized on the GPU (one global scale per matrix), and their fp32 dequantization
    trip, dense = [], []
    for n, k in ((I, H), (I, H), (H, I)):
        w = torch.randn(n_exp, n, k, device=dev) / k**0.5
        p, s, g = nvfp4_quantize(w)
        trip.append([(p[e], s[e], g[e]) for e in range(n_exp)])
        dense.append(nvfp4_dequantize(p, s, g, dtype=torch.float32))
        del w
    weights = F.prepack_moe_nvfp4(*trip, device=dev)
    del trip
    wg, wu, wd = dense
    per_expert = weights.expert_nbytes
    mma_ok = F._mma_runnable(weights, dev, {"BLOCK_M": 16})
    log(f"{props.name}: {n_exp} experts x {per_expert / 1e6:.3f} MB, setup {time.time() - t_start:.1f} s, CUDA MMA "
        f"kernel {'available' if mma_ok else 'NOT available (MMA configs fall back)'}")

    def reference(x, tw, ti):
        """fp32: sum_s tw[t, s] * expert_{ti[t, s]}(x[t]) on the dequantized experts (shared = E)."""
        return moe_experts_ref(x.float(), tw, ti.long(), wg, wu, wd)

    result = {
        "gpu": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "rows": [],
        "timing": "CUDA-graph replays of R fused_moe calls with distinct routings; router separately",
        "compare": [],  # with --tune: the fastest correct Triton and CUDA (MMA = 1) candidate per T
    }
    tuned = {"gpu": props.name, "note": "bench/kernels/bench_moe.py --tune; keys: T", "configs": {}}
    for t in ts:
        reps = 8 if t <= 64 else (4 if t <= 1024 else 2)  # calls per graph
        xs = [torch.randn(t, H, device=dev).to(torch.bfloat16) for _ in range(reps)]
        logits = [torch.randn(t, n_exp, device=dev).to(torch.bfloat16) for _ in range(reps)]
        routes = [F.fused_router(lg, TOP_K) for lg in logits]
        outs = [torch.empty(t, H, device=dev, dtype=torch.bfloat16) for _ in range(reps)]
        ref = reference(xs[0], *routes[0])
        hit = statistics.mean(len(torch.unique(r[1])) for r in routes)  # distinct experts per call
        nbytes = hit * per_expert + 2 * t * H * 2
        flops = 2.0 * t * (TOP_K + 1) * 3 * H * I

        run = functools.partial(run_config, F, weights, xs, routes, outs, ref)
        cfg = F.pick_moe_config(t, TOP_K + 1, n_exp)
        if args.tune:
            best = best_plain = best_mma = None
            pool = candidates(t, args.pool) + [cfg]
            if cfg.get("MMA", 0) == 1:
                pool.append(F.pick_moe_config(t, TOP_K + 1, n_exp, allow_mma=False))
            for c in pool:
                if c.get("MMA", 0) == 1 and not F._mma_runnable(weights, dev, c):
                    log(f"  T={t} {c}: skipped (the CUDA kernel cannot run it here; it would time the fallback)")
                    continue
                try:
                    F._check_config(c, use_asm=True)
                    sec, err = run(c)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit: skip it
                    log(f"  T={t} {c}: failed ({type(exc).__name__}: {str(exc)[:120]})")
                    continue
                log(f"  T={t} {c}: {sec * 1e6:.1f} us, err {err:.1e}")
                if err <= REL_OK and (best is None or sec < best[0]):
                    best = (sec, c)
                if err <= REL_OK and c.get("MMA", 0) == 0 and (best_plain is None or sec < best_plain[0]):
                    best_plain = (sec, c)
                if err <= REL_OK and c.get("MMA", 0) == 1 and (best_mma is None or sec < best_mma[0]):
                    best_mma = (sec, c)
            result["compare"].append({
                "T": t, "experts_hit": round(hit, 1), "MB": round(nbytes / 1e6, 2), "GFLOP": round(flops / 1e9, 2),
                "triton": _summary(best_plain, nbytes, flops), "cuda": _summary(best_mma, nbytes, flops),
            })
            if best is not None:
                cfg = best[1]
                entry = dict(cfg)
                if cfg.get("MMA", 0) == 1 and best_plain is not None:
                    entry["fallback"] = best_plain[1]  # where the CUDA kernel cannot run
                tuned["configs"][str(t)] = entry
        if cfg.get("MMA", 0) == 1 and not F._mma_runnable(weights, dev, cfg):
            cfg = F.pick_moe_config(t, TOP_K + 1, n_exp, allow_mma=False)  # what fused_moe runs instead
        sec, err = run(cfg)
        router_sec = time_graph([functools.partial(F.fused_router, lg, TOP_K) for lg in logits])
        row = {
            "T": t,
            "us": round(sec * 1e6, 2),
            "router_us": round(router_sec * 1e6, 2),
            "experts_hit": round(hit, 1),
            "MB": round(nbytes / 1e6, 2),
            "GB/s": round(nbytes / sec / 1e9, 1),
            "frac_4.3TB/s": round(nbytes / sec / HBM_BW, 3),
            "TFLOP/s": round(flops / sec / 1e12, 2),
            "rel_err": float(f"{err:.2e}"),
            "ok": err <= REL_OK,
            "config": cfg,
        }
        result["rows"].append(row)
        log(f"T={t}: {row}  [{time.time() - t_start:.0f} s]")

    if args.tune and tuned["configs"]:
        # keep the entries of T values not tuned in this run
        try:
            with open(args.configs_out) as f:
                tuned["configs"] = {**json.load(f).get("configs", {}), **tuned["configs"]}
        except (OSError, ValueError):
            pass
        tuned["configs"] = dict(sorted(tuned["configs"].items(), key=lambda kv: int(kv[0])))
        os.makedirs(os.path.dirname(os.path.abspath(args.configs_out)), exist_ok=True)
        with open(args.configs_out, "w") as f:
            json.dump(tuned, f, indent=1)
        log(f"wrote {args.configs_out}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)

    print(f"\n{props.name}, E'={n_exp}, k'={TOP_K + 1}, H={H}, I={I}, {per_expert / 1e6:.3f} MB/expert\n")
    print("| T | us | router us | experts hit | MB | GB/s | of 4.3 TB/s | TFLOP/s | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(
            f"| {r['T']} | {r['us']} | {r['router_us']} | {r['experts_hit']} | {r['MB']} | {r['GB/s']} | "
            f"{r['frac_4.3TB/s']:.2f} | {r['TFLOP/s']} | {r['rel_err']:.1e}{'' if r['ok'] else ' FAIL'} |"
        )
    if result["compare"]:
        print("\nFastest correct candidate per kernel family (with --pool mma: the current Triton entry vs the CUDA "
              "configs); bytes = distinct experts hit + x + out\n")
        print("| T | experts hit | MB | GFLOP | Triton us | TFLOP/s | GB/s | CUDA us | TFLOP/s | GB/s | CUDA BLOCK_M, "
              "splits | Triton / CUDA |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in result["compare"]:
            tr, cu = r["triton"] or {}, r["cuda"] or {}
            ratio = f"{tr['us'] / cu['us']:.2f}x" if tr and cu else "-"
            print(f"| {r['T']} | {r['experts_hit']} | {r['MB']} | {r['GFLOP']} | {tr.get('us', '-')} | "
                  f"{tr.get('TFLOP/s', '-')} | {tr.get('GB/s', '-')} | {cu.get('us', '-')} | {cu.get('TFLOP/s', '-')} | "
                  f"{cu.get('GB/s', '-')} | {cu.get('blocks', '-')} | {ratio} |")
    log(f"total {time.time() - t_start:.0f} s")
    if not all(r["ok"] for r in result["rows"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
