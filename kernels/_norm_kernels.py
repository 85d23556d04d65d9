"""Triton kernels behind :mod:`vibeqwen_kernels.norm_fused` (imported on first use, so the package
imports without Triton). Each program normalises ``ROWS`` rows of ``BLOCK_D >= D`` columns held in
registers; all math in float32, rounding steps as documented in ``norm_fused``. With ``QUANT`` a kernel
also quantizes its output rows to E4M3 exactly as ``vibeqwen_kernels.fp8.w8a8.quantize_rows_fp8`` does
(``_quant_store``: per-row amax of the output rounded to its dtype, IEEE divisions, round to nearest even)."""

from __future__ import annotations

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait
from vibeqwen_kernels.fp8._quant_kernels import _quant_store


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    res_out_ptr,
    T,
    D,
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    eps,
    q_ptr,
    s_ptr,
    stride_q,
    tiny,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < T
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        # torch's `x + residual`: sum in fp32, one rounding to x's dtype
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + rows64[:, None] * stride_ro + cols[None, :], s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / D
    inv = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = ((xf * inv[:, None]) * (1.0 + w[None, :])).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y, mask=mask)
    if QUANT:
        _quant_store(tl.where(mask, y.to(tl.float32), 0.0), q_ptr + rows64[:, None] * stride_q + cols[None, :],
                     s_ptr + rows64, mask, rmask, tiny)


@triton.jit
def gated_norm_rows(x, z, w, eps, D):
    """``norm_fused.gated_rms_norm``'s rounding steps on rows held in registers: x, z ``[R, BLOCK_D]`` (x in the
    activation dtype, zeros past D), w ``[BLOCK_D]`` any float dtype; returns ``[R, BLOCK_D]`` in x's dtype. Shared
    by ``_gated_rms_norm_kernel`` and the GDN recurrent kernel's norm tail (``gdn/_recurrent_kernels.py``)."""
    dt = x.dtype
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / D
    inv = 1.0 / tl.sqrt(var + eps)
    n = (xf * inv[:, None]).to(dt)  # norm rounded to the activation dtype
    wd = w.to(dt)  # weight in the activation dtype
    # w * n in the activation dtype (the fp32 product of two bf16/fp16 values is exact: one rounding)
    yw = (wd[None, :].to(tl.float32) * n.to(tl.float32)).to(dt)
    g = z.to(tl.float32)
    silu = g / (1.0 + tl.exp(-g))
    return (yw.to(tl.float32) * silu).to(dt)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    R,
    H,
    D,
    stride_xt,
    stride_xh,
    stride_xd,
    stride_zt,
    stride_zh,
    stride_zd,
    eps,
    q_ptr,
    s_ptr,
    tiny,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT_HEADS: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """QUANT_HEADS = H > 0: no y; the E4M3 codes of each token's H * D outputs (q [T, H * D]) and its scale
    (s [T]) instead. Needs BLOCK_D == D and ROWS a multiple of H (whole tokens per program)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)  # flattened (t, h)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < R
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    t = rows64 // H
    h = rows64 % H
    cols64 = cols.to(tl.int64)
    x = tl.load(
        x_ptr + (t * stride_xt + h * stride_xh)[:, None] + cols64[None, :] * stride_xd, mask=mask, other=0.0
    )
    z = tl.load(
        z_ptr + (t * stride_zt + h * stride_zh)[:, None] + cols64[None, :] * stride_zd, mask=mask, other=0.0
    )
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    y = gated_norm_rows(x, z, w, eps, D)
    if QUANT_HEADS > 0:
        TOK: tl.constexpr = ROWS // QUANT_HEADS
        toks = (pid * TOK + tl.arange(0, TOK)).to(tl.int64)
        tmask = toks * QUANT_HEADS < R
        yq = tl.reshape(tl.where(mask, y.to(tl.float32), 0.0), (TOK, QUANT_HEADS * BLOCK_D))
        o = tl.arange(0, QUANT_HEADS * BLOCK_D)
        _quant_store(yq, q_ptr + toks[:, None] * (QUANT_HEADS * BLOCK_D) + o[None, :],
                     s_ptr + toks, tmask[:, None] & (o[None, :] >= 0), tmask, tiny)
    else:
        tl.store(y_ptr + rows64[:, None] * D + cols[None, :], y, mask=mask)


@triton.jit
def _splitk_add_rms_norm_kernel(
    ws_ptr,
    s_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    res_out_ptr,
    M,
    N,
    stride_s,
    stride_r,
    stride_y,
    stride_ro,
    eps,
    SPLIT_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program m: row m of a split-K GEMM's output, its residual add and its RMSNorm. The partials ws[s, m, :]
    summed in split order (fp32) times the per-column scale s[n * stride_s], rounded to y's dtype (the GEMM's
    output, as ``_fp8_splitk_reduce_kernel`` stores it), then ``_rms_norm_kernel``'s HAS_RESIDUAL path on it."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = cols < N
    acc = tl.zeros((1, BLOCK_D), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the reduce kernel's sum
        acc += tl.load(ws_ptr + s * M * N + row * N + cols, mask=mask, other=0.0)
    scale = tl.load(s_ptr + cols * stride_s, mask=mask, other=0.0)
    dt = y_ptr.dtype.element_ty
    x = (acc * scale).to(dt)
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    h = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(res_out_ptr + row * stride_ro + cols, h, mask=mask)
    xf = h.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / N
    inv = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = ((xf * inv[:, None]) * (1.0 + w)).to(dt)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)
