"""Triton kernel behind :func:`vibeqwen_kernels.fp8.w8a8.quantize_rows_fp8` (imported on first use), and the
per-row E4M3 quantization it shares with the norm kernels that quantize their outputs (``_quant_store``).

``_quant_store``: each row's amax = max |x| (NaN kept); the scale is max(amax, tiny) / 448 and q = x / scale,
both IEEE-rounded divisions (``div_rn``, as torch divides two tensors); q is clamped to +-448 and converted to
E4M3 with round-to-nearest-even and saturation. ``_quant_rows_kernel``: each program quantizes ROWS rows of x.
"""

from __future__ import annotations

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait


@triton.jit
def _max_nan(a, b):
    """max that keeps NaN (tl.max drops it): a row with a NaN gets a NaN scale and NaN codes, as in torch."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quant_store(x, q_ptrs, s_ptrs, mask, rmask, tiny):
    """E4M3 codes (at q_ptrs, under mask) and scales (at s_ptrs, under rmask) of the rows of x [R, C] fp32
    (masked-off columns zero)."""
    amax = tl.reduce(tl.abs(x), 1, _max_nan)
    scale = tl.math.div_rn(tl.maximum(amax, tiny, propagate_nan=tl.PropagateNan.ALL), 448.0)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                   propagate_nan=tl.PropagateNan.ALL)
    tl.store(q_ptrs, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptrs, scale, mask=rmask)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, tiny, ROWS: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rows64 = rows.to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    rmask = rows < M
    mask = rmask[:, None] & (offs < K)[None, :]
    x = tl.load(x_ptr + rows64[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    _quant_store(x, q_ptr + rows64[:, None] * stride_q + offs[None, :], s_ptr + rows, mask, rmask, tiny)
