"""Triton kernels behind :mod:`vibeqwen_kernels.moe.fused` (private: call the wrappers there).

Four kernels, launched in this order by ``fused_moe`` (the router kernel runs before, on its own):

* ``_router_topk_kernel``: fp32 softmax over E routed logits, top-k, renormalise; appends the shared
  expert (id E, weight sigmoid(logit E)).
* ``_moe_count_kernel``, ``_moe_scan_kernel``, ``_moe_scatter_kernel``: group the T*k' (token, slot) pairs
  by expert, each group padded to a multiple of BLOCK_M: per-chunk expert histograms, a scan of them over a few
  programs (group starts, block experts, sentinels), then every chunk scatters its pairs (a group keeps the pair
  order; no atomics). ``_moe_align_small_kernel`` does the same for few pairs (decode) in one program,
  all-to-all in registers.
* ``_moe_gemm1_kernel``: per (block of BLOCK_M pairs of one expert, BLOCK_N columns of I):
  h = silu(x W_gate^T) * (x W_up^T), gate and up in the same program.
* ``_moe_silu_mul_kernel`` (only with split-K GEMM1): sums GEMM1's fp32 split partials in split order,
  applies the global scales and silu(g) * u.
* ``_moe_gemm2_kernel``: y_pair = (h W_down^T) * topk_weight[pair], one row per pair (split-K: fp32
  partials of h W_down^T per split, weighted later).
* ``_moe_gemv1_kernel`` / ``_moe_gemv2_kernel`` (decode, few pairs): the same two GEMMs on the CUDA
  cores, one program per (pair, BLOCK_N columns, K split), the expert read from topk_ids directly: no
  alignment launch, no [BK, 16] activation tile, no empty blocks. They write the same intermediates as the
  MMA kernels (h, or the fp32 split partials), so the silu-mul and slot-sum kernels finish both paths.
* ``_moe_sum_kernel``: out[t] = sum over the k' slots of y_pair[t * k' + slot] in fp32 (deterministic);
  with split-K GEMM2 it also sums the splits and applies the topk weights.

Weights are NVFP4 (see ``vibeqwen_kernels.nvfp4._linear_kernels`` for the layout and the exact widening
to bf16 that ``_dequant_tile`` does). The weight tile is the MMA's A operand ("swap AB", acc is
[BLOCK_N, BLOCK_M]): in decode a block holds ~1 real pair, and BLOCK_M = 16 keeps the MMA's narrow side
small while the weight rows fill its wide side.
"""

from __future__ import annotations

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait
from vibeqwen_kernels.nvfp4._linear_kernels import (
    _ACC_BIAS,
    _dequant_tile,
    _fma_rows,
    _gemv_load,
    _gemv_widen,
    _x_offsets,
)


