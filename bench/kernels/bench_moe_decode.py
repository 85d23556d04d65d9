"""The CUDA MoE decode GEMMs (16-pair blocks) on the H200: the five kernels per GEMM, and a read-only ceiling.

Model shapes (E' = 257 experts, k' = 9 slots, H = 2048, I = 512), random NVFP4 experts, fused_router routings of T
tokens (T in 1, 8, 32, 64). Per GEMM (gate|up unsplit and in 2 splits, down unsplit and in 2 splits): microseconds
per call of ``moe_mma`` with each kernel of ``mma_cuda.DECODE_KERNELS`` (``regs``: moe_mma_kernel<1>, ``regs2``:
moe_mma_kernel<2>, ``async``: moe_mma_async_kernel), checked equal bit for bit, and of a Triton kernel that only reads
the same expert bytes (codes and bf16 scales of the shuffled copy) with the same CTA shapes: the ceiling for
those bytes with that grid. Then ``fused_moe`` per call with the tuned config and with the forced kernels (gate|up
and down launches), and with gate|up, SiLU and down in one ``moe_mlp`` launch, each CTA shape in 1 and 2 slices of
I (checked equal bit for bit to the two launches with the same splits), and each again streaming the e4m3 block
scales (the copy prepack makes unless ``VIBEQWEN_MOE_MLP_E4M3=0`` when this script starts). All timed as replays of one CUDA graph
of 8 calls with distinct routings.

    python bench/kernels/bench_moe_decode.py [--ts 1,8,32,64] [--fused-only]

(The eleventh session's tables in bench/results/h200_notes.md came from the same measurements run as ad-hoc scripts;
the later sessions' come from this script.)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import TOP_K, E, H, I, time_graph

REPS = 8


@triton.jit
def _read_kernel(codes, scales, block_expert, out, ntiles, kchunks, PER: tl.constexpr, TILES: tl.constexpr):
    """Program (block b, tile group y, split z): sums the int32 words of TILES row tiles' PER chunks of codes
    (512 bytes a chunk) and scales (128 bytes) of the block's expert; writes the sum (so nothing is optimised away)."""
    b = tl.program_id(0)
    y = tl.program_id(1)
    z = tl.program_id(2)
    e = tl.load(block_expert + b)
    if e >= 0:
        tiles = y * TILES + tl.arange(0, TILES)
        first = (e * ntiles + tiles) * kchunks + z * PER
        v = tl.load(codes + first.to(tl.int64)[:, None] * 128 + tl.arange(0, PER * 128)[None, :])
        v2 = tl.load(scales + first.to(tl.int64)[:, None] * 32 + tl.arange(0, PER * 32)[None, :])
        idx = (b * tl.num_programs(1) + y) * tl.num_programs(2) + z
        tl.store(out + idx, tl.sum(tl.sum(v, 1), 0) + tl.sum(tl.sum(v2, 1), 0))


