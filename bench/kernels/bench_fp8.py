"""FP8 E4M3 linear and fused RMSNorm on the GPU (H200): time and accuracy against baselines.

For the FP8 shapes (N, K) the model uses and M in 1, 8, 32, 64, 1024, 8192:

* w8a16: :func:`vibeqwen_kernels.fp8.fp8_linear` (FP8 weight widened in registers, bf16 x);
* w8a8: :func:`vibeqwen_kernels.fp8.fp8_w8a8_linear`, x quantized per token to E4M3 (the quantization
  kernel is timed too), then ``torch._scaled_mm`` with row-wise scales, bf16 out;
* bf16: cuBLAS ``x @ w.T`` on the dequantized bf16 weight;
* mma: :func:`vibeqwen_kernels.fp8.mma.fp8_linear_mma` (the CUDA W8A16 kernel decode steps run, M <= 64, default
  plan; n/a without nvcc);
* mm8: ``torch._scaled_mm`` alone on rows quantized beforehand (the w8a8 column less its quantization launch, as
  when a norm kernel writes the codes).

Each is timed as replays of a CUDA graph that calls it once per copy of the weight (copies together
> 256 MB, so each call reads its weight from HBM rather than the 60 MB L2; fewer copies for M >= 1024).
Printed: microseconds per call, the weight bytes' fraction of 4.3 TB/s, and the relative Frobenius
error against the fp32 reference ``x @ dequant(w)^T``. Then ``rms_norm`` with residual (D = 2048) at
T = 1, 64, 8192 (bytes: x, residual read; y, residual written) and ``gated_rms_norm`` (H = 32, D = 128).

    python bench/kernels/bench_fp8.py [--ms 1,8,32] [--shapes 8192x2048,32x2048]
    python bench/kernels/bench_fp8.py --tune [--ms 1,2,4,8,16,32,64]   # writes configs/fp8_h200.json

``--tune`` times every candidate configuration of ``fp8_linear``'s two kernels for the decode shapes of the
model (fused GDN qkv|z, fused attention q|k|v, the output projections) and M up to 64, checks each against
the reference, and writes the fastest per (N, K) and M into configs/fp8_h200.json (other entries kept; the
file is rewritten after every shape, so a cut-short run keeps what it finished).
"""

from __future__ import annotations

import argparse
import math

import torch

SHAPES = [(8192, 2048), (4096, 2048), (32, 2048), (2048, 4096), (512, 2048), (12288, 2048), (9216, 2048)]
#: Decode shapes the engine runs through fp8_linear: GDN qkv|z, attention q|k|v, GDN out_proj / attention o_proj.
TUNE_SHAPES = [(12288, 2048), (9216, 2048), (2048, 4096)]
TUNE_MS = [1, 2, 4, 8, 16, 32, 64]
MS = [1, 8, 32, 64, 1024, 8192]
HBM = 4.3e12
ROTATE_BYTES = 256 << 20


