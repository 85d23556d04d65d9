"""Triton kernels behind :func:`vibeqwen_kernels.nvfp4.linear.nvfp4_linear` (private: call the wrapper).

Both kernels compute ``y = x @ w^T`` with ``w`` stored as NVFP4 (``NVFP4Weight``):

    packed       uint8 [N, K/2]   repacked by prepack_nvfp4 (REPACKED): byte 8g+j of a row holds
                                  k = 16g+j in its low nibble and k = 16g+8+j in its high nibble;
                                  or the checkpoint's order, k = 2i, 2i+1 in byte i
    block_scale  e4m3  [N, K/16]  one scale per 16 consecutive k (as shipped; read as raw uint8 bits)
    global_scale fp32  [1]        weight_scale_2

Hopper has no FP4 tensor cores, so the weight is widened to bf16 in registers and multiplied on the
bf16 tensor cores with an fp32 accumulator (W4A16). The widening is exact: an E2M1 value (2
significant bits) times an E4M3 scale (4 bits) fits bf16's 8, so

    w_bf16 = e2m1 * block_scale * 2^-9          (exact, no rounding)
    y      = (sum_k x * w_bf16) * (global_scale * 2^9)

The 2^-9 keeps ``block_scale * 2^117`` (see ``_E2M1_ASM``) inside bf16's range; the global scale and the
2^9 are applied once to the fp32 accumulator. One weight tile in registers, as the kernels see it:

    bytes  [BN, G, 8] uint8  (G = BK / 16 scale groups, 8 bytes = 16 codes each)
      -> lo, hi [BN, G, 8] bf16 (k 16g+j, 16g+8+j) -> join, permute -> [BN, G, 2, 8] -> [BN, BK]

The repacked order puts the codes of consecutive k in consecutive lanes of the dequantizer's output
registers (pairs (k, k+1) in one 32-bit register, as the MMA wants them): in the decode loop that cut
the byte shuffles (PRMT) from 202 to 90 per 128 weights (sm_90 SASS, BN=64, BK=256, one stage).

Two dequantizers: ``USE_ASM`` (GPU) turns 4 bytes into 8 bf16 with a few bit operations and one packed
bf16 multiply per pair (PTX below); the portable one (Triton's interpreter, CPU) does the same math with
integer arithmetic in fp32. Scales arrive as raw uint8 bits either way (masked lanes load 0, and the
interpreter has no fp8 type).
"""

from __future__ import annotations

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait

# bf16 bits of (block_scale * 2^117) = S multiply E2M1 codes placed straight into bf16 bits (value *
# 2^-126, possibly subnormal): product = e2m1 * block_scale * 2^-9, always a normal bf16.
_SCALE_BIAS = tl.constexpr(2.0**117)
# The fp32 accumulator gets global_scale * 2^9 back.
_ACC_BIAS = tl.constexpr(2.0**9)

# One invocation: $4 = 4 packed bytes b0..b3 (8 codes); $5, $6 = S(b0)|S(b1), S(b2)|S(b3) as bf16x2.
# Out: $0, $1 = values of the LOW nibbles of b0|b1, b2|b3; $2, $3 = those of the HIGH nibbles.
# prmt moves byte b0 to bits 15:8 and b1 to bits 31:24, so a high nibble sits in bits 15:12 of its
# 16-bit lane: sign bit 15 is already bf16's sign, magnitude bits 14:12 shift to 8:6 (exponent LSBs +
# first mantissa bit), which reads as e2m1 * 2^-126; a shift left by 4 does the same for low nibbles.
_E2M1_ASM = tl.constexpr("""
{
.reg .b32 w<2>, m<2>, s<2>;
prmt.b32 w0, $4, 0, 0x1404;
prmt.b32 w1, $4, 0, 0x3424;
and.b32 m0, w0, 0x70007000;
and.b32 m1, w1, 0x70007000;
shr.b32 m0, m0, 6;
shr.b32 m1, m1, 6;
and.b32 s0, w0, 0x80008000;
and.b32 s1, w1, 0x80008000;
or.b32 m0, m0, s0;
or.b32 m1, m1, s1;
mul.rn.bf16x2 $2, m0, $5;
mul.rn.bf16x2 $3, m1, $6;
shl.b32 w0, w0, 4;
shl.b32 w1, w1, 4;
and.b32 m0, w0, 0x70007000;
and.b32 m1, w1, 0x70007000;
shr.b32 m0, m0, 6;
shr.b32 m1, m1, 6;
and.b32 s0, w0, 0x80008000;
and.b32 s1, w1, 0x80008000;
or.b32 m0, m0, s0;
or.b32 m1, m1, s1;
mul.rn.bf16x2 $0, m0, $5;
mul.rn.bf16x2 $1, m1, $6;
}
""")