@triton.jit
def _router_topk_kernel(
    p_logits,
    p_w,
    p_ids,
    T,
    E,
    stride_lt,
    stride_wt,
    stride_it,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows [pid * BLOCK_T, +BLOCK_T): softmax(logits[:, :E]) top-k renormalised (+ shared column)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    o_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    o_e = tl.arange(0, BLOCK_E)
    mask_t = o_t < T
    mask_e = o_e < E
    o_t64 = o_t.to(tl.int64)
    lg = tl.load(
        p_logits + o_t64[:, None] * stride_lt + o_e[None, :],
        mask=mask_t[:, None] & mask_e[None, :],
        other=float("-inf"),
    ).to(tl.float32)
    mx = tl.max(lg, axis=1)
    mx = tl.where(mask_t, mx, 0.0)
    ex = tl.exp(lg - mx[:, None])
    ex = tl.where(mask_e[None, :], ex, 0.0)
    denom = tl.where(mask_t, tl.sum(ex, axis=1), 1.0)  # rows past T: avoid 0/0
    prob = ex / denom[:, None]
    # selection works on the probabilities (as torch.topk on softmax does); taken / padded lanes get -1
    prob = tl.where(mask_e[None, :], prob, -1.0)
    o_c = tl.arange(0, BLOCK_C)  # output columns (TOP_K, plus 1 for the shared expert)
    vals = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    idxs = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(prob, axis=1)
        # lowest index among equal maxima
        idx = tl.min(tl.where(prob == best[:, None], o_e[None, :], BLOCK_E), axis=1)
        vals = tl.where(o_c[None, :] == j, best[:, None], vals)
        idxs = tl.where(o_c[None, :] == j, idx[:, None], idxs)
        prob = tl.where(o_e[None, :] == idx[:, None], -1.0, prob)
    total = tl.sum(vals, axis=1)  # columns >= TOP_K are still 0
    vals = vals / tl.where(total > 0.0, total, 1.0)[:, None]
    if SHARED:
        g = tl.load(p_logits + o_t64 * stride_lt + E, mask=mask_t, other=0.0).to(tl.float32)
        vals = tl.where(o_c[None, :] == TOP_K, (1.0 / (1.0 + tl.exp(-g)))[:, None], vals)
        idxs = tl.where(o_c[None, :] == TOP_K, E, idxs)
    mask = mask_t[:, None] & (o_c[None, :] < TOP_K + SHARED)
    tl.store(p_w + o_t64[:, None] * stride_wt + o_c[None, :], vals, mask=mask)
    tl.store(p_ids + o_t64[:, None] * stride_it + o_c[None, :], idxs, mask=mask)


@triton.jit
def _moe_count_kernel(p_ids, p_counts, n_pairs, E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program c: p_counts[c, e] = pairs among [c * CHUNK, +CHUNK) routed to expert e (int32 [n_chunks,
    E_PAD]). Lanes past n_pairs count into bin E_PAD - 1, which is not an expert (E' < E_PAD)."""
    pdl_wait(PDL)
    c = tl.program_id(0)
    o = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(p_ids + o, mask=o < n_pairs, other=E_PAD - 1)
    tl.store(p_counts + c * E_PAD + tl.arange(0, E_PAD), tl.histogram(ids, E_PAD))


@triton.jit
def _moe_scan_kernel(
    p_counts,
    p_offsets,
    p_start,
    p_sorted,
    p_bexp,
    p_npad,
    n_pairs,
    n_chunks,
    E,
    P_MAX,
    B_MAX,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK_B: tl.constexpr,
    CHUNK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    """After ``_moe_count_kernel``: p_offsets[c, e] = expert e's pairs in chunks before c (exclusive scan over
    chunks), p_start[e] = start of e's padded group (groups in expert order), the block experts (-1 past the
    last group), num_padded, and the sentinel n_pairs in every group's padding tail and from num_padded on.
    ``_moe_scatter_kernel`` then writes the real entries (other positions).
    Every program sums the whole count matrix (each needs all group starts), then writes its share: program g
    the experts of column slice g (offsets, start, block experts, padding tails) and every G-th CHUNK_P-slice of
    the two tails past the last group. (One program writing everything took 12 us at 1k tokens on the H200.)"""
    pdl_wait(PDL)
    g = tl.program_id(0)
    G = tl.num_programs(0)
    o_e = tl.arange(0, E_PAD)
    mine = (o_e * G) // E_PAD == g
    run = tl.zeros((E_PAD,), dtype=tl.int32)
    for r0 in range(0, n_chunks, ROWS):
        o_r = r0 + tl.arange(0, ROWS)
        m_r = (o_r < n_chunks)[:, None]
        ptr = o_r[:, None] * E_PAD + o_e[None, :]
        tile = tl.load(p_counts + ptr, mask=m_r, other=0)
        tl.store(p_offsets + ptr, tl.cumsum(tile, 0) - tile + run[None, :], mask=m_r & mine[None, :])
        run += tl.sum(tile, 0)
    counts = tl.where(o_e < E, run, 0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, 0) - padded
    total = tl.sum(padded, 0)
    tl.store(p_start + o_e, start, mask=mine)
    if g == 0:
        tl.store(p_npad, total)
    # block experts: expert e owns blocks [start_e / BLOCK_M, end_e / BLOCK_M), written CHUNK_B per expert at once
    nb = tl.where(mine, padded // BLOCK_M, 0)
    o_j = tl.arange(0, CHUNK_B)
    for j0 in range(0, tl.max(nb, 0), CHUNK_B):
        jj = j0 + o_j[None, :]
        tl.store(p_bexp + (start // BLOCK_M)[:, None] + jj, o_e[:, None] + jj * 0, mask=jj < nb[:, None])
    minus1 = tl.full((CHUNK_P,), -1, tl.int32)
    for b0 in range(total // BLOCK_M + g * CHUNK_P, B_MAX, G * CHUNK_P):
        o_b = b0 + tl.arange(0, CHUNK_P)
        tl.store(p_bexp + o_b, minus1, mask=o_b < B_MAX)
    # sentinels: every group's padding tail ([E_PAD, 16] tiles), then everything from total on
    TAIL: tl.constexpr = 16
    sentinel_t = tl.zeros((E_PAD, TAIL), dtype=tl.int32) + n_pairs
    for t0 in tl.static_range(0, BLOCK_M, TAIL):
        o_t = t0 + tl.arange(0, TAIL)[None, :]
        tail = ((counts[:, None] + o_t) < padded[:, None]) & mine[:, None]
        tl.store(p_sorted + (start + counts)[:, None] + o_t, sentinel_t, mask=tail)
    sentinel_p = tl.zeros((CHUNK_P,), dtype=tl.int32) + n_pairs
    for c in range(total + g * CHUNK_P, P_MAX, G * CHUNK_P):
        o = c + tl.arange(0, CHUNK_P)
        tl.store(p_sorted + o, sentinel_p, mask=o < P_MAX)


@triton.jit
def _moe_scatter_kernel(
    p_ids, p_offsets, p_start, p_sorted, n_pairs, E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr
):
    """Program c, after ``_moe_scan_kernel``: pair p of chunk c goes to p_sorted[start[e] + offsets[c, e] +
    (earlier pairs of chunk c with expert e)], e its expert: a group keeps the pair order."""
    pdl_wait(PDL)
    c = tl.program_id(0)
    o_i = tl.arange(0, CHUNK)
    o = c * CHUNK + o_i
    m = o < n_pairs
    ids = tl.load(p_ids + o, mask=m, other=-1)
    same = (ids[:, None] == ids[None, :]) & m[None, :]
    rank = tl.sum((same & (o_i[None, :] < o_i[:, None])).to(tl.int32), axis=1)
    e = tl.where(m, ids, 0)
    dest = tl.load(p_start + e, mask=m, other=0) + tl.load(p_offsets + c * E_PAD + e, mask=m, other=0) + rank
    tl.store(p_sorted + dest, o, mask=m)


@triton.jit
def _moe_align_small_kernel(
    p_ids,
    p_sorted,
    p_bexp,
    p_npad,
    n_pairs,
    P_MAX,
    B_MAX,
    NP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program, n_pairs <= NP (small, e.g. decode): the same outputs as the chunked kernels without
    atomics, workspace or work proportional to E. Pairs are compared all-to-all ([NP, NP] in registers):
    rank of pair i = earlier pairs with the same expert (so a group keeps the pair order), group start =
    sum of the padded sizes of the groups of smaller experts. The outputs are first filled (sentinel n_pairs,
    block expert -1), then, after a barrier, every pair stores itself at start + rank and the first pair of
    each group stores its expert into the group's blocks."""
    pdl_wait(PDL)
    o_i = tl.arange(0, NP)
    m_i = o_i < n_pairs
    ids = tl.load(p_ids + o_i, mask=m_i, other=-1)
    same = (ids[:, None] == ids[None, :]) & m_i[:, None] & m_i[None, :]
    rank = tl.sum((same & (o_i[None, :] < o_i[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    first = (rank == 0) & m_i
    padded = (count + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    before = first[None, :] & (ids[None, :] < ids[:, None])
    start = tl.sum(tl.where(before, padded[None, :], 0), axis=1)
    total = tl.sum(tl.where(first, padded, 0), axis=0)
    tl.store(p_npad, total)
    sentinel = tl.zeros((CHUNK,), dtype=tl.int32) + n_pairs
    for c in range(0, P_MAX, CHUNK):
        o_p = c + tl.arange(0, CHUNK)
        tl.store(p_sorted + o_p, sentinel, mask=o_p < P_MAX)
    minus1 = tl.full((CHUNK,), -1, tl.int32)
    for c in range(0, B_MAX, CHUNK):
        o_b = c + tl.arange(0, CHUNK)
        tl.store(p_bexp + o_b, minus1, mask=o_b < B_MAX)
    tl.debug_barrier()  # the fills above land before the stores below (same addresses, other threads)
    tl.store(p_sorted + start + rank, o_i, mask=m_i)
    nb = tl.where(first, padded // BLOCK_M, 0)
    for j in range(0, tl.max(nb, 0)):
        tl.store(p_bexp + start // BLOCK_M + j, ids, mask=j < nb)


@triton.jit
def _k_split(K, G: tl.constexpr, SPLIT_K: tl.constexpr, pid_k):
    """[kg_lo, kg_hi): the 16-wide k groups split pid_k of SPLIT_K sums, whole BLOCK_K (G groups) tiles each;
    a split past the end gets an empty range."""
    kg_total = K // 16
    if SPLIT_K == 1:
        return 0, kg_total
    else:
        kg_per = tl.cdiv(tl.cdiv(kg_total, G), SPLIT_K) * G
        kg_lo = pid_k * kg_per
        return kg_lo, tl.minimum(kg_lo + kg_per, kg_total)


@triton.jit
def _load_w(p_tile, kg, mask_n, mask_g, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(p_tile + kg)
    else:
        return tl.load(p_tile + kg, mask=mask_n & mask_g, other=0)


@triton.jit
def _moe_gemm1_kernel(
    p_x,
    p_w,
    p_s,
    p_gs,
    p_h,
    p_ws,
    p_sorted,
    p_bexp,
    n_pairs,
    N_I,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ge,
    stride_hm,
    stride_wss,
    stride_wsm,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr,
    USE_ASM: tl.constexpr,
    REPACKED: tl.constexpr,
    SPLIT_GU: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """h[pair, n] = silu(g) * u, g/u = x[pair // TOPK] . W_gate/up[e, n], for the BLOCK_M pairs of block
    pid 0 (expert e = p_bexp[pid 0]; -1: nothing to do) and columns n of block pid 1.

    SPLIT_GU: gate and up rows in separate programs (one accumulator each, half the registers of the fused
    pair): block pid 1 covers rows [pid 1 * BLOCK_N, +BLOCK_N) of the 2 * N_I stacked gate|up rows, and the
    raw sums always go to p_ws as with SPLIT_K > 1 (any SPLIT_K, 1 included); ``_moe_silu_mul_kernel``
    finishes (gate rows are 0..N_I-1 and up rows N_I..2 N_I-1 of both W and the workspace row, so a block may
    straddle the two).

    Weight rows of expert e: gate n in [0, N_I), up N_I + n. EVEN: K % (SPLIT_K * BLOCK_K) == 0 and
    N_I % BLOCK_N == 0 (no weight masks).

    SPLIT_K > 1 (grid axis 2 = split s): the program sums only K blocks [s * nb, (s + 1) * nb) (nb =
    cdiv(cdiv(K, BLOCK_K), SPLIT_K); a split past the end sums nothing) and stores the raw fp32 sums to
    p_ws[s, pair, 0, n] (gate) and p_ws[s, pair, 1, n] (up) (strides stride_wss, stride_wsm; the up half
    at + N_I); ``_moe_silu_mul_kernel`` finishes. p_h is not touched then. SPLIT_K == 1: p_ws unused.
    """
    pdl_wait(PDL)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    G: tl.constexpr = BLOCK_K // 16
    e = tl.load(p_bexp + pid_b)
    if e >= 0:
        kg_lo, kg_hi = _k_split(K, G, SPLIT_K, pid_k)
        o_m = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(p_sorted + o_m)
        mask_m = pair < n_pairs
        tok = tl.where(mask_m, pair // TOPK, 0)
        o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = o_n < N_I
        o_g = tl.arange(0, G)
        o_j = tl.arange(0, 8)
        o_k = tl.arange(0, BLOCK_K)
        e64 = e.to(tl.int64)
        o_n64 = o_n.to(tl.int64)
        p_wg = (
            p_w
            + e64 * stride_we
            + o_n64[:, None, None] * stride_wn
            + (o_g[None, :, None] * 8 + o_j[None, None, :])
        )
        p_wu = p_wg + N_I * stride_wn
        p_sg = p_s + e64 * stride_se + o_n64[:, None] * stride_sn + o_g[None, :]
        p_su = p_sg + N_I * stride_sn
        p_xt = p_x + tok[None, :].to(tl.int64) * stride_xm + o_k[:, None]  # [BK, BM]
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if SPLIT_GU:
            # rows o_n of the stacked gate|up matrix (o_n < 2 N_I); p_wg / p_sg already point at them
            mask_n = o_n < 2 * N_I
            for kg in range(kg_lo, kg_hi, G):
                mask_g = (kg + o_g) < kg_hi
                b_wg = _load_w(p_wg, kg * 8, mask_n[:, None, None], mask_g[None, :, None], EVEN)
                b_sg = _load_w(p_sg, kg, mask_n[:, None], mask_g[None, :], EVEN)
                b_x = tl.load(
                    p_xt + kg * 16, mask=((kg * 16 + o_k) < kg_hi * 16)[:, None] & mask_m[None, :], other=0.0
                )
                acc_g = tl.dot(
                    _dequant_tile(b_wg, b_sg, BLOCK_N, BLOCK_K, USE_ASM, b_x.dtype, REPACKED), b_x, acc_g
                )
            pair_c = tl.where(mask_m, pair, 0).to(tl.int64)
            p_wst = p_ws + pid_k.to(tl.int64) * stride_wss + pair_c[None, :] * stride_wsm + o_n[:, None]
            tl.store(p_wst, acc_g, mask=mask_n[:, None] & mask_m[None, :])
        else:
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for kg in range(kg_lo, kg_hi, G):
                mask_g = (kg + o_g) < kg_hi
                b_wg = _load_w(p_wg, kg * 8, mask_n[:, None, None], mask_g[None, :, None], EVEN)
                b_wu = _load_w(p_wu, kg * 8, mask_n[:, None, None], mask_g[None, :, None], EVEN)
                b_sg = _load_w(p_sg, kg, mask_n[:, None], mask_g[None, :], EVEN)
                b_su = _load_w(p_su, kg, mask_n[:, None], mask_g[None, :], EVEN)
                b_x = tl.load(
                    p_xt + kg * 16, mask=((kg * 16 + o_k) < kg_hi * 16)[:, None] & mask_m[None, :], other=0.0
                )
                acc_g = tl.dot(
                    _dequant_tile(b_wg, b_sg, BLOCK_N, BLOCK_K, USE_ASM, b_x.dtype, REPACKED), b_x, acc_g
                )
                acc_u = tl.dot(
                    _dequant_tile(b_wu, b_su, BLOCK_N, BLOCK_K, USE_ASM, b_x.dtype, REPACKED), b_x, acc_u
                )
            if SPLIT_K == 1:
                p_ge = p_gs + e64 * stride_ge
                a_g = tl.load(p_ge + o_n, mask=mask_n, other=0.0) * _ACC_BIAS
                a_u = tl.load(p_ge + N_I + o_n, mask=mask_n, other=0.0) * _ACC_BIAS
                g = acc_g * a_g[:, None]
                u = acc_u * a_u[:, None]
                h = g / (1.0 + tl.exp(-g)) * u
                p_ht = p_h + pair[None, :].to(tl.int64) * stride_hm + o_n[:, None]
                tl.store(p_ht, h.to(p_h.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
            else:
                pair_c = tl.where(mask_m, pair, 0).to(tl.int64)
                p_wst = p_ws + pid_k.to(tl.int64) * stride_wss + pair_c[None, :] * stride_wsm + o_n[:, None]
                mask_st = mask_n[:, None] & mask_m[None, :]
                tl.store(p_wst, acc_g, mask=mask_st)
                tl.store(p_wst + N_I, acc_u, mask=mask_st)


@triton.jit
def _moe_silu_mul_kernel(
    p_ws,
    p_ids,
    p_gs,
    p_h,
    n_pairs,
    N_I,
    stride_wss,
    stride_wsm,
    stride_ge,
    stride_hm,
    SPLIT_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """Split-K finish of GEMM1: for pairs [pid 0 * BLOCK_P, +BLOCK_P) and columns of block pid 1,
    g/u = (sum over splits 0, 1, ... in order of p_ws[s, pair, 0/1, n]) * global scale of expert
    p_ids[pair]; h[pair, n] = silu(g) * u."""
    pdl_wait(PDL)
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    o_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_p = o_p < n_pairs
    mask_n = o_n < N_I
    mask = mask_p[:, None] & mask_n[None, :]
    o_p64 = o_p.to(tl.int64)
    e = tl.load(p_ids + o_p, mask=mask_p, other=0).to(tl.int64)
    p_row = p_ws + o_p64[:, None] * stride_wsm + o_n[None, :]
    g = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    u = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):  # a runtime loop (fixed order) keeps few partial tiles in registers
        g += tl.load(p_row + s * stride_wss, mask=mask, other=0.0)
        u += tl.load(p_row + s * stride_wss + N_I, mask=mask, other=0.0)
    p_ge = p_gs + e[:, None] * stride_ge + o_n[None, :]
    g = g * (tl.load(p_ge, mask=mask, other=0.0) * _ACC_BIAS)
    u = u * (tl.load(p_ge + N_I, mask=mask, other=0.0) * _ACC_BIAS)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(p_h + o_p64[:, None] * stride_hm + o_n[None, :], h.to(p_h.dtype.element_ty), mask=mask)


@triton.jit
def _moe_gemm2_kernel(
    p_h,
    p_w,
    p_s,
    p_gs,
    p_tw,
    p_y,
    p_sorted,
    p_bexp,
    n_pairs,
    N,
    K,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ge,
    stride_ym,
    stride_ys,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr,
    USE_ASM: tl.constexpr,
    REPACKED: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[pair, n] = topk_weight[pair] * h[pair] . W_down[e, n] for the pairs of block pid 0 (expert
    p_bexp[pid 0]; -1: nothing to do), columns n of block pid 1. p_tw: fp32 [n_pairs] (flattened
    topk weights). EVEN: K % (SPLIT_K * BLOCK_K) == 0 and N % BLOCK_N == 0.

    SPLIT_K > 1 (grid axis 2 = split s, K blocks as in ``_moe_gemm1_kernel``): p_y is an fp32
    workspace [SPLIT_K, n_pairs, N] (strides stride_ys, stride_ym) and gets the split's partial
    sum times the global scale, *without* the topk weight (``_moe_sum_kernel`` applies it).
    """
    pdl_wait(PDL)
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    G: tl.constexpr = BLOCK_K // 16
    e = tl.load(p_bexp + pid_b)
    if e >= 0:
        kg_lo, kg_hi = _k_split(K, G, SPLIT_K, pid_k)
        o_m = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(p_sorted + o_m)
        mask_m = pair < n_pairs
        pair_c = tl.where(mask_m, pair, 0).to(tl.int64)
        o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = o_n < N
        o_g = tl.arange(0, G)
        o_j = tl.arange(0, 8)
        o_k = tl.arange(0, BLOCK_K)
        e64 = e.to(tl.int64)
        o_n64 = o_n.to(tl.int64)
        p_wt = (
            p_w
            + e64 * stride_we
            + o_n64[:, None, None] * stride_wn
            + (o_g[None, :, None] * 8 + o_j[None, None, :])
        )
        p_st = p_s + e64 * stride_se + o_n64[:, None] * stride_sn + o_g[None, :]
        p_at = p_h + pair_c[None, :] * stride_hm + o_k[:, None]  # [BK, BM]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kg in range(kg_lo, kg_hi, G):
            mask_g = (kg + o_g) < kg_hi
            b_w = _load_w(p_wt, kg * 8, mask_n[:, None, None], mask_g[None, :, None], EVEN)
            b_s = _load_w(p_st, kg, mask_n[:, None], mask_g[None, :], EVEN)
            b_a = tl.load(
                p_at + kg * 16, mask=((kg * 16 + o_k) < kg_hi * 16)[:, None] & mask_m[None, :], other=0.0
            )
            acc = tl.dot(_dequant_tile(b_w, b_s, BLOCK_N, BLOCK_K, USE_ASM, b_a.dtype, REPACKED), b_a, acc)
        alpha = tl.load(p_gs + e64 * stride_ge + o_n, mask=mask_n, other=0.0) * _ACC_BIAS
        if SPLIT_K == 1:
            tw = tl.load(p_tw + pair_c, mask=mask_m, other=0.0)
            y = acc * alpha[:, None] * tw[None, :]
            p_yt = p_y + pair_c[None, :] * stride_ym + o_n[:, None]
            tl.store(p_yt, y.to(p_y.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
        else:
            p_yt = p_y + pid_k.to(tl.int64) * stride_ys + pair_c[None, :] * stride_ym + o_n[:, None]
            tl.store(p_yt, acc * alpha[:, None], mask=mask_n[:, None] & mask_m[None, :])


@triton.jit
def _moe_sum_kernel(
    p_y,
    p_tw,
    p_out,
    T,
    N,
    stride_ym,
    stride_ys,
    stride_ot,
    TOPK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTIALS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """SPLIT_K == 1 (and not PARTIALS): out[t, n] = sum_s y[t * TOPK + s, n] (y already weighted; p_tw
    unused). SPLIT_K > 1 or PARTIALS: out[t, n] = sum_s tw[t * TOPK + s] * (sum_k y[k, t * TOPK + s, n])
    over the fp32 split partials. Summed in fp32 in slot order (splits in order inside a slot):
    deterministic."""
    pdl_wait(PDL)
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = o_n < N
    p_row = p_y + (pid_t.to(tl.int64) * TOPK) * stride_ym + o_n
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(TOPK):
        if SPLIT_K == 1 and not PARTIALS:
            acc += tl.load(p_row + s * stride_ym, mask=mask, other=0.0).to(tl.float32)
        else:
            part = tl.load(p_row + s * stride_ym, mask=mask, other=0.0)
            for k in tl.static_range(1, SPLIT_K):
                part += tl.load(p_row + k * stride_ys + s * stride_ym, mask=mask, other=0.0)
            acc += tl.load(p_tw + pid_t * TOPK + s) * part
    tl.store(p_out + pid_t.to(tl.int64) * stride_ot + o_n, acc.to(p_out.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_step(p_w_tile, p_s_tile, p_xk, kg, kg_hi, o_g, o_xlo, o_xhi, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr):
    """One K step of a CUDA-core GEMV: codes and scales of k groups kg.. (< kg_hi), widened and multiplied
    by x (p_xk = x at group kg); returns the [BN, G] per-group sums times their block scales."""
    if EVEN_K:
        mask_x = o_g[:, None] >= 0  # unused
    else:
        mask_x = ((kg + o_g) < kg_hi)[:, None]
    b_w, b_s = _gemv_load(p_w_tile, p_s_tile, kg, kg_hi, o_g, EVEN_K)
    w_lo, w_hi, sc = _gemv_widen(b_w, b_s, USE_ASM)
    return _fma_rows(w_lo, w_hi, p_xk, o_xlo, o_xhi, mask_x, EVEN_K) * sc


@triton.jit
def _moe_gemv1_kernel(
    p_x,
    p_w,
    p_s,
    p_gs,
    p_h,
    p_ws,
    p_ids,
    N_I,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ge,
    stride_hm,
    stride_wss,
    stride_wsm,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    REPACKED: tl.constexpr,
    PDL: tl.constexpr,
):
    """h[pair, n] = silu(g) * u for pair = pid 0 (token pair // TOPK, expert p_ids[pair]), columns n of
    block pid 1: g/u = x[token] . W_gate/up[e, n] streamed as [BN, G, 8] code tiles (one thread = one
    16-code scale group, as in ``_nvfp4_gemv_fma_kernel``), products and group sums in fp32, the block
    scale once per group, the per-row global scale at the end.

    SPLIT_K > 1 (grid axis 2): the split's sums times 2^-9 go to p_ws[s, pair, 0/1, n] (the scaling the MMA
    kernel's partials carry, so ``_moe_silu_mul_kernel`` finishes both the same way). EVEN_K: K is a
    multiple of SPLIT_K * BLOCK_K (no K masks). Rows past N_I are clamped for the loads, masked at the store.
    """
    pdl_wait(PDL)
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    G: tl.constexpr = BLOCK_K // 16
    kg_lo, kg_hi = _k_split(K, G, SPLIT_K, pid_k)
    e64 = tl.load(p_ids + pid_p).to(tl.int64)
    tok = (pid_p // TOPK).to(tl.int64)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = o_n < N_I
    o_nl = tl.minimum(o_n, N_I - 1).to(tl.int64)
    o_g = tl.arange(0, G)
    o_j = tl.arange(0, 8)
    p_wg = p_w + e64 * stride_we + o_nl[:, None, None] * stride_wn + (o_g[None, :, None] * 8 + o_j[None, None, :])
    p_wu = p_wg + N_I * stride_wn
    p_sg = p_s + e64 * stride_se + o_nl[:, None] * stride_sn + o_g[None, :]
    p_su = p_sg + N_I * stride_sn
    o_xlo, o_xhi = _x_offsets(o_g, o_j, REPACKED)
    p_xr = p_x + tok * stride_xm
    acc_g = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    for kg in range(kg_lo, kg_hi, G):
        acc_g += _gemv_step(p_wg, p_sg, p_xr + kg * 16, kg, kg_hi, o_g, o_xlo, o_xhi, EVEN_K, USE_ASM)
        acc_u += _gemv_step(p_wu, p_su, p_xr + kg * 16, kg, kg_hi, o_g, o_xlo, o_xhi, EVEN_K, USE_ASM)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if SPLIT_K == 1:
        p_ge = p_gs + e64 * stride_ge
        g = g * tl.load(p_ge + o_nl)
        u = u * tl.load(p_ge + N_I + o_nl)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(p_h + pid_p.to(tl.int64) * stride_hm + o_n, h.to(p_h.dtype.element_ty), mask=mask_n)
    else:
        p_wst = p_ws + pid_k.to(tl.int64) * stride_wss + pid_p.to(tl.int64) * stride_wsm + o_n
        tl.store(p_wst, g * (1.0 / _ACC_BIAS), mask=mask_n)
        tl.store(p_wst + N_I, u * (1.0 / _ACC_BIAS), mask=mask_n)


@triton.jit
def _moe_gemv2_kernel(
    p_h,
    p_w,
    p_s,
    p_gs,
    p_tw,
    p_y,
    p_ids,
    N,
    K,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ge,
    stride_ym,
    stride_ys,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_ASM: tl.constexpr,
    REPACKED: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[pair, n] = topk_weight[pair] * h[pair] . W_down[e, n] for pair = pid 0 (expert p_ids[pair]) and
    columns n of block pid 1, on the CUDA cores as ``_moe_gemv1_kernel``. SPLIT_K > 1: p_y is the fp32
    workspace [SPLIT_K, n_pairs, N] and gets the split's sum times the global scale, without the topk
    weight (as ``_moe_gemm2_kernel``'s partials; ``_moe_sum_kernel`` applies it)."""
    pdl_wait(PDL)
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    G: tl.constexpr = BLOCK_K // 16
    kg_lo, kg_hi = _k_split(K, G, SPLIT_K, pid_k)
    e64 = tl.load(p_ids + pid_p).to(tl.int64)
    pair64 = pid_p.to(tl.int64)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = o_n < N
    o_nl = tl.minimum(o_n, N - 1).to(tl.int64)
    o_g = tl.arange(0, G)
    o_j = tl.arange(0, 8)
    p_wt = p_w + e64 * stride_we + o_nl[:, None, None] * stride_wn + (o_g[None, :, None] * 8 + o_j[None, None, :])
    p_st = p_s + e64 * stride_se + o_nl[:, None] * stride_sn + o_g[None, :]
    o_xlo, o_xhi = _x_offsets(o_g, o_j, REPACKED)
    p_hr = p_h + pair64 * stride_hm
    acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    for kg in range(kg_lo, kg_hi, G):
        acc += _gemv_step(p_wt, p_st, p_hr + kg * 16, kg, kg_hi, o_g, o_xlo, o_xhi, EVEN_K, USE_ASM)
    y = tl.sum(acc, axis=1) * tl.load(p_gs + e64 * stride_ge + o_nl)
    if SPLIT_K == 1:
        y = y * tl.load(p_tw + pid_p)
        tl.store(p_y + pair64 * stride_ym + o_n, y.to(p_y.dtype.element_ty), mask=mask_n)
    else:
        tl.store(p_y + pid_k.to(tl.int64) * stride_ys + pair64 * stride_ym + o_n, y, mask=mask_n)
