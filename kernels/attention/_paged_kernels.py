"""Triton kernels behind :mod:`vibeqwen_kernels.attention.paged` and :mod:`.rope_norm` (private: call the
wrappers, which check shapes and pick block sizes).

Paged KV cache, per layer: ``k_cache, v_cache [num_blocks, PAGE, Hkv, D]``; key position p of a
sequence with block table row ``bt`` lives at ``[bt[p // PAGE], p % PAGE]``. Block-table entries are
only read for positions below the sequence's length, so stale entries past it are never dereferenced.

GQA row packing (both attention kernels). A program owns one kv head and a tile of ``BLOCK_M =
BLOCK_Q * GROUP_P`` rows; row r is query ``r // GROUP_P`` of the tile and query head ``kvh * GROUP +
r % GROUP_P`` (``GROUP_P`` = GROUP rounded up to a power of two, pad rows masked). All query heads of a
kv head therefore share every K/V tile the program loads, and a tile spans few query positions, so the
causal diagonal wastes little.

Softmax: online (running max ``m``, running sum ``l``) in fp32, in base 2 (scores pre-multiplied by
``scale * log2(e)``). A fully masked row keeps ``m = -inf``; the exponent then subtracts 0 instead of
``m`` so no ``inf - inf`` NaN appears (its ``p`` and ``alpha`` are 0). P is cast to V's dtype for the
second MMA (as FlashAttention does); the accumulator stays fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait


@triton.jit
def _kv_tile_offsets(bt_row_ptr, offs_n, kmask, PAGE: tl.constexpr, stride_b, stride_s):
    """Element offsets (int64) of key positions ``offs_n`` in a [num_blocks, PAGE, ...] cache."""
    blk = tl.load(bt_row_ptr + offs_n // PAGE, mask=kmask, other=0).to(tl.int64)
    return blk * stride_b + (offs_n % PAGE).to(tl.int64) * stride_s


@triton.jit
def _attn_step(q, acc, m_i, l_i, k, v, smask, sm_scale_log2, MASK_S: tl.constexpr):
    """One K/V tile of online softmax on loaded values. q [M, D]; k, v [N, D]; smask [M, N] (if MASK_S)."""
    s = tl.dot(q, tl.trans(k.to(q.dtype))) * sm_scale_log2  # [M, N] fp32, base-2 logits
    if MASK_S:
        s = tl.where(smask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return acc, m_new, l_i


@triton.jit
def _attn_tile(
    q,
    acc,
    m_i,
    l_i,
    k_ptrs,
    v_ptrs,
    kmask,
    smask,
    sm_scale_log2,
    MASK_K: tl.constexpr,
    MASK_S: tl.constexpr,
):
    """One K/V tile of online softmax. q [M, D]; k/v pointers [N, D]; smask [M, N] (if MASK_S)."""
    if MASK_K:
        k = tl.load(k_ptrs, mask=kmask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=kmask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return _attn_step(q, acc, m_i, l_i, k, v, smask, sm_scale_log2, MASK_S)


@triton.jit
def _split_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    part_o_ptr,
    part_lse_ptr,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_pt,
    stride_ph,
    stride_ps,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Split-KV partial attention. Grid (B, Hkv, NUM_SPLITS).

    Program (b, kvh, split) covers keys [lo, hi) of sequence b, where the sequence's key tiles are dealt
    out in NUM_SPLITS contiguous runs of ceil(tiles / NUM_SPLITS) tiles (computed here from seq_lens, so
    the grid never depends on lengths); all q_len_b (<= BLOCK_Q) queries x GROUP heads of kvh form the
    rows. Writes, for every real row, the partial output normalised by its own sum, and its base-2
    log-sum-exp (-inf and zeros for an empty range or a row whose causal limit precedes lo).
    Sequences with q_len 0 write nothing.
    """
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if q_len <= 0:
        return
    seq_len = tl.load(seq_lens_ptr + b)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    qi = offs_m // GROUP_P
    g = offs_m % GROUP_P
    row_ok = (qi < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    tok = (q_start + qi).to(tl.int64)
    qpos = seq_len - q_len + qi  # absolute position of each row's query: sees keys 0..qpos

    q_rows = tok * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kmask = offs_n < hi
        k_off = _kv_tile_offsets(bt_row, offs_n, kmask, PAGE, stride_kb, stride_ks) + kvh * stride_kh
        v_off = _kv_tile_offsets(bt_row, offs_n, kmask, PAGE, stride_vb, stride_vs) + kvh * stride_vh
        smask = kmask[None, :] & (offs_n[None, :] <= qpos[:, None])
        acc, m_i, l_i = _attn_tile(
            q,
            acc,
            m_i,
            l_i,
            k_ptr + k_off[:, None] + offs_d[None, :],
            v_ptr + v_off[:, None] + offs_d[None, :],
            kmask,
            smask,
            sm_scale_log2,
            True,
            True,
        )

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    p_rows = tok * stride_pt + head.to(tl.int64) * stride_ph + split * stride_ps
    tl.store(part_o_ptr + p_rows[:, None] + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(part_lse_ptr + p_rows // HEAD_DIM, lse, mask=row_ok)


@triton.jit
def _split_reduce_kernel(
    part_o_ptr,
    part_lse_ptr,
    qsl_ptr,
    o_ptr,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_ot,
    stride_oh,
    g_ptr,
    stride_gt,
    stride_gh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Log-sum-exp merge of the split partials. Grid (max_query_len, B, Hq); rows past q_len exit. Splits whose
    lse is -inf (no keys) count 0 and their o rows are not read.

    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s (all -inf: writes 0); with HAS_GATE
    times sigmoid(gate) (fp32, one rounding).
    """
    pdl_wait(PDL)
    i = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if i >= q_len:
        return
    tok = (q_start + i).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM)
    smask = offs_s < NUM_SPLITS
    base = tok * stride_pt + h * stride_ph
    lse = tl.load(part_lse_ptr + (base + offs_s * stride_ps) // HEAD_DIM, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_use)
    den = tl.sum(w, 0)
    # splits without keys (lse -inf) are not read: their o rows may never have been written
    live = smask & (lse > float("-inf"))
    parts = tl.load(part_o_ptr + base + offs_s[:, None] * stride_ps + offs_d[None, :], mask=live[:, None], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
    if HAS_GATE:
        gate = tl.load(g_ptr + tok * stride_gt + h * stride_gh + offs_d).to(tl.float32)
        o = o / (1.0 + tl.exp(-gate))
    tl.store(o_ptr + tok * stride_ot + h * stride_oh + offs_d, o.to(o_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    o_ptr,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_btb,
    stride_ot,
    stride_oh,
    g_ptr,
    stride_gt,
    stride_gh,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Causal prefill/extend attention (with HAS_GATE the output times sigmoid(gate), before its one rounding).
    Grid (cdiv(max_query_len, BLOCK_Q), B, Hkv).

    Program (t, b, kvh) owns queries [t*BLOCK_Q, (t+1)*BLOCK_Q) of sequence b (exits if past q_len) x
    the GROUP heads of kvh. Keys [0, full_end) are visible to every row (full_end = the first query's
    position + 1, rounded down to BLOCK_N): loaded and used without masks. Keys [full_end, end), end =
    min(seq_len, last query's position + 1), get the causal / length masks.
    """
    pdl_wait(PDL)
    qt = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    q0 = qt * BLOCK_Q
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    qi = q0 + offs_m // GROUP_P
    g = offs_m % GROUP_P
    row_ok = (qi < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    tok = (q_start + qi).to(tl.int64)
    qpos = ctx + qi

    q_rows = tok * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    first = ctx + q0
    full_end = ((first + 1) // BLOCK_N) * BLOCK_N
    end = tl.minimum(seq_len, first + BLOCK_Q)
    for start in range(0, full_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k_off = _kv_tile_offsets(bt_row, offs_n, offs_n >= 0, PAGE, stride_kb, stride_ks) + kvh * stride_kh
        v_off = _kv_tile_offsets(bt_row, offs_n, offs_n >= 0, PAGE, stride_vb, stride_vs) + kvh * stride_vh
        acc, m_i, l_i = _attn_tile(
            q,
            acc,
            m_i,
            l_i,
            k_ptr + k_off[:, None] + offs_d[None, :],
            v_ptr + v_off[:, None] + offs_d[None, :],
            offs_n >= 0,
            offs_n[None, :] >= 0,
            sm_scale_log2,
            False,
            False,
        )
    for start in range(full_end, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kmask = offs_n < end
        k_off = _kv_tile_offsets(bt_row, offs_n, kmask, PAGE, stride_kb, stride_ks) + kvh * stride_kh
        v_off = _kv_tile_offsets(bt_row, offs_n, kmask, PAGE, stride_vb, stride_vs) + kvh * stride_vh
        smask = kmask[None, :] & (offs_n[None, :] <= qpos[:, None])
        acc, m_i, l_i = _attn_tile(
            q,
            acc,
            m_i,
            l_i,
            k_ptr + k_off[:, None] + offs_d[None, :],
            v_ptr + v_off[:, None] + offs_d[None, :],
            kmask,
            smask,
            sm_scale_log2,
            True,
            True,
        )

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if HAS_GATE:
        g_rows = tok * stride_gt + head.to(tl.int64) * stride_gh
        gate = tl.load(g_ptr + g_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        o = o / (1.0 + tl.exp(-gate))
    o_rows = tok * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _norm_rope_heads(base, w_ptr, offs_d, partner, dmask, mask, cos, sin, eps, HEAD_DIM: tl.constexpr):
    """fp32 [heads, BLOCK_D]: zero-centred RMSNorm (weight 1 + w) then rotate-half RoPE of the heads at base
    (pointers [heads, 1], rows of HEAD_DIM; partner: each lane's rotation partner; cos, sin (sin already signed):
    [1 or heads, BLOCK_D], from _rope_tables)."""
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    w = 1.0 + tl.load(w_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
    wp = 1.0 + tl.load(w_ptr + partner, mask=dmask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
    return (x * w[None, :] * cos + xp * wp[None, :] * sin) * rstd[:, None]


@triton.jit
def _rope_tables(pos, inv_freq_ptr, offs_d, ROT: tl.constexpr):
    """Rotate-half RoPE tables for positions pos (fp32: a scalar, or [R, 1] for one position a row): each lane's
    rotation partner [BLOCK_D], and cos, signed sin (fp32, pos's shape times [BLOCK_D]; 1 and 0 past ROT).

    For d < ROT: y'_d = y_d cos(a_i) - y_{d+ROT/2} sin(a_i) (d < ROT/2), y_d cos(a_i) + y_{d-ROT/2} sin(a_i)
    (ROT/2 <= d < ROT), a_i = pos * inv_freq[i], i = d mod ROT/2 (the angle in fp32, as the reference forms it).
    """
    HALF: tl.constexpr = ROT // 2
    in_rot = offs_d < ROT
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    partner = tl.where(in_rot, partner, offs_d)
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    inv_freq = tl.load(inv_freq_ptr + (offs_d % HALF), mask=in_rot, other=0.0)
    ang = pos * inv_freq
    # reduce to [-pi, pi] in fp64 (exact 2*pi constant) so cos/sin are accurate even if the fp32 cos/sin
    # are hardware approximations, which lose accuracy far from 0 (angles reach ~2.6e5 rad)
    two_pi = tl.full([], 6.283185307179586, tl.float64)
    a64 = ang.to(tl.float64)
    red = (a64 - tl.floor(a64 / two_pi + 0.5) * two_pi).to(tl.float32)
    cos = tl.where(in_rot, tl.cos(red), 1.0)
    sin = tl.where(in_rot, tl.sin(red), 0.0) * sign  # 0 outside the rotary dims
    return partner, cos, sin


@triton.jit
def _qk_norm_rope_store_kernel(
    qg_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    inv_freq_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    qo_ptr,
    eps,
    stride_qgt,
    stride_qgh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_qot,
    stride_qoh,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HQ_P: tl.constexpr,
    HKV_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROT: tl.constexpr,
    PAGE: tl.constexpr,
    HQ_B: tl.constexpr,  # q heads per program (a power of two <= HQ_P)
    KV_PROG: tl.constexpr,  # the axis-1 program that does K/V: HQ_P // HQ_B (split), or 0 (one program a token)
    PDL: tl.constexpr,
):
    """Grid (T, KV_PROG + 1): program (t, s) does q heads [s HQ_B, (s + 1) HQ_B) of token t and, for s = KV_PROG,
    its K/V (with KV_PROG = 0 and HQ_B = HQ_P one program does all of a token: prefill-sized T; decode-sized T
    split, so a batch-1 step's one token is not one program's serial work). q/k zero-centred RMSNorm +
    rotate-half RoPE, K/V cache store.

    y = x * rsqrt(mean(x^2) + eps) * (1 + w); for d < ROT: y'_d = y_d cos(a_i) - y_{d+ROT/2} sin(a_i)
    (d < ROT/2), y_d cos(a_i) + y_{d-ROT/2} sin(a_i) (ROT/2 <= d < ROT), a_i = pos * inv_freq[i],
    i = d mod ROT/2. All in fp32, one rounding at the store. Slot < 0: K/V not stored.
    """
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    partner, cos, sin = _rope_tables(pos, inv_freq_ptr, offs_d, ROT)
    cos = cos[None, :]
    sin = sin[None, :]

    # ---- q heads
    if sp * HQ_B < HQ:
        hq = sp * HQ_B + tl.arange(0, HQ_B)
        qmask = (hq < HQ)[:, None] & dmask[None, :]
        q_base = qg_ptr + t * stride_qgt + hq[:, None].to(tl.int64) * stride_qgh
        y = _norm_rope_heads(q_base, qw_ptr, offs_d, partner, dmask, qmask, cos, sin, eps, HEAD_DIM)
        qo = qo_ptr + t * stride_qot + hq[:, None].to(tl.int64) * stride_qoh + offs_d[None, :]
        tl.store(qo, y.to(qo_ptr.dtype.element_ty), mask=qmask)

    # ---- k heads (+ v), into the cache
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (sp == KV_PROG):
        blk = slot // PAGE
        off = slot % PAGE
        hk = tl.arange(0, HKV_P)
        kmask = (hk < HKV)[:, None] & dmask[None, :]
        k_base = k_ptr + t * stride_kt + hk[:, None].to(tl.int64) * stride_kh
        ky = _norm_rope_heads(k_base, kw_ptr, offs_d, partner, dmask, kmask, cos, sin, eps, HEAD_DIM)
        kc = (
            kc_ptr
            + blk * stride_kcb
            + off * stride_kcs
            + hk[:, None].to(tl.int64) * stride_kch
            + offs_d[None, :]
        )
        tl.store(kc, ky.to(kc_ptr.dtype.element_ty), mask=kmask)
        v = tl.load(
            v_ptr + t * stride_vt + hk[:, None].to(tl.int64) * stride_vh + offs_d[None, :], mask=kmask
        )
        vc = (
            vc_ptr
            + blk * stride_vcb
            + off * stride_vcs
            + hk[:, None].to(tl.int64) * stride_vch
            + offs_d[None, :]
        )
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=kmask)


@triton.jit
def _split_kv_norm_rope_kernel(
    qg_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    inv_freq_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    part_o_ptr,
    part_lse_ptr,
    eps,
    sm_scale_log2,
    stride_qgt,
    stride_qgh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_btb,
    stride_pt,
    stride_ph,
    stride_ps,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_NEW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Split-KV partial attention with the q/k RMSNorm, RoPE and the new tokens' K/V cache store fused in.
    Grid (B, Hkv, NUM_SPLITS + 1).

    Sequence b's q_len new tokens sit at positions ctx .. seq_len - 1 (ctx = seq_len - q_len). Program
    (b, kvh, split < NUM_SPLITS) covers the cached keys [lo, hi) of [0, ctx), dealt out in NUM_SPLITS contiguous
    runs of ceil(tiles / NUM_SPLITS) tiles of BLOCK_N (from seq_lens in-kernel: the grid never depends on lengths);
    program (b, kvh, NUM_SPLITS) covers the new keys: it normalises and rotates them from k (raw projection rows),
    stores them and v into the cache at slot_mapping (slot < 0: not stored) and attends to them causally from the
    values it stored (rounded to the cache's dtype), not from the cache. Every program with keys normalises and
    rotates its q rows (all q_len queries x GROUP heads of kvh) from qg's query halves, rounds them to qg's dtype
    (as :func:`qk_norm_rope_store` does) and writes the partial output normalised by its own sum and its base-2
    log-sum-exp; a program without keys writes only lse = -inf (its o rows are never read).
    Sequences with q_len 0 write nothing.
    """
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if q_len <= 0:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    qi = offs_m // GROUP_P
    g = offs_m % GROUP_P
    row_ok = (qi < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    tok = (q_start + qi).to(tl.int64)
    p_rows = tok * stride_pt + head.to(tl.int64) * stride_ph + split * stride_ps

    n_tiles = tl.cdiv(ctx, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, ctx)
    is_new = split == NUM_SPLITS
    lo = tl.where(is_new, ctx, lo)
    hi = tl.where(is_new, seq_len, hi)
    if lo >= hi:
        tl.store(part_lse_ptr + p_rows // HEAD_DIM, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
        return
    dmask = offs_d < HEAD_DIM
    # the rotary tables once per query (BLOCK_Q of them), broadcast over its GROUP_P rows (row = qi * GROUP_P + g)
    offs_q = tl.arange(0, BLOCK_Q)
    q_pos = tl.load(pos_ptr + q_start + offs_q, mask=offs_q < q_len, other=0).to(tl.float32)
    partner, cos_q, sin_q = _rope_tables(q_pos[:, None], inv_freq_ptr, offs_d, ROT)
    cos = tl.reshape(tl.broadcast_to(cos_q[:, None, :], (BLOCK_Q, GROUP_P, HEAD_DIM)), (BLOCK_M, HEAD_DIM))
    sin = tl.reshape(tl.broadcast_to(sin_q[:, None, :], (BLOCK_Q, GROUP_P, HEAD_DIM)), (BLOCK_M, HEAD_DIM))
    qmask = row_ok[:, None] & dmask[None, :]
    q_base = qg_ptr + tok[:, None] * stride_qgt + head[:, None].to(tl.int64) * stride_qgh
    q = _norm_rope_heads(q_base, qw_ptr, offs_d, partner, dmask, qmask, cos, sin, eps, HEAD_DIM)
    q = q.to(qg_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if is_new:
        offs_j = tl.arange(0, BLOCK_NEW)
        jmask = offs_j < q_len
        ktok = (q_start + offs_j).to(tl.int64)
        k_pos = tl.load(pos_ptr + ktok, mask=jmask, other=0).to(tl.float32)
        _, kcos, ksin = _rope_tables(k_pos[:, None], inv_freq_ptr, offs_d, ROT)
        kmask = jmask[:, None] & dmask[None, :]
        k_base = k_ptr + ktok[:, None] * stride_kt + kvh * stride_kh
        ky = _norm_rope_heads(k_base, kw_ptr, offs_d, partner, dmask, kmask, kcos, ksin, eps, HEAD_DIM)
        ky = ky.to(kc_ptr.dtype.element_ty)
        vv = tl.load(v_ptr + ktok[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :], mask=kmask, other=0.0)
        vv = vv.to(vc_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + ktok, mask=jmask, other=-1).to(tl.int64)
        smask_st = kmask & (slot >= 0)[:, None]
        blk = tl.where(slot >= 0, slot, 0) // PAGE
        off = tl.where(slot >= 0, slot, 0) % PAGE
        kc = kc_ptr + blk[:, None] * stride_kcb + off[:, None] * stride_kcs + kvh * stride_kch + offs_d[None, :]
        tl.store(kc, ky, mask=smask_st)
        vc = vc_ptr + blk[:, None] * stride_vcb + off[:, None] * stride_vcs + kvh * stride_vch + offs_d[None, :]
        tl.store(vc, vv, mask=smask_st)
        smask = jmask[None, :] & (offs_j[None, :] <= qi[:, None])
        acc, m_i, l_i = _attn_step(q, acc, m_i, l_i, ky, vv, smask, sm_scale_log2, True)
    else:
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            kmask = offs_n < hi
            k_off = _kv_tile_offsets(bt_row, offs_n, kmask, PAGE, stride_kcb, stride_kcs) + kvh * stride_kch
            v_off = _kv_tile_offsets(bt_row, offs_n, kmask, PAGE, stride_vcb, stride_vcs) + kvh * stride_vch
            # every cached key precedes every query: only the range mask
            acc, m_i, l_i = _attn_tile(
                q,
                acc,
                m_i,
                l_i,
                kc_ptr + k_off[:, None] + offs_d[None, :],
                vc_ptr + v_off[:, None] + offs_d[None, :],
                kmask,
                kmask[None, :],
                sm_scale_log2,
                True,
                True,
            )
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(part_o_ptr + p_rows[:, None] + offs_d[None, :], o, mask=row_ok[:, None])
    tl.store(part_lse_ptr + p_rows // HEAD_DIM, lse, mask=row_ok)