@triton.jit
def _e2m1_value(code):
    """E2M1 code (int32, 0..15) -> float32 value, by integer arithmetic (portable path)."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    # 4 * |value|: subnormal (e == 0) -> 2m, normal -> (2 + m) << e
    quad = tl.where(e == 0, 2 * m, (2 + m) << e)
    val = quad.to(tl.float32) * 0.25
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def _e4m3_bits_value(bits):
    """float8_e4m3fn bits (uint8) -> float32, by integer arithmetic (portable path; scales are >= 0)."""
    b = bits.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    # 1024 * value: subnormal -> 2m, normal -> (8 + m) << e
    val = tl.where(e == 0, 2 * m, (8 + m) << e).to(tl.float32) * (1.0 / 1024.0)
    return tl.where((b & 128) != 0, -val, val)


@triton.jit
def _dequant_tile(
    b_w,
    b_s,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    REPACKED: tl.constexpr,
):
    """bytes [BN, G, 8] uint8 + scales [BN, G] (raw float8_e4m3fn bits, uint8) -> [BN, BK].

    Returns e2m1 * block_scale * 2^-9 in DOT_DTYPE (bf16 when USE_ASM).
    """
    if USE_ASM:
        b_sb = (b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _SCALE_BIAS).to(
            tl.bfloat16
        )  # [BN, G], exact
        b_s3 = tl.broadcast_to(b_sb[:, :, None], b_w.shape)
        b_lo, b_hi = tl.inline_asm_elementwise(
            asm=_E2M1_ASM,
            constraints="=r,=r,=r,=r,r,r,r",
            args=[b_w, b_s3],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        b_s3 = (_e4m3_bits_value(b_s) * (1.0 / _ACC_BIAS))[:, :, None]  # [BN, G, 1]
        b_c = b_w.to(tl.int32)
        b_lo = (_e2m1_value(b_c & 15) * b_s3).to(DOT_DTYPE)
        b_hi = (_e2m1_value(b_c >> 4) * b_s3).to(DOT_DTYPE)
    if REPACKED:
        # [BN, G, 8, 2] -> [BN, G, 2, 8] -> [BN, BK]: k = 16 g + 8 (0 for lo, 1 for hi) + j
        return tl.reshape(tl.permute(tl.join(b_lo, b_hi), (0, 1, 3, 2)), (BLOCK_N, BLOCK_K))
    else:
        # checkpoint order: [BN, G, 8, 2] -> [BN, BK]: k = 16 g + 2 j + (0 for lo, 1 for hi)
        return tl.reshape(tl.join(b_lo, b_hi), (BLOCK_N, BLOCK_K))


@triton.jit
def _load_tiles(p_w_tile, p_s_tile, p_x_tile, kg, kg_stop, mask_n, mask_m, o_g, o_k):
    """One K step's codes [BN, G, 8], scales [BN, G] and x^T [BK, BM], zeros outside N, M and kg_stop."""
    mask_g = (kg + o_g) < kg_stop
    b_w = tl.load(p_w_tile + kg * 8, mask=mask_n[:, None, None] & mask_g[None, :, None], other=0)
    b_s = tl.load(p_s_tile + kg, mask=mask_n[:, None] & mask_g[None, :], other=0)
    b_x = tl.load(
        p_x_tile + kg * 16, mask=((kg * 16 + o_k) < kg_stop * 16)[:, None] & mask_m[None, :], other=0.0
    )
    return b_w, b_s, b_x


