"""Does an L2 prefetch of a decode GEMM's weights make the GEMM faster? (GPU; answers the twenty-second session's
open question in bench/results/h200_notes.md: an in-kernel ``cp.async.bulk.prefetch.L2`` of the next layer's qkv|z
weights left that GEMM's time unchanged in the decode step, and it was not known whether the lines arrive at all.)

For the FP8 decode GEMM (:func:`vibeqwen_kernels.fp8.mma.fp8_linear_mma`, one row of x) on the model's widest
weight (GDN qkv|z, 12288 x 2048, 25 MB) and an output projection (2048 x 4096, 8 MB), each case is a CUDA graph of
8 repetitions of a pattern that starts by overwriting a 256 MB buffer (L2 flushed); the GEMM's time is the
pattern's time minus the same pattern without the GEMM (us, medians of the replays):

  cold        flush, GEMM
  idle        flush, spin D us (``torch.cuda._sleep``), GEMM: the same as cold if the spin itself changes nothing
  bulk        flush, ``cp.async.bulk.prefetch.L2`` of the whole weight (8 KB pieces), spin D us, GEMM: what the
              reverted in-kernel prefetch hoped for
  half        the same for the first half of each 16-row tile (for qkv|z, split 1, the half its GEMM reads first;
              the output projection's K split reads all of a tile's K ranges at once)
  line        flush, ``prefetch.global.L2`` of every 128-byte line, spin D us, GEMM
  touch       flush, a kernel reading the whole weight, spin D us, GEMM: L2 filled by real loads (no evict_last:
              such lines could outlive the next flushes)
  bulk+16MB   bulk, spin D us, then 16 MB of other data read (as the one-token MoE streams its experts), GEMM:
              whether the prefetched lines outlive other traffic
  warm        the GEMM 8 times on the same weight, no flush (what is left in L2 from the last call)

With ``--hints``, the same with L2 cache policies (after the GEMM, the weight's lines go back to the normal
priority, ``applypriority``, in the pattern and in the pattern without the GEMM alike):

  bulkL         bulk with the prefetch marked ``evict_last``
  bulkL+16MB    bulk+16MB with the prefetch marked ``evict_last``
  bulk+16MBF    bulk+16MB with the other reads marked ``evict_first``
  bulkL+16MBF   both: whether a weight prefetched during the one-token MoE could outlive its expert stream

and the ratio of each to the weight's bytes at the measured copy rate. Prints a table last.

    python bench/kernels/bench_l2_prefetch.py [--spin-us 5,20] [--hints] [--json PATH]

Answer (H100, fifty-first session, bench/results/h200_notes.md): the lines do arrive (qkv|z 12.19 us cold, 9.9
after the bulk prefetch, 8.1 after the touch), but 16 MB of other reads in between (the one-token MoE's experts)
evict them all (12.19), and the GEMM does not keep its own weights in L2 (warm 11.06). A prefetch from a side branch
of the decode graph (the next layer's input projection before the MoE or the output projection, or the layer's
own output projection before its mixer) made decode b1 +3-8% slower; not kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_moe import time_graph  # noqa: E402

SHAPES = [(12288, 2048), (2048, 4096)]
REPEAT = 8
FLUSH_BYTES = 256 << 20


@triton.jit
def _bulk_prefetch_kernel(base, row_bytes, pieces_per_row, n_pieces, PIECE_B: tl.constexpr, LANES: tl.constexpr,
                          LAST: tl.constexpr = False):
    """Lane i of program p asks L2 for piece j = p * LANES + i of the rows at address `base` (int64): row j //
    pieces_per_row, its (j % pieces_per_row)-th PIECE_B bytes (fewer at a row's end) with
    ``cp.async.bulk.prefetch.L2`` (sm_90; 16-byte aligned rows of a multiple of 16 bytes), with an ``evict_last``
    L2 cache policy (``createpolicy.fractional``) where LAST. Writes nothing."""
    j = tl.program_id(0) * LANES + tl.arange(0, LANES)
    j = tl.minimum(j, n_pieces - 1)  # spare lanes repeat the last piece (a second hint for the same bytes)
    piece = j % pieces_per_row
    off = (j // pieces_per_row).to(tl.int64) * row_bytes + piece.to(tl.int64) * PIECE_B
    size = tl.minimum(row_bytes - piece * PIECE_B, PIECE_B).to(tl.int32)
    if LAST:
        tl.inline_asm_elementwise(
            "{\n\t.reg .b64 pol;\n\tcreatepolicy.fractional.L2::evict_last.b64 pol, 1.0;\n\t"
            "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;\n\t}\n\tmov.u32 $0, 0;", "=r,l,r",
            [base + off, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [base + off, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_pieces(nbytes: int, row_bytes: int, fraction: float = 1.0, piece: int = 8192) -> tuple[int, int]:
    """(pieces a row, pieces in all) that :func:`bulk_prefetch` asks for: the first ``fraction`` of each
    ``row_bytes``-byte row of an ``nbytes``-byte tensor, rounded up to whole ``piece``-byte pieces (at most the row).

    Raises:
        ValueError: ``row_bytes`` not a positive multiple of 16 dividing ``nbytes``, ``piece`` not a positive multiple
            of 16, or ``fraction`` outside (0, 1]."""
    if row_bytes <= 0 or row_bytes % 16 or nbytes % row_bytes:
        raise ValueError(f"bulk_prefetch: row_bytes {row_bytes} must be a positive multiple of 16 dividing {nbytes}")
    if piece <= 0 or piece % 16 or not 0 < fraction <= 1:
        raise ValueError(f"bulk_prefetch: piece {piece} must be a positive multiple of 16 and fraction {fraction} in "
                         f"(0, 1]")
    per_row = max(1, min(-(-int(row_bytes * fraction) // piece), -(-row_bytes // piece)))
    return per_row, nbytes // row_bytes * per_row


def bulk_prefetch(t: torch.Tensor, row_bytes: int, fraction: float = 1.0, piece: int = 8192,
                  evict_last: bool = False) -> None:
    """Ask L2 for the first ``fraction`` of every ``row_bytes``-byte row of ``t`` in ``piece``-byte prefetches (the
    last of a row shorter; :func:`prefetch_pieces`), marked ``evict_last`` where ``evict_last`` (such lines stay
    until :func:`normal_priority` or until L2 holds nothing else to evict). Writes nothing.

    Raises:
        ValueError: ``t`` not a contiguous, 16-byte aligned CUDA tensor, or what :func:`prefetch_pieces` raises."""
    if t.device.type != "cuda" or not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError("bulk_prefetch: t must be a contiguous, 16-byte aligned CUDA tensor")
    per_row, n_pieces = prefetch_pieces(t.numel() * t.element_size(), row_bytes, fraction, piece)
    _bulk_prefetch_kernel[(triton.cdiv(n_pieces, 32),)](t.data_ptr(), row_bytes, per_row, n_pieces, PIECE_B=piece,
                                                        LANES=32, LAST=evict_last, num_warps=1)


@triton.jit
def _normal_priority_kernel(base, n_lines, BLOCK: tl.constexpr):
    """``applypriority.global.L2::evict_normal`` of lines pid * BLOCK + i (128 bytes each) at address `base`."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i = tl.minimum(i, n_lines - 1)
    p = base + i.to(tl.int64) * 128
    tl.inline_asm_elementwise("applypriority.global.L2::evict_normal [$1], 128;\n\tmov.u32 $0, 0;", "=r,l", [p],
                              dtype=tl.int32, is_pure=False, pack=1)


def normal_priority(t: torch.Tensor) -> None:
    """Put every 128-byte line of ``t`` (contiguous, 128-byte aligned CUDA tensor) that L2 holds back to the normal
    eviction priority (after :func:`bulk_prefetch` with ``evict_last``)."""
    lines = t.numel() * t.element_size() // 128
    _normal_priority_kernel[(triton.cdiv(lines, 1024),)](t.data_ptr(), lines, BLOCK=1024, num_warps=4)


@triton.jit
def _line_prefetch_kernel(base, n_lines, BLOCK: tl.constexpr):
    """``prefetch.global.L2`` of lines pid * BLOCK + i (128 bytes each) of the bytes at address `base` (int64)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i = tl.minimum(i, n_lines - 1)
    p = base + i.to(tl.int64) * 128
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _touch_kernel(ptr, out, n_words, BLOCK: tl.constexpr, LAST: tl.constexpr, FIRST: tl.constexpr = False):
    """Reads words pid * BLOCK + i (int32), with ``evict_last`` where LAST, ``evict_first`` where FIRST (Triton's
    L2 cache policies); stores their xor (never read) so the loads stay."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if LAST:
        v = tl.load(ptr + i, mask=i < n_words, other=0, eviction_policy="evict_last")
    elif FIRST:
        v = tl.load(ptr + i, mask=i < n_words, other=0, eviction_policy="evict_first")
    else:
        v = tl.load(ptr + i, mask=i < n_words, other=0)
    tl.store(out + tl.program_id(0), tl.xor_sum(v, axis=0))


def median_us(calls, reps: int = 15) -> float:
    """Median us per repetition over replays of one graph running `calls` ``REPEAT`` times
    (:func:`bench_moe.time_graph`; every call run once first, so that no Triton kernel compiles inside the capture)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    return time_graph(list(calls) * REPEAT, reps=reps) * len(calls) * 1e6


def spin_clock_hz() -> float:
    """Cycles a second of ``torch.cuda._sleep`` (its spin counts SM clocks), measured over a 2M-cycle spin."""
    torch.cuda._sleep(1000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(2_000_000)
    b.record()
    b.synchronize()
    return 2_000_000 / (a.elapsed_time(b) * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spin-us", default="5,20", help="spin before the GEMM, us (comma list)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--hints", action="store_true", help="also the L2 cache-policy cases (bulkL, ...F)")
    args = ap.parse_args()
    from h200_reference import copy_bandwidth_tbs
    from vibeqwen_kernels.fp8 import mma as FM
    from vibeqwen_kernels.fp8 import prepack_fp8

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("bench_l2_prefetch.py needs a CUDA GPU of sm_90+ (cp.async.bulk.prefetch, the FP8 MMA kernel)")
    dev = torch.device("cuda")
    if FM.fp8_mma_library(dev) is None:
        sys.exit("the CUDA FP8 kernel is not available here (sm_90+ and nvcc needed)")
    tbs = copy_bandwidth_tbs("cuda")
    clock_hz = spin_clock_hz()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    sink = torch.empty(1 << 16, dtype=torch.int32, device=dev)
    other = torch.ones(16 << 18, dtype=torch.int32, device=dev)  # 16 MB read between a prefetch and the GEMM
    torch.manual_seed(0)
    rows = []
    for n, k in SHAPES:
        q = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
        w = FM.prepack_fp8_mma(prepack_fp8(q, torch.full((n,), 0.02, device=dev), dev))
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        codes = w.codes
        nbytes = codes.numel() * codes.element_size()
        assert codes.is_contiguous() and codes.data_ptr() % 16 == 0
        u8 = codes.view(torch.uint8).view(-1)
        i32 = u8.view(torch.int32)

        def gemm():
            FM.fp8_linear_mma(x, w)

        def fl():
            flush.fill_(1)

        def bulk():
            bulk_prefetch(codes, 16 * k)

        def half():
            bulk_prefetch(codes, 16 * k, 0.5)

        def line():
            lines = nbytes // 128
            _line_prefetch_kernel[(triton.cdiv(lines, 1024),)](u8.data_ptr(), lines, BLOCK=1024, num_warps=4)

        def touch():
            words = i32.numel()
            _touch_kernel[(triton.cdiv(words, 4096),)](i32, sink, words, BLOCK=4096, LAST=False, num_warps=8)

        def stream_other():
            _touch_kernel[(triton.cdiv(other.numel(), 4096),)](other, sink, other.numel(), BLOCK=4096, LAST=False,
                                                               num_warps=8)

        def stream_other_first():
            _touch_kernel[(triton.cdiv(other.numel(), 4096),)](other, sink, other.numel(), BLOCK=4096, LAST=False,
                                                               FIRST=True, num_warps=8)

        def bulk_last():
            bulk_prefetch(codes, 16 * k, evict_last=True)

        def reset():
            normal_priority(codes)

        floor_us = nbytes / (tbs * 1e12) * 1e6
        flush_us = median_us([fl])
        cold = median_us([fl, gemm]) - flush_us
        warm = median_us([gemm])
        row = {"shape": f"{n}x{k}", "mb": round(nbytes / 1e6, 1), "floor_us": round(floor_us, 2),
               "cold_us": round(cold, 2), "warm_us": round(warm, 2)}
        for spin_us in (float(v) for v in args.spin_us.split(",")):
            cycles = int(spin_us * 1e-6 * clock_hz)

            def spin(c=cycles):
                torch.cuda._sleep(c)

            cases = [("idle", [], []), ("bulk", [bulk], []), ("half", [half], []), ("line", [line], []),
                     ("touch", [touch], []), ("bulk+16MB", [bulk], [stream_other])]
            if args.hints:  # L2 cache policies: the prefetch evict_last (reset after the GEMM), the other reads
                cases += [("bulkL", [bulk_last], []), ("bulkL+16MB", [bulk_last], [stream_other]),  # evict_first
                          ("bulk+16MBF", [bulk], [stream_other_first]),
                          ("bulkL+16MBF", [bulk_last], [stream_other_first])]
            for name, pre, post in cases:
                tail = [reset] if bulk_last in pre else []
                base = median_us([fl, *pre, spin, *post, *tail])
                row[f"{name}_{spin_us:g}us"] = round(median_us([fl, *pre, spin, *post, gemm, *tail]) - base, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, copy {tbs:.2f} TB/s; GEMM us at one row (ratio to its bytes' floor):")
    keys = [k_ for k_ in rows[0] if k_.endswith("us") and k_ != "floor_us"]
    print("| shape | MB | floor | " + " | ".join(keys) + " |")
    print("|---" * (3 + len(keys)) + "|")
    for r in rows:
        cells = [f"{r[k_]:.2f} ({r[k_] / r['floor_us']:.2f}x)" for k_ in keys]
        print(f"| {r['shape']} | {r['mb']} | {r['floor_us']:.2f} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_tbs": tbs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
