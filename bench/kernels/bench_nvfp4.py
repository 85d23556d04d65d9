"""NVFP4 W4A16 linear on the GPU: bytes/s against a measured copy, TFLOP/s for prefill, vs baselines.

For the model's NVFP4 shapes (expert gate/up [512, 2048], expert down [2048, 512], lm_head
[248320, 2048]) and M in 1, 8, 32, 64, 1024:

* ours: `nvfp4_linear`'s kernel, timed as replays of a CUDA graph that calls it over several copies of
  the weight (together > 4x the 60 MB L2, so each call reads its weight from HBM, as in a real step);
* naive: `nvfp4_dequantize` to bf16, then `x @ w.T` (eager, one weight, so the small ones sit in L2);
* bf16: `x @ w.T` with a pre-dequantized bf16 weight (cuBLAS; graph replays over weight copies).

Bytes = packed codes + e4m3 scales + x + y (each once); GB/s and the ratio to the copy bandwidth
(a 2 GiB device-to-device copy, bytes read + written) are for ours. Every timed config is also checked
against `nvfp4_linear_ref`. With --tune it first tries a few block configs per (shape, M) and writes
the best to --configs-out (then used for the table). Prints a markdown table last.

    python bench/kernels/bench_nvfp4.py [--tune] [--json PATH] [--configs-out PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

import torch

SHAPES = {"gate_up": (512, 2048), "down": (2048, 512), "lm_head": (248320, 2048)}
MS = [1, 8, 32, 64, 1024]
ROTATE_BYTES = 256 << 20  # weight copies per graph: > 4x L2

DECODE_CANDIDATES = [  # BLOCK_N, BLOCK_K, num_warps, num_stages, PREFETCH (BLOCK_M = pow2 >= M; SPLIT_K: auto_split)
    (32, 256, 4, 3, 0),
    (64, 128, 4, 3, 0),
    (64, 256, 4, 1, 0),
    (64, 512, 4, 1, 0),
    (128, 128, 4, 1, 0),
    (64, 128, 4, 1, 1),
    (64, 256, 4, 1, 1),
    (128, 128, 4, 1, 1),
    (32, 256, 4, 1, 1),
    (16, 256, 4, 1, 1),
]
GEMV_CANDIDATES = [  # CUDA-core kernel (FMA=1), M <= 8: BLOCK_N, BLOCK_K, num_warps, num_stages, PREFETCH
    (32, 256, 4, 1, 0),
    (16, 256, 2, 1, 0),
    (32, 512, 4, 1, 0),
    (32, 256, 4, 1, 1),
    (16, 256, 2, 1, 1),
    (64, 256, 4, 1, 1),
    (32, 128, 4, 1, 1),
    (16, 512, 2, 1, 1),
    (64, 128, 8, 1, 1),
    (32, 256, 4, 3, 0),
]
PREFILL_CANDIDATES = {  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, PREFETCH
    32: [
        (32, 64, 256, 4, 3, 0),
        (32, 128, 64, 8, 3, 0),
        (32, 64, 256, 4, 1, 1),
        (32, 64, 128, 4, 1, 1),
        (32, 128, 128, 4, 1, 1),
    ],
    64: [
        (64, 128, 64, 8, 3, 0),
        (64, 64, 128, 4, 3, 0),
        (64, 64, 128, 4, 1, 1),
        (64, 64, 256, 4, 1, 1),
        (64, 128, 128, 8, 1, 1),
    ],
    1024: [
        (256, 128, 64, 8, 3, 0),
        (256, 128, 128, 8, 2, 0),
        (128, 128, 64, 8, 3, 0),
        (256, 128, 64, 8, 1, 1),
        (256, 64, 128, 4, 1, 1),
    ],
}


def auto_split(n: int, k: int, bn: int, bk: int) -> int:
    """Split K (powers of two, at least one BLOCK_K tile each) until there are ~2 programs per SM."""
    blocks, split = -(-n // bn), 1
    while blocks * split < 264 and split * 2 * bk <= k:
        split *= 2
    return split


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write)."""
    import triton

    n = 2 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = triton.testing.do_bench(functools.partial(dst.copy_, src), warmup=50, rep=300, return_mode="median")
    return 2 * n / (t * 1e-3)