def _read(codes32, scales32, block_expert, out, ntiles, kchunks, split, per) -> None:
    _read_kernel[(block_expert.numel(), ntiles // 4, split)](
        codes32, scales32, block_expert, out, ntiles, kchunks, PER=per, TILES=4, num_warps=4)


@contextlib.contextmanager
def _env(env: dict):
    """The environment switches ``env`` set for the block; their earlier values (or absence) restored after it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def random_experts(dev: torch.device):
    """``fused.prepack_moe_nvfp4`` of E + 1 random NVFP4 experts (the last standing for the shared expert), with the
    CUDA kernels' shuffled copies (seed 0)."""
    from vibeqwen_kernels.moe import fused as F

    from vibeqwen.checkpoint.quant import nvfp4_quantize

    torch.manual_seed(0)
    trip = []
    for n, k in ((I, H), (I, H), (H, I)):
        p, s, g = nvfp4_quantize(torch.randn(E + 1, n, k, device=dev) / k**0.5)
        trip.append([(p[e], s[e], g[e]) for e in range(E + 1)])
    return F.prepack_moe_nvfp4(*trip, device=dev, mma=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1,8,32,64")
    ap.add_argument("--fused-only", action="store_true", help="only the fused_moe rows (no per-GEMM kernels)")
    args = ap.parse_args()
    from vibeqwen_kernels.moe import fused as F
    from vibeqwen_kernels.moe import mma_cuda as M

    dev = torch.device("cuda")
    if M.mma_library(dev) is None:
        sys.exit("the CUDA MoE kernels are not available here (sm_90+ and nvcc needed)")
    n_exp, kp = E + 1, TOP_K + 1
    weights = random_experts(dev)
    for t in (int(v) for v in args.ts.split(",")):
        n_pairs = t * kp
        xs = [torch.randn(t, H, device=dev).to(torch.bfloat16) for _ in range(REPS)]
        hs = [torch.randn(n_pairs, I, device=dev).to(torch.bfloat16) for _ in range(REPS)]
        routes = [F.fused_router(torch.randn(t, n_exp, device=dev).to(torch.bfloat16), TOP_K) for _ in range(REPS)]
        aligned = [F.moe_align(ti, n_exp, 16) for _, ti in routes]
        hit = statistics.mean(len(torch.unique(r[1])) for r in routes)
        print(f"T={t}: {hit:.1f} experts hit per call", flush=True)
        for name, wm, src, xdiv, split, gs in () if args.fused_only else (
            ("gate|up, 1 split", weights.w13_mma, xs, kp, 1, None),
            ("gate|up, 2 splits", weights.w13_mma, xs, kp, 2, None),
            ("down, 1 split", weights.w2_mma, hs, 1, 1, weights.w2_gscale),
            ("down, 2 splits", weights.w2_mma, hs, 1, 2, weights.w2_gscale),
        ):
            outs = [torch.empty(split, n_pairs, wm.n, device=dev) for _ in range(REPS)]
            mb = hit * (wm.codes[0].numel() + wm.scales[0].numel() * 2) / 1e6
            line, sums = [], []
            for kern in M.DECODE_KERNELS:
                calls = [functools.partial(M.moe_mma, x, xdiv, wm, gs, a[0], a[1], n_pairs, split, o, kernel16=kern)
                         for x, a, o in zip(src, aligned, outs)]
                us = time_graph(calls, reps=20) * 1e6
                outs[0].fill_(float("nan"))
                calls[0]()
                sums.append(outs[0].clone())
                line.append(f"{kern} {us:.1f} us ({mb / us:.2f} TB/s)")
            same = all(torch.equal(sums[0], v) for v in sums[1:])
            ntiles, kchunks = wm.n // 16, wm.k // 64
            per = kchunks // split
            bouts = [torch.empty(a[1].numel() * (ntiles // 4) * split, device=dev, dtype=torch.int32) for a in aligned]
            codes32, scales32 = wm.codes.view(torch.int32), wm.scales.view(torch.int32)
            reads = [functools.partial(_read, codes32, scales32, a[1], o, ntiles, kchunks, split, per)
                     for a, o in zip(aligned, bouts)]
            read_us = time_graph(reads, reps=20) * 1e6
            print(f"  {name} ({mb:.1f} MB): " + ", ".join(line)
                  + f"; read-only {read_us:.1f} us ({mb / read_us:.2f} TB/s){'' if same else '; SUMS DIFFER'}",
                  flush=True)
        outs = [torch.empty(t, H, device=dev, dtype=torch.bfloat16) for _ in range(REPS)]
        cfg = F.pick_moe_config(t, kp, n_exp)

        def fused_us(c: dict, env: dict) -> float:
            with _env(env):
                calls = [functools.partial(F.fused_moe, x, tw, ti, weights, c, out=o)
                         for x, (tw, ti), o in zip(xs, routes, outs)]
                return time_graph(calls, reps=20) * 1e6

        line = []
        for forced in ("", *M.DECODE_KERNELS):
            us = fused_us(cfg, {"VIBEQWEN_MOE_DECODE_KERNEL": forced, "VIBEQWEN_MOE_MLP": "0"})
            line.append(f"{forced or 'rule'} {us:.1f}")
        print(f"  fused_moe, gate|up and down launches (tuned splits {cfg.get('SPLIT_K1', 1)}/"
              f"{cfg.get('SPLIT_K2', 1)}), us: " + ", ".join(line), flush=True)
        # gate|up, SiLU and down in one launch (moe_mlp), each CTA shape in 1 and 2 slices of I, from an MMA config
        # with 16-pair blocks (the tuned one's splits do not apply); its output against the two launches with the same
        # splits (gate|up unsplit, down in `split`): equal bit for bit
        mcfg = dict(cfg, BLOCK_M=16, MMA=1, GEMV=0, SPLIT_GU=0)
        # with the e4m3 block scales kept too (unless VIBEQWEN_MOE_MLP_E4M3=0 when this script starts), each shape again
        # streaming them
        scale_kinds = ("bf16", "e4m3") if weights.w13_mma.scales_e4m3 is not None else ("bf16",)
        for cta, kind in [(c, k) for k in scale_kinds for c in M.MLP_CTAS]:
            line = []
            for split in (1, 2):
                env = {"VIBEQWEN_MOE_MLP": "1", "VIBEQWEN_MOE_MLP_MIN_PAIRS": "1", "VIBEQWEN_MOE_MLP_SPLIT": str(split),
                       "VIBEQWEN_MOE_MLP_CTA": cta, "VIBEQWEN_MOE_MLP_E4M3": "1" if kind == "e4m3" else "0"}
                us = fused_us(mcfg, env)
                with _env(env):
                    a = F.fused_moe(xs[0], *routes[0], weights, mcfg)
                with _env(dict(env, VIBEQWEN_MOE_MLP="0")):
                    b = F.fused_moe(xs[0], *routes[0], weights, dict(mcfg, SPLIT_K1=1, SPLIT_K2=split))
                line.append(f"split {split} {us:.1f}{'' if torch.equal(a, b) else ' (DIFFERS from the two launches)'}")
            rule_kind = "e4m3" if M.mlp_e4m3(weights.w13_mma, weights.w2_mma, M.mlp_early_scales()) else "bf16"
            used = M.mlp_wanted(n_pairs) and M.mlp_cta(n_pairs) == cta and kind == rule_kind
            print(f"  fused_moe, one moe_mlp launch, CTA {cta}, {kind} scales"
                  f"{' (the rule at this T: split 2)' if used else ''}, us: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
