"""Triton kernel behind :mod:`vibeqwen_kernels.l2_prefetch` (imported on first use, so the package imports without
Triton)."""

from __future__ import annotations

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait


@triton.jit
def _l2_prefetch_kernel(base, row_bytes, pieces_per_row, n_pieces, PIECE_B: tl.constexpr, LANES: tl.constexpr,
                        PDL: tl.constexpr):
    """Lane i of program p asks L2 for piece j = p * LANES + i of the rows at address `base` (int64): row j //
    pieces_per_row, its (j % pieces_per_row)-th PIECE_B bytes (fewer at a row's end) with
    ``cp.async.bulk.prefetch.L2`` (sm_90). Writes nothing."""
    pdl_wait(PDL)
    j = tl.program_id(0) * LANES + tl.arange(0, LANES)
    j = tl.minimum(j, n_pieces - 1)  # spare lanes repeat the last piece (a second hint for the same bytes)
    piece = j % pieces_per_row
    off = (j // pieces_per_row).to(tl.int64) * row_bytes + piece.to(tl.int64) * PIECE_B
    size = tl.minimum(row_bytes - piece * PIECE_B, PIECE_B).to(tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [base + off, size], dtype=tl.int32, is_pure=False, pack=1)
