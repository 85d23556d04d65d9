"""Triton kernel: the inputs of fla's chunked gated delta rule for one padded sequence, in one launch.

``_gdn_padded_inputs_kernel``: program r < B copies row r of q, k, v (strided rows, e.g. views of the conv
output) into contiguous buffers (with L2NORM, q and k L2-normalised per head on the way, as fla's
``use_qk_l2norm_in_kernel`` would: fp32, x / sqrt(sum x^2 + 1e-6), one rounding) and computes the row's gates,
g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) (fp32); rows r >= n (padding) get zeros everywhere
instead (whatever they held, NaN included). With HAS_H0, programs B.. copy the sequence's state slot (fp32 or bf16)
into the fp32 h0 (zeros without an initial state). Host side: ``vibeqwen_kernels.gdn.chunk_fla.gdn_padded_inputs``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait


@triton.jit
def _copy_row(p_src, p_dst, keep, D: tl.constexpr, BLOCK: tl.constexpr):
    for off in tl.static_range(0, D, BLOCK):
        o = off + tl.arange(0, BLOCK)
        m = o < D
        x = tl.load(p_src + o, mask=m, other=0.0)
        tl.store(p_dst + o, tl.where(keep, x, tl.zeros_like(x)), mask=m)


@triton.jit
def _copy_heads_l2norm(p_src, p_dst, keep, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    hh = tl.arange(0, BLOCK_H)[:, None]
    dd = tl.arange(0, BLOCK_D)[None, :]
    m = (hh < H) & (dd < D)
    x = tl.load(p_src + hh * D + dd, mask=m, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None]
    tl.store(p_dst + hh * D + dd, tl.where(keep, y, tl.zeros_like(y)).to(p_dst.dtype.element_ty), mask=m)


@triton.jit
def _gdn_padded_inputs_kernel(
    p_q, p_k, p_v, stride_q, stride_k, stride_v,
    p_a, p_b, stride_a, stride_b, p_alog, p_dtb,
    p_qo, p_ko, p_vo, p_g, p_beta,
    p_n, p_states, p_slot, p_init, p_h0,
    B,
    QD: tl.constexpr, VD: tl.constexpr, HV: tl.constexpr, SD: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, HAS_H0: tl.constexpr,
    L2NORM: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_DK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    if pid < B:
        r = pid.to(tl.int64)
        keep = pid < tl.load(p_n)
        if L2NORM:
            _copy_heads_l2norm(p_q + r * stride_q, p_qo + r * QD, keep, HK, DK, BLOCK_HK, BLOCK_DK)
            _copy_heads_l2norm(p_k + r * stride_k, p_ko + r * QD, keep, HK, DK, BLOCK_HK, BLOCK_DK)
        else:
            _copy_row(p_q + r * stride_q, p_qo + r * QD, keep, QD, BLOCK)
            _copy_row(p_k + r * stride_k, p_ko + r * QD, keep, QD, BLOCK)
        _copy_row(p_v + r * stride_v, p_vo + r * VD, keep, VD, BLOCK)
        h = tl.arange(0, BLOCK_H)
        hm = h < HV
        a = tl.load(p_a + r * stride_a + h, mask=hm, other=0.0).to(tl.float32)
        b = tl.load(p_b + r * stride_b + h, mask=hm, other=0.0).to(tl.float32)
        x = a + tl.load(p_dtb + h, mask=hm, other=0.0)
        # torch's softplus (threshold 20), with log(1 + e^x) for log1p(e^x): below x ~ -17 it gives 0 where
        # torch gives ~e^x (under 1e-7: the decay exp(g) is 1 either way)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        g = -tl.exp(tl.load(p_alog + h, mask=hm, other=0.0)) * softplus
        beta = 1.0 / (1.0 + tl.exp(-b))
        zero = tl.zeros_like(g)
        tl.store(p_g + r * HV + h, tl.where(keep, g, zero), mask=hm)
        tl.store(p_beta + r * HV + h, tl.where(keep, beta, zero), mask=hm)
    elif HAS_H0:
        o = (pid - B) * BLOCK_S + tl.arange(0, BLOCK_S)
        m = o < SD
        slot = tl.load(p_slot).to(tl.int64)
        init = tl.load(p_init) != 0
        s = tl.load(p_states + slot * SD + o, mask=m, other=0.0).to(tl.float32)  # fp32 or bf16 slot -> fp32 h0
        tl.store(p_h0 + o, tl.where(init, s, tl.zeros_like(s)), mask=m)