def _graph_time_us(fn_per_copy, copies: int, reps: int = 20) -> float:
    """Mean microseconds of one call: a CUDA graph runs fn_per_copy(i) for every copy i."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn_per_copy(i)  # warm-up / compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn_per_copy(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * copies)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bench_linear(shapes, ms) -> None:
    from vibeqwen_kernels.fp8 import fp8_linear, fp8_w8a8_linear, prepack_fp8, weight_scale_row
    from vibeqwen_kernels.fp8.w8a8 import QuantizedRows, quantize_rows_fp8

    from vibeqwen.checkpoint.quant import fp8_quantize

    dev = torch.device("cuda")
    print(f"{'N':>6} {'K':>5} {'M':>5} | {'w8a16 us':>9} {'%HBM':>5} {'rel':>8} | {'w8a8 us':>9} {'%HBM':>5} "
          f"{'rel':>8} | {'bf16 us':>9} {'%HBM':>5} {'rel':>8} | {'mma us':>9} {'%HBM':>5} {'rel':>8} | "
          f"{'mm8 us':>9} {'%HBM':>5}")  # fmt: skip
    mma_cols: list[str] = []  # the CUDA W8A16 decode kernel (M <= 64)
    gemm_cols: list[str] = []  # torch._scaled_mm alone on pre-quantized rows
    for n, k in shapes:
        q, s = fp8_quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
        w = prepack_fp8(q, s)
        wb = w.dequantize(torch.bfloat16)
        w_deq = w.dequantize(torch.float32)
        for m in ms:
            copies = min(64, max(1, math.ceil(ROTATE_BYTES / (n * k)))) if m < 1024 else 2
            ws = [w] + [prepack_fp8(q.clone(), s) for _ in range(copies - 1)]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ w_deq.t()
            outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(min(copies, 2))]
            row = f"{n:>6} {k:>5} {m:>5} |"

            def ours(i, x=x, ws=ws, outs=outs):
                fp8_linear(x, ws[i], out=outs[i % len(outs)])

            t = _graph_time_us(ours, copies)
            ours(0)
            row += f" {t:9.1f} {n * k / (t * 1e-6) / HBM:5.0%} {_rel(outs[0], ref):8.1e} |"

            # the CUDA MMA kernel the engine's decode steps run (W8A16, default plan; M <= 64 and nvcc only)
            try:
                from vibeqwen_kernels.fp8 import mma as FM

                if m > FM.MMA_MAX_M or not FM.fp8_mma_supported(n, k, dev):
                    raise ValueError("unsupported")
                wms = [FM.prepack_fp8_mma(wi) for wi in ws]

                def mma(i, x=x, wms=wms, outs=outs):
                    FM.fp8_linear_mma(x, wms[i], out=outs[i % len(outs)])

                t = _graph_time_us(mma, copies)
                mma(0)
                mma_cols.append(f" {t:9.1f} {n * k / (t * 1e-6) / HBM:5.0%} {_rel(outs[0], ref):8.1e}")
                del wms
            except (RuntimeError, ValueError, ImportError) as e:
                mma_cols.append(f" {'n/a':>9} {'':>5} {str(e)[:8]:>8}")

            # W8A8: the engine's prefill option (per-token E4M3 activations, its quantization kernel timed)
            rows_s = [weight_scale_row(wi) for wi in ws]
            try:

                def w8a8(i, x=x, ws=ws, rows_s=rows_s):
                    return fp8_w8a8_linear(x, ws[i], rows_s[i])

                t = _graph_time_us(w8a8, copies)
                row += f" {t:9.1f} {n * k / (t * 1e-6) / HBM:5.0%} {_rel(w8a8(0), ref):8.1e} |"
                # the GEMM alone, on rows quantized beforehand (as when a norm kernel writes the codes)
                qx = quantize_rows_fp8(x)

                def gemm8(i, qx=qx, ws=ws, rows_s=rows_s):
                    return fp8_w8a8_linear(QuantizedRows(*qx), ws[i], rows_s[i])

                t = _graph_time_us(gemm8, copies)
                gemm_cols.append(f" {t:9.1f} {n * k / (t * 1e-6) / HBM:5.0%}")
            except (RuntimeError, ValueError) as e:  # e.g. shape limits of _scaled_mm
                row += f" {'n/a':>9} {'':>5} {str(e)[:8]:>8} |"
                gemm_cols.append(f" {'n/a':>9} {'':>5}")

            wbs = [wb] + [wb.clone() for _ in range(copies - 1)]

            def bf16(i, x=x, wbs=wbs):
                return x @ wbs[i].t()

            t = _graph_time_us(bf16, copies)
            row += f" {t:9.1f} {2 * n * k / (t * 1e-6) / HBM:5.0%} {_rel(bf16(0), ref):8.1e} |"
            print(row + mma_cols[-1] + " |" + gemm_cols[-1], flush=True)
        del w, wb, w_deq
        torch.cuda.empty_cache()


def bench_norm() -> None:
    from vibeqwen_kernels.norm import gated_rms_norm_ref, rms_norm_ref
    from vibeqwen_kernels.norm_fused import gated_rms_norm, rms_norm

    dev = torch.device("cuda")
    d = 2048
    w = torch.randn(d, device=dev, dtype=torch.bfloat16) * 0.1
    print(f"\nrms_norm + residual, D={d}, bf16 (and gated_rms_norm H=32 D=128)")
    for t in (1, 64, 8192):
        x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
        r = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
        us = _graph_time_us(lambda i, x=x, r=r: rms_norm(x, w, 1e-6, r), 1, reps=200)
        y, h = rms_norm(x, w, 1e-6, r)
        exact = torch.equal(h, x + r)
        err = _rel(y, rms_norm_ref(x + r, w, 1e-6).float())
        gb = 4 * t * d * 2
        us_ref = _graph_time_us(lambda i, x=x, r=r: rms_norm_ref(x + r, w, 1e-6), 1, reps=200)
        gx = torch.randn(t, 32, 128, device=dev, dtype=torch.bfloat16)
        gz = torch.randn(t, 32, 128, device=dev, dtype=torch.bfloat16)
        gw = torch.randn(128, device=dev, dtype=torch.bfloat16)
        gus = _graph_time_us(lambda i, gx=gx, gz=gz, gw=gw: gated_rms_norm(gx, gz, gw, 1e-6), 1, reps=200)
        gerr = _rel(gated_rms_norm(gx, gz, gw, 1e-6), gated_rms_norm_ref(gx, gz, gw, 1e-6).float())
        print(f"T={t:>5}: rms_norm {us:7.1f} us ({gb / (us * 1e-6) / HBM:4.0%} HBM), eager torch ref {us_ref:7.1f} us,"
              f" residual exact={exact}, rel={err:.1e} | gated {gus:7.1f} us rel={gerr:.1e}")  # fmt: skip


def tune_candidates(m: int) -> list[dict]:
    """Launch configurations to try for M rows: CUDA-core GEMV ones (M <= 4) and tensor-core ones."""
    out = []
    if m <= 4:
        bm = 1 << max(0, (m - 1).bit_length())
        for bn, bk, warps in [(16, 256, 4), (32, 256, 4), (32, 512, 4), (64, 256, 4), (64, 512, 8), (128, 256, 8)]:
            for split in (1, 2, 4, 8):
                out.append(dict(KIND="gemv", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, GROUP_M=1,
                                num_warps=warps, num_stages=2))
    bm = max(16, 1 << max(0, (m - 1).bit_length()))
    for bn, bk, warps, stages in [(32, 128, 4, 3), (64, 128, 4, 3), (64, 256, 4, 2), (128, 64, 4, 4),
                                  (128, 128, 8, 3), (64, 64, 4, 4)]:
        for split in (1, 2, 4, 8):
            out.append(dict(KIND="mm", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, GROUP_M=1, W_AS_A=1,
                            num_warps=warps, num_stages=stages))
    return out


def tune(shapes, ms, path: str) -> None:
    """Time every candidate per (N, K) and M (CUDA graphs over rotating weight copies, as bench_linear),
    keep the fastest whose error is at bf16 rounding, write them to `path` (merged with what is there)."""
    import json
    import os

    from vibeqwen_kernels.fp8 import linear as L
    from vibeqwen_kernels.fp8 import prepack_fp8

    from vibeqwen.checkpoint.quant import fp8_quantize

    table = {}
    if os.path.exists(path):
        with open(path) as f:
            table = json.load(f)
    table["gpu"] = torch.cuda.get_device_name()
    table["note"] = "bench/kernels/bench_fp8.py --tune; keys: N x K, then M"
    configs = table.setdefault("configs", {})
    dev = torch.device("cuda")
    for n, k in shapes:
        q, s = fp8_quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
        w = prepack_fp8(q, s)
        w_deq = w.dequantize(torch.float32)
        copies = min(64, max(1, math.ceil(ROTATE_BYTES / (n * k))))
        ws = [w] + [prepack_fp8(q.clone(), s) for _ in range(copies - 1)]
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ w_deq.t()
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            heuristic = L._heuristic_config(m, n, k)
            results = []
            for cfg in [heuristic] + tune_candidates(m):
                try:
                    L._launch(x, w, out, cfg)
                    err = _rel(out, ref)
                    if not err < 1e-2:
                        raise ValueError(f"error {err:.1e}")
                    t = _graph_time_us(lambda i, cfg=cfg: L._launch(x, ws[i], out, cfg), copies)
                    results.append((t, cfg))
                except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run is skipped
                    print(f"  {n}x{k} M={m} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
            t_best, best = min(results, key=lambda r: r[0])
            t_heur = next(t for t, c in results if c is heuristic) if any(c is heuristic for _, c in results) else None
            configs.setdefault(f"{n}x{k}", {})[str(m)] = best
            print(f"{n}x{k} M={m}: {t_best:.1f} us ({n * k / (t_best * 1e-6) / HBM:.0%} of 4.3 TB/s)"
                  f"{f', heuristic {t_heur:.1f} us' if t_heur else ''}: {best}", flush=True)
        with open(path, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        del w, ws, w_deq
        torch.cuda.empty_cache()
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--no-norm", action="store_true")
    ap.add_argument("--tune", action="store_true", help="tune fp8_linear's configs (default shapes: TUNE_SHAPES)")
    ap.add_argument("--out", default="configs/fp8_h200.json", help="--tune writes here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8: needs a CUDA GPU")
    torch.manual_seed(0)
    if args.tune:
        shapes = TUNE_SHAPES if args.shapes == ",".join(f"{n}x{k}" for n, k in SHAPES) else \
            [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        ms = TUNE_MS if args.ms == ",".join(map(str, MS)) else [int(m) for m in args.ms.split(",")]
        tune(shapes, ms, args.out)
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    bench_linear(shapes, [int(m) for m in args.ms.split(",")])
    if not args.no_norm:
        bench_norm()


if __name__ == "__main__":
    main()