def time_graph(calls, reps: int = 10) -> float:
    """Median seconds per call over replays of one CUDA graph that runs `calls` (list of closures) in order."""
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


def run_cfg(launch, x, weights, outs, ref, cfg: dict, decode: bool) -> tuple[float, float]:
    """(seconds per call over the rotating weight copies, relative error of one poisoned-output call)."""
    outs.fill_(float("nan"))
    launch(x, weights[0], outs, cfg, decode, True)
    err = rel_err(outs, ref)
    return time_graph([functools.partial(launch, x, w, outs, cfg, decode, True) for w in weights]), err


def naive_linear(dequantize, x, packed, bs, gs) -> torch.Tensor:
    """The baseline: dequantize the whole weight to bf16 with the reference code, then cuBLAS."""
    return x @ dequantize(packed, bs, gs, dtype=torch.bfloat16).T


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true", help="try block configs per (shape, M) first")
    ap.add_argument("--json", default="bench/results/nvfp4_h200.json")
    ap.add_argument("--configs-out", default=None, help="where --tune writes the chosen configs")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument(
        "--tune-gemv-only",
        action="store_true",
        help="with --tune: for M <= 8 try only the CUDA-core GEMV candidates plus the current config",
    )
    args = ap.parse_args()

    import triton
    from vibeqwen_kernels.nvfp4 import linear as L
    from vibeqwen_kernels.nvfp4 import nvfp4_linear, nvfp4_linear_ref, prepack_nvfp4

    from vibeqwen.checkpoint.quant import nvfp4_dequantize, nvfp4_quantize

    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    copy_bw = copy_bandwidth()
    log(f"{props.name}: copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    result = {
        "gpu": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bandwidth_tbs": round(copy_bw / 1e12, 3),
        "timing": "ours and bf16: CUDA-graph replays over weight copies (> 256 MB, HBM-resident); "
        "naive: triton.testing.do_bench median, eager, one weight",
        "rows": [],
        "tuning": [],
    }
    ms = [int(v) for v in args.ms.split(",")]
    tuned: dict = {"gpu": props.name, "decode": {}, "gemv": {}, "prefill": {}}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        if args.configs_out:
            with open(args.configs_out, "w") as f:
                json.dump(tuned, f, indent=1)

    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        packed, bs, gs = nvfp4_quantize(torch.randn(n, k, device=dev))
        wt = prepack_nvfp4(packed, bs, gs)
        copies = max(2, math.ceil(ROTATE_BYTES / wt.nbytes))
        weights = [wt] + [prepack_nvfp4(packed.clone(), bs.clone(), gs.clone()) for _ in range(copies - 1)]
        w_bf16 = nvfp4_dequantize(packed, bs, gs, dtype=torch.bfloat16)
        bf16_copies = max(2, math.ceil(ROTATE_BYTES / (w_bf16.numel() * 2)))
        w_bf16s = [w_bf16] + [w_bf16.clone() for _ in range(bf16_copies - 1)]
        log(f"{name} [{n}, {k}]: {wt.nbytes / 1e6:.2f} MB, {copies} copies")

        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = nvfp4_linear_ref(x, packed, bs, gs)
            kind = L.choose_kernel(m, n)
            decode = kind == "decode"
            outs = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            bench_cfg = functools.partial(run_cfg, L._launch, x, weights, outs, ref)

            if args.tune:
                if decode:
                    bm = max(16, 1 << (m - 1).bit_length())
                    cands = [
                        {
                            "BLOCK_M": bm,
                            "BLOCK_N": a,
                            "BLOCK_K": b,
                            "num_warps": c,
                            "num_stages": d,
                            "SPLIT_K": auto_split(n, k, a, b),
                            "PREFETCH": e,
                        }
                        for a, b, c, d, e in DECODE_CANDIDATES
                        if b <= max(64, k)
                    ]
                    if args.tune_gemv_only:
                        cands = [L.pick_config(kind, m, n, k, gemv=False)] if m <= L.GEMV_MAX_M else cands
                    if m <= L.GEMV_MAX_M:
                        cands += [
                            {
                                "BLOCK_M": m,
                                "BLOCK_N": a,
                                "BLOCK_K": b,
                                "num_warps": c,
                                "num_stages": d,
                                "SPLIT_K": auto_split(n, k, a, b),
                                "PREFETCH": e,
                                "FMA": 1,
                            }
                            for a, b, c, d, e in GEMV_CANDIDATES
                            if b <= k
                        ]
                else:
                    key = min(PREFILL_CANDIDATES, key=lambda mm: abs(math.log2(mm) - math.log2(m)))
                    cands = [
                        {
                            "BLOCK_M": a,
                            "BLOCK_N": b,
                            "BLOCK_K": c,
                            "num_warps": d,
                            "num_stages": e,
                            "PREFETCH": f,
                        }
                        for a, b, c, d, e, f in PREFILL_CANDIDATES[key]
                    ]
                best = None
                for cfg in cands:
                    t0 = time.time()
                    try:
                        t, err = bench_cfg(cfg, decode)
                    except Exception as e:  # noqa: BLE001  (out of shared memory, compile errors)
                        log(f"  {name} M={m} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}")
                        result["tuning"].append({"shape": name, "M": m, "cfg": cfg, "error": str(e)[:200]})
                        continue
                    ok = err < 4e-3
                    log(f"  {name} M={m} {cfg}: {t * 1e6:.1f} us err {err:.1e} ({time.time() - t0:.1f}s)")
                    result["tuning"].append(
                        {"shape": name, "M": m, "cfg": cfg, "t_us": t * 1e6, "rel_err": err}
                    )
                    if ok and (best is None or t < best[0]):
                        best = (t, cfg)
                if best is not None:
                    sect = "gemv" if best[1].get("FMA") else kind
                    tuned[sect].setdefault(f"{n}x{k}", {})[str(m)] = best[1]
                save()

            cfg = L.pick_config(kind, m, n, k)
            for sect in (kind, "gemv"):
                if args.tune and str(m) in tuned[sect].get(f"{n}x{k}", {}):
                    cfg = tuned[sect][f"{n}x{k}"][str(m)]
            try:
                t, err = bench_cfg(cfg, decode)
                y = nvfp4_linear(x, wt)  # the public path once more, with its own config choice
                err_public = rel_err(y, ref)
            except Exception as e:  # noqa: BLE001
                log(f"{name} M={m} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
                result["rows"].append(
                    {"shape": name, "N": n, "K": k, "M": m, "config": cfg, "error": str(e)[:300]}
                )
                save()
                continue

            naive = functools.partial(naive_linear, nvfp4_dequantize, x, packed, bs, gs)
            t_naive = triton.testing.do_bench(naive, warmup=10, rep=50, return_mode="median") * 1e-3
            t_bf16 = time_graph([functools.partial(torch.matmul, x, wb.T) for wb in w_bf16s])
            nbytes = wt.nbytes + x.numel() * 2 + m * n * 2
            row = {
                "shape": name,
                "N": n,
                "K": k,
                "M": m,
                "kernel": "gemv" if cfg.get("FMA") else kind,
                "config": cfg,
                "t_us": round(t * 1e6, 2),
                "bytes": nbytes,
                "gbs": round(nbytes / t / 1e9, 1),
                "pct_copy": round(100 * nbytes / t / copy_bw, 1),
                "tflops": round(2 * m * n * k / t / 1e12, 1),
                "naive_us": round(t_naive * 1e6, 1),
                "bf16_cublas_us": round(t_bf16 * 1e6, 2),
                "rel_err": err,
                "rel_err_public": err_public,
            }
            result["rows"].append(row)
            log(json.dumps(row))
            save()

    save()
    print(
        f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}, "
        f"copy {result['copy_bandwidth_tbs']:.2f} TB/s\n"
    )
    print(
        "| shape [N, K] | M | kernel | us | GB/s | % copy | TFLOP/s | naive us | bf16 cuBLAS us | rel err |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r['shape']} [{r['N']}, {r['K']}] | {r['M']} | FAILED | | | | | | | |")
            continue
        print(
            f"| {r['shape']} [{r['N']}, {r['K']}] | {r['M']} | {r['kernel']} | {r['t_us']:.1f} | "
            f"{r['gbs']:.0f} | {r['pct_copy']:.0f} | {r['tflops']:.1f} | {r['naive_us']:.0f} | "
            f"{r['bf16_cublas_us']:.1f} | {r['rel_err']:.1e} |"
        )


if __name__ == "__main__":
    main()
