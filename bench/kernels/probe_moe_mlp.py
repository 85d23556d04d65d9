"""Why the decode step's expert MLP (``moe_mlp_kernel<2, 8>``, csrc/moe_mma.cu) streams its weights at ~65% of the
HBM copy rate at 32 tokens while a read-only kernel over the same bytes reaches the copy rate.

Model shapes (E' = 257 experts, k' = 9 slots, H = 2048, I = 512), random NVFP4 experts, ``fused_router`` routings of
T tokens aligned by ``moe_align`` into 16-pair blocks. Per T, microseconds a call (replays of one CUDA graph of 8
calls with distinct routings and inputs) and the rate of the bytes each moves, against the copy rate:

* ``moe_mlp``: the kernel the engine runs (2 slices, a CTA per n8 half: ``VIBEQWEN_MOE_MLP_CTA=8``).
* ``read-only``: a Triton kernel that reads the same experts' codes and scales in big contiguous loads
  (``bench_moe_decode._read``: the ceiling for those bytes).
* ``probe order O work W ring R`` (bench/kernels/moe_mlp_probe.cu): the kernel's grid, prologue and per-warp
  cp.async ring over the same chunks, with the chunk order (O 0: the kernel's, a warp a gate|up tile, 8 streams a CTA
  16 KB apart; O 1: all warps of a CTA in the same tile, one 16 KB run a step; O 2: order 0 from an interleaved copy,
  each chunk's codes and scales in one 640-byte run as in its ring slot; O 3: order 0 with the next ring step's lines
  prefetched into L2 as each step is requested), the work (W 0: read only; W 1: the
  dequantization and MMAs of every chunk) and the ring depth (R 8: the kernel's; R 16) varied one at a time.

Reading the table: if W 0 with order 0 already runs well below the read-only rate, the memory side (order, depth)
holds the kernel; if W 0 runs near it and W 1 does not, the chunk work (issue, latency) does.

    python bench/kernels/probe_moe_mlp.py [--ts 16,32,64]

Needs nvcc and an sm_90 GPU (builds the probe into $VIBEQWEN_CACHE/probe/).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_moe import TOP_K, E, H, time_graph
from bench_moe_decode import _read, random_experts
from h200_reference import copy_bandwidth_tbs

REPS = 8
PROBES = [(o, w, r) for r in (8, 16) for w in (0, 1) for o in (0, 1)] + [(2, 0, 8), (2, 1, 8), (3, 0, 8), (3, 1, 8)]


def interleaved(m) -> torch.Tensor:
    """uint8 ``[E' N/16 K/64, 640]``: each chunk's 512 code bytes, then its 128 bf16 scale bytes (the ring slot's
    layout) of an MMAWeights set: the order 2 probes' weights."""
    codes = m.codes.reshape(-1, 512)
    return torch.cat((codes, m.scales.reshape(-1, 64).view(torch.uint8)), dim=1).contiguous()


def build_probe() -> ctypes.CDLL:
    """nvcc the probe (csrc/ on the include path) into the vibeqwen cache; raises CalledProcessError on a failed
    build."""
    from vibeqwen_kernels import cuda_build

    repo = HERE.parent.parent
    out = cuda_build.cache_dir().parent / "probe" / "moe_mlp_probe.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    nvcc = cuda_build._nvcc() or "nvcc"
    subprocess.run([nvcc, "-O3", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-I", str(repo / "csrc"),
                    "-o", str(out), str(HERE / "moe_mlp_probe.cu")], check=True)
    lib = ctypes.CDLL(str(out))
    lib.vq_mlp_probe_launch.restype = ctypes.c_int
    lib.vq_mlp_probe_launch.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int] + [
        ctypes.c_void_p] * 6 + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def measure(t: int, lib: ctypes.CDLL, wts, copy: float) -> None:
    """Time moe_mlp, the read-only kernel and every probe at T tokens; prints a line each and a table."""
    from vibeqwen_kernels.moe import fused as F
    from vibeqwen_kernels.moe import mma_cuda as M

    dev = torch.device("cuda")
    n_exp, kp = E + 1, TOP_K + 1
    w13, w2 = wts.w13_mma, wts.w2_mma
    expert_bytes = (w13.codes[0].numel() + w13.scales[0].numel() * 2 + w2.codes[0].numel()
                    + w2.scales[0].numel() * 2)
    n_pairs = t * kp
    xs = [torch.randn(t, H, device=dev).to(torch.bfloat16) for _ in range(REPS)]
    routes = [F.fused_router(torch.randn(t, n_exp, device=dev).to(torch.bfloat16), TOP_K) for _ in range(REPS)]
    aligned = [F.moe_align(ti, n_exp, 16) for _, ti in routes]

    def active(si, be):  # CTAs with pairs: (block, n8 half) pairs holding one, times the 2 slices
        first = si.view(-1, 16)[: be.numel()]
        return 2 * int(((be >= 0) & (first[:, 0] < n_pairs)).sum() + ((be >= 0) & (first[:, 8] < n_pairs)).sum())

    ctas = statistics.mean(active(a[0], a[1]) for a in aligned)
    blocks = statistics.mean(int((a[1] >= 0).sum()) for a in aligned)
    # bytes the SMs request: 8 warps x 192 chunks of 640 bytes a CTA (a block with both n8 halves asks for its expert
    # twice: the second mostly from L2; ~1% of the bytes at 32 tokens); read-only: each expert once
    mb_probe = ctas * 8 * 192 * 640 / 1e6
    mb_read = blocks * expert_bytes / 1e6
    print(f"T={t}: {blocks:.1f} expert blocks, {ctas:.1f} CTAs with pairs; {mb_probe:.1f} MB a probe / moe_mlp "
          f"call, {mb_read:.1f} MB read-only", flush=True)
    rows = []

    def row(name: str, calls, mb: float) -> None:
        us = time_graph(calls, reps=20) * 1e6
        rows.append((name, us, mb / us))
        print(f"  {name}: {us:.1f} us, {mb / us:.2f} TB/s ({100 * mb / us / copy:.0f}% of copy)", flush=True)

    outs = [torch.empty(2, n_pairs, H, device=dev) for _ in range(REPS)]
    row("moe_mlp (2 slices, CTA 8)", [functools.partial(
        M.moe_mlp, x, kp, w13, wts.w13_gscale, w2, wts.w2_gscale, a[0], a[1], n_pairs, 2, o)
        for x, a, o in zip(xs, aligned, outs)], mb_probe)
    c13, sc13 = w13.codes.view(torch.int32), w13.scales.view(torch.int32)
    c2, sc2 = w2.codes.view(torch.int32), w2.scales.view(torch.int32)

    def read_both(be, o13, o2):
        _read(c13, sc13, be, o13, w13.n // 16, w13.k // 64, 1, w13.k // 64)
        _read(c2, sc2, be, o2, w2.n // 16, w2.k // 64, 2, w2.k // 64 // 2)

    bouts = [(torch.empty(a[1].numel() * (w13.n // 64), device=dev, dtype=torch.int32),
              torch.empty(a[1].numel() * (w2.n // 64) * 2, device=dev, dtype=torch.int32)) for a in aligned]
    row("read-only (Triton, contiguous)", [functools.partial(read_both, a[1], *o) for a, o in zip(aligned, bouts)],
        mb_read)
    w13i, w2i = interleaved(w13), interleaved(w2)
    for order, work, ring in PROBES:
        sinks = [torch.empty(a[1].numel() * 4 * 256, device=dev, dtype=torch.int32) for a in aligned]

        def probe(x, a, sink, order=order, work=work, ring=ring):
            c13p, c2p = (w13i, w2i) if order == 2 else (w13.codes, w2.codes)
            rc = lib.vq_mlp_probe_launch(order, work, ring, x.data_ptr(), kp, x.stride(0), c13p.data_ptr(),
                                         w13.scales.data_ptr(), c2p.data_ptr(), w2.scales.data_ptr(),
                                         a[0].data_ptr(), a[1].data_ptr(), a[1].numel(), n_pairs,
                                         sink.data_ptr(), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
            if rc != 0:
                raise RuntimeError(f"probe launch failed: CUDA error {rc}")

        row(f"probe order {order} work {work} ring {ring}",
            [functools.partial(probe, x, a, s) for x, a, s in zip(xs, aligned, sinks)], mb_probe)
    print(f"| T={t} | us | TB/s | % of copy |\n|---|---|---|---|", flush=True)
    for name, us, tbs in rows:
        print(f"| {name} | {us:.1f} | {tbs:.2f} | {100 * tbs / copy:.0f}% |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="16,32,64")
    args = ap.parse_args()
    from vibeqwen_kernels.moe import mma_cuda as M

    dev = torch.device("cuda")
    if M.mma_library(dev) is None:
        sys.exit("the CUDA MoE kernels are not available here (sm_90+ and nvcc needed)")
    lib = build_probe()
    copy = copy_bandwidth_tbs("cuda")
    print(f"copy rate {copy:.2f} TB/s", flush=True)
    wts = random_experts(dev)
    os.environ["VIBEQWEN_MOE_MLP_CTA"] = "8"
    os.environ["VIBEQWEN_MOE_MLP_E4M3"] = "0"  # the bf16 block scales (640-byte chunks, as the probes stream)
    for t in (int(v) for v in args.ts.split(",")):
        measure(t, lib, wts, copy)


if __name__ == "__main__":
    main()