@triton.jit
def _mainloop(
    p_x,
    p_w,
    p_s,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    pid_m,
    pid_n,
    kg_start,
    kg_stop,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    REPACKED: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """acc [BN, BM] fp32 = W[rows of pid_n, k-groups kg_start..kg_stop) @ x[rows of pid_m, same k]^T.

    The weight is the MMA's A operand (y^T = W x^T, "swap AB"): its rows fill the 64-row side of a
    Hopper MMA straight from registers, and the tokens sit on the narrow side (BLOCK_M >= 16).
    """
    G: tl.constexpr = BLOCK_K // 16
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_g = tl.arange(0, G)
    o_j = tl.arange(0, 8)
    o_k = tl.arange(0, BLOCK_K)
    mask_n = o_n < N
    mask_m = o_m < M
    o_n64 = o_n.to(tl.int64)

    p_w_tile = (
        p_w + o_n64[:, None, None] * stride_wn + (o_g[None, :, None] * 8 + o_j[None, None, :])
    )  # [BN, G, 8]
    p_s_tile = p_s + o_n64[:, None] * stride_sn + o_g[None, :]  # [BN, G]
    p_x_tile = p_x + o_m[None, :].to(tl.int64) * stride_xm + o_k[:, None]  # [BK, BM]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PREFETCH:
        # Register double buffer: the next tile's loads are in flight while this one is widened.
        b_w, b_s, b_x = _load_tiles(p_w_tile, p_s_tile, p_x_tile, kg_start, kg_stop, mask_n, mask_m, o_g, o_k)
        for kg in range(kg_start, kg_stop, G):
            n_w, n_s, n_x = _load_tiles(
                p_w_tile, p_s_tile, p_x_tile, kg + G, kg_stop, mask_n, mask_m, o_g, o_k
            )
            b_wt = _dequant_tile(b_w, b_s, BLOCK_N, BLOCK_K, USE_ASM, b_x.dtype, REPACKED)  # [BN, BK]
            acc = tl.dot(b_wt, b_x, acc)
            b_w, b_s, b_x = n_w, n_s, n_x
    else:
        for kg in range(kg_start, kg_stop, G):
            b_w, b_s, b_x = _load_tiles(p_w_tile, p_s_tile, p_x_tile, kg, kg_stop, mask_n, mask_m, o_g, o_k)
            b_wt = _dequant_tile(b_w, b_s, BLOCK_N, BLOCK_K, USE_ASM, b_x.dtype, REPACKED)  # [BN, BK]
            acc = tl.dot(b_wt, b_x, acc)
    return acc


@triton.jit
def _store_yt(p_y, b_acc, alpha, M, N, stride_ym, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[rows of pid_m, cols of pid_n] = (acc^T * alpha), acc [BN, BM]."""
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p_y_tile = p_y + o_m[None, :].to(tl.int64) * stride_ym + o_n[:, None]  # [BN, BM]
    tl.store(p_y_tile, (b_acc * alpha).to(p_y.dtype.element_ty), mask=(o_n < N)[:, None] & (o_m < M)[None, :])


@triton.jit
def _nvfp4_gemv_kernel(
    p_x,
    p_w,
    p_s,
    p_gs,
    p_y,
    p_ws,
    p_cnt,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    REPACKED: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Decode (M <= BLOCK_M): program (pid_n, pid_k) streams BLOCK_N weight rows over 1/SPLIT_K of K.

    With SPLIT_K > 1 each program writes its fp32 partial to p_ws [SPLIT_K, n_blocks, BN, BM]; the last
    of a row block's SPLIT_K programs to arrive (counted in p_cnt[pid_n], an int32 that starts at 0 and
    is reset to 0 by that last program) adds the partials and writes y, all in this one launch.
    """
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    kg_total = K // 16
    # k groups per split, a whole number of BLOCK_K tiles
    kg_split = tl.cdiv(tl.cdiv(kg_total, SPLIT_K), BLOCK_K // 16) * (BLOCK_K // 16)
    kg_start = pid_k * kg_split
    kg_stop = tl.minimum(kg_start + kg_split, kg_total)
    acc = _mainloop(
        p_x,
        p_w,
        p_s,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_sn,
        0,
        pid_n,
        kg_start,
        kg_stop,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        USE_ASM,
        REPACKED,
        PREFETCH,
    )
    alpha = tl.load(p_gs) * _ACC_BIAS
    if SPLIT_K == 1:
        _store_yt(p_y, acc, alpha, M, N, stride_ym, 0, pid_n, BLOCK_M, BLOCK_N)
    else:
        o_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [BN, BM]
        n_blocks = tl.num_programs(0)
        p_part = p_ws + (pid_n.to(tl.int64) * BLOCK_N * BLOCK_M) + o_tile
        tl.store(p_part + pid_k.to(tl.int64) * n_blocks * BLOCK_N * BLOCK_M, acc)
        # every thread's partial is stored before the release below
        tl.debug_barrier()
        arrived = tl.atomic_add(p_cnt + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for i in range(SPLIT_K):
                # .cg: read L2, not this SM's (incoherent) L1
                total += tl.load(p_part + i * n_blocks * BLOCK_N * BLOCK_M, cache_modifier=".cg")
            _store_yt(p_y, total, alpha, M, N, stride_ym, 0, pid_n, BLOCK_M, BLOCK_N)
            tl.atomic_xchg(p_cnt + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _nvfp4_gemm_kernel(
    p_x,
    p_w,
    p_s,
    p_gs,
    p_y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    REPACKED: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Prefill (large M): one [BM tokens, BN rows] output tile per program over all of K.

    Programs that share a weight tile (same pid_n, all pid_m) are numbered consecutively, so a weight
    tile is read from HBM about once and re-read from L2 by its neighbours; x stays in L2.
    """
    pdl_wait(PDL)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    acc = _mainloop(
        p_x,
        p_w,
        p_s,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_sn,
        pid_m,
        pid_n,
        0,
        K // 16,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        USE_ASM,
        REPACKED,
        PREFETCH,
    )
    _store_yt(p_y, acc, tl.load(p_gs) * _ACC_BIAS, M, N, stride_ym, pid_m, pid_n, BLOCK_M, BLOCK_N)


# E2M1 value in bf16 (exact): the dequantizer's "scale" operand set to 2^126 undoes its 2^-126.
_E2M1_UNIT = tl.constexpr(2.0**126)


@triton.jit
def _x_offsets(o_g, o_j, REPACKED: tl.constexpr):
    """Offsets [G, 8] into x of the k that byte (g, j) of a code tile holds in its low / high nibble."""
    if REPACKED:
        o_xlo = o_g[:, None] * 16 + o_j[None, :]  # byte 8g+j: k 16g+j (low), 16g+8+j (high)
        return o_xlo, o_xlo + 8
    else:
        o_xlo = o_g[:, None] * 16 + 2 * o_j[None, :]  # byte i: k 2i (low), 2i+1 (high)
        return o_xlo, o_xlo + 1


@triton.jit
def _gemv_widen(b_w, b_s, USE_ASM: tl.constexpr):
    """Codes [BN, G, 8] uint8 + scale bits [BN, G] -> exact E2M1 values of the low and high nibbles
    (fp32 [BN, G, 8] each) and the block scales (fp32 [BN, G])."""
    if USE_ASM:
        b_one = tl.full(b_w.shape, _E2M1_UNIT, tl.bfloat16)
        b_lo, b_hi = tl.inline_asm_elementwise(
            asm=_E2M1_ASM,
            constraints="=r,=r,=r,=r,r,r,r",
            args=[b_w, b_one],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
        return b_lo.to(tl.float32), b_hi.to(tl.float32), b_s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        b_c = b_w.to(tl.int32)
        return _e2m1_value(b_c & 15), _e2m1_value(b_c >> 4), _e4m3_bits_value(b_s)


@triton.jit
def _fma_rows(w_lo, w_hi, p_xm, o_xlo, o_xhi, mask_x, EVEN_K: tl.constexpr):
    """sum_j over one 16-k group, in fp32: [BN, G] = sum_j w_lo * x[o_xlo] + w_hi * x[o_xhi] (x [G, 8])."""
    if EVEN_K:
        x_lo = tl.load(p_xm + o_xlo).to(tl.float32)
        x_hi = tl.load(p_xm + o_xhi).to(tl.float32)
    else:
        x_lo = tl.load(p_xm + o_xlo, mask=mask_x, other=0.0).to(tl.float32)
        x_hi = tl.load(p_xm + o_xhi, mask=mask_x, other=0.0).to(tl.float32)
    return tl.sum(w_lo * x_lo[None, :, :] + w_hi * x_hi[None, :, :], axis=2)


@triton.jit
def _nvfp4_gemv_fma_kernel(
    p_x,
    p_w,
    p_s,
    p_gs,
    p_y,
    p_ws,
    p_cnt,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    REPACKED: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """Small-M decode on the CUDA cores (M == BLOCK_M <= 8): no tensor cores, no [BK, 16] x tile.

    Program (pid_n, pid_k) streams BLOCK_N weight rows over 1/SPLIT_K of K as [BN, G, 8] byte tiles (each
    thread 8 contiguous bytes = one 16-code scale group, loaded in one piece), widens them to exact E2M1
    values, multiplies by x in fp32 and sums the group inside the thread; the block scale then multiplies
    the group's sum once (one fp32 FMA per 16 weights). Rows past N are clamped for the loads (no masks
    on the weight stream); with EVEN_K (K a multiple of SPLIT_K * BLOCK_K) there are no K masks either.
    Split-K partials [SPLIT_K, n_blocks, BM, BN] are reduced by the last program to arrive (as in
    ``_nvfp4_gemv_kernel``).
    """
    pdl_wait(PDL)
    G: tl.constexpr = BLOCK_K // 16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    kg_total = K // 16
    kg_split = tl.cdiv(tl.cdiv(kg_total, SPLIT_K), G) * G
    kg_start = pid_k * kg_split
    kg_stop = tl.minimum(kg_start + kg_split, kg_total)

    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_nl = tl.minimum(o_n, N - 1).to(tl.int64)  # clamped rows: loads need no mask
    o_g = tl.arange(0, G)
    o_j = tl.arange(0, 8)
    p_w_tile = p_w + o_nl[:, None, None] * stride_wn + (o_g[None, :, None] * 8 + o_j[None, None, :])
    p_s_tile = p_s + o_nl[:, None] * stride_sn + o_g[None, :]
    o_xlo, o_xhi = _x_offsets(o_g, o_j, REPACKED)

    acc0 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    acc5 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    acc6 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    acc7 = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    if PREFETCH:
        n_w, n_s = _gemv_load(p_w_tile, p_s_tile, kg_start, kg_stop, o_g, EVEN_K)
    for kg in range(kg_start, kg_stop, G):
        if PREFETCH:
            # register double buffer: the next tile's loads are in flight while this one is used
            b_w, b_s = n_w, n_s
            if EVEN_K:
                kg_next = tl.minimum(kg + G, kg_stop - G)  # the last step re-reads a valid tile
            else:
                kg_next = kg + G  # masked past kg_stop
            n_w, n_s = _gemv_load(p_w_tile, p_s_tile, kg_next, kg_stop, o_g, EVEN_K)
        else:
            b_w, b_s = _gemv_load(p_w_tile, p_s_tile, kg, kg_stop, o_g, EVEN_K)
        if EVEN_K:
            mask_x = o_g[:, None] >= 0  # unused
        else:
            mask_x = ((kg + o_g) < kg_stop)[:, None]
        w_lo, w_hi, s = _gemv_widen(b_w, b_s, USE_ASM)
        p_xk = p_x + kg * 16
        acc0 += _fma_rows(w_lo, w_hi, p_xk, o_xlo, o_xhi, mask_x, EVEN_K) * s
        if BLOCK_M > 1:
            acc1 += _fma_rows(w_lo, w_hi, p_xk + stride_xm, o_xlo, o_xhi, mask_x, EVEN_K) * s
        if BLOCK_M > 2:
            acc2 += _fma_rows(w_lo, w_hi, p_xk + 2 * stride_xm, o_xlo, o_xhi, mask_x, EVEN_K) * s
        if BLOCK_M > 3:
            acc3 += _fma_rows(w_lo, w_hi, p_xk + 3 * stride_xm, o_xlo, o_xhi, mask_x, EVEN_K) * s
        if BLOCK_M > 4:
            acc4 += _fma_rows(w_lo, w_hi, p_xk + 4 * stride_xm, o_xlo, o_xhi, mask_x, EVEN_K) * s
        if BLOCK_M > 5:
            acc5 += _fma_rows(w_lo, w_hi, p_xk + 5 * stride_xm, o_xlo, o_xhi, mask_x, EVEN_K) * s
        if BLOCK_M > 6:
            acc6 += _fma_rows(w_lo, w_hi, p_xk + 6 * stride_xm, o_xlo, o_xhi, mask_x, EVEN_K) * s
        if BLOCK_M > 7:
            acc7 += _fma_rows(w_lo, w_hi, p_xk + 7 * stride_xm, o_xlo, o_xhi, mask_x, EVEN_K) * s

    alpha = tl.load(p_gs)
    mask_n = o_n < N
    if SPLIT_K == 1:
        _store_row(p_y, tl.sum(acc0, axis=1) * alpha, 0, stride_ym, o_n, mask_n, BLOCK_M)
        _store_row(p_y, tl.sum(acc1, axis=1) * alpha, 1, stride_ym, o_n, mask_n, BLOCK_M)
        _store_row(p_y, tl.sum(acc2, axis=1) * alpha, 2, stride_ym, o_n, mask_n, BLOCK_M)
        _store_row(p_y, tl.sum(acc3, axis=1) * alpha, 3, stride_ym, o_n, mask_n, BLOCK_M)
        _store_row(p_y, tl.sum(acc4, axis=1) * alpha, 4, stride_ym, o_n, mask_n, BLOCK_M)
        _store_row(p_y, tl.sum(acc5, axis=1) * alpha, 5, stride_ym, o_n, mask_n, BLOCK_M)
        _store_row(p_y, tl.sum(acc6, axis=1) * alpha, 6, stride_ym, o_n, mask_n, BLOCK_M)
        _store_row(p_y, tl.sum(acc7, axis=1) * alpha, 7, stride_ym, o_n, mask_n, BLOCK_M)
    else:
        n_blocks = tl.num_programs(0)
        o_b = tl.arange(0, BLOCK_N)
        p_part = p_ws + pid_n.to(tl.int64) * (BLOCK_M * BLOCK_N) + o_b  # + m * BN + i * n_blocks * BM * BN
        slab = n_blocks * BLOCK_M * BLOCK_N
        p_mine = p_part + pid_k.to(tl.int64) * slab
        _store_part(p_mine, tl.sum(acc0, axis=1), 0, BLOCK_N, BLOCK_M)
        _store_part(p_mine, tl.sum(acc1, axis=1), 1, BLOCK_N, BLOCK_M)
        _store_part(p_mine, tl.sum(acc2, axis=1), 2, BLOCK_N, BLOCK_M)
        _store_part(p_mine, tl.sum(acc3, axis=1), 3, BLOCK_N, BLOCK_M)
        _store_part(p_mine, tl.sum(acc4, axis=1), 4, BLOCK_N, BLOCK_M)
        _store_part(p_mine, tl.sum(acc5, axis=1), 5, BLOCK_N, BLOCK_M)
        _store_part(p_mine, tl.sum(acc6, axis=1), 6, BLOCK_N, BLOCK_M)
        _store_part(p_mine, tl.sum(acc7, axis=1), 7, BLOCK_N, BLOCK_M)
        # every thread's partial is stored before the release below
        tl.debug_barrier()
        arrived = tl.atomic_add(p_cnt + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            for m in tl.static_range(BLOCK_M):
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for i in range(SPLIT_K):
                    # .cg: read L2, not this SM's (incoherent) L1
                    total += tl.load(p_part + i * slab + m * BLOCK_N, cache_modifier=".cg")
                tl.store(p_y + m * stride_ym + o_n, (total * alpha).to(p_y.dtype.element_ty), mask=mask_n)
            tl.atomic_xchg(p_cnt + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _gemv_load(p_w_tile, p_s_tile, kg, kg_stop, o_g, EVEN_K: tl.constexpr):
    """Codes [BN, G, 8] and scale bits [BN, G] of k groups kg.. (masked past kg_stop unless EVEN_K)."""
    if EVEN_K:
        b_w = tl.load(p_w_tile + kg * 8)
        b_s = tl.load(p_s_tile + kg)
    else:
        mask_g = (kg + o_g) < kg_stop
        b_w = tl.load(p_w_tile + kg * 8, mask=mask_g[None, :, None], other=0)
        b_s = tl.load(p_s_tile + kg, mask=mask_g[None, :], other=0)
    return b_w, b_s


@triton.jit
def _store_row(p_y, v, m: tl.constexpr, stride_ym, o_n, mask_n, BLOCK_M: tl.constexpr):
    if m < BLOCK_M:
        tl.store(p_y + m * stride_ym + o_n, v.to(p_y.dtype.element_ty), mask=mask_n)


@triton.jit
def _store_part(p_mine, v, m: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    if m < BLOCK_M:
        tl.store(p_mine + m * BLOCK_N, v)
