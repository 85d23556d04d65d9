"""Triton kernels of `vibeqwen_kernels.sampling.top_p_sample` (imported on first use).

The top_p cut of a row without a top_k, found without sorting its vocabulary: a search over the row's 32-bit
monotone keys (the float's bits, as `vibeqwen.engine.sampler.monotone_bits`) for the cut key kappa, the largest key
whose mass M(kappa) = the sum of e over the ids min_p keeps with key >= kappa reaches top_p x Z, where
e = exp(scaled logit - the row's largest) and Z = the sum of every id's e (the reference's softmax comes before its
min_p cut). Each of 8 launches splits the row's current key interval into 16 equal parts and sums e above each
part's start, per chunk of the vocabulary; the next launch (or the race) adds the chunks' sums up and keeps the part
where M crosses the threshold: 4 bits of the 2^32 keys a pass. The ids above kappa are kept, and of the ids at
kappa (equal logits) the lowest ids while the mass before them is under the threshold, as the reference's stable
sort and cumulative sum keep them.

Every sum over the same ids is the same float in every pass (the masked-out ids add exact zeros to the same
reduction tree), so the cut is a function of the row alone: not of its batch, its chunking aside.
"""

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait
from vibeqwen_kernels.sampling._race_kernels import _scaled

# In the kernels as literals (kept in step with vibeqwen_kernels.sampling.TOP_P_PASSES): 8 passes (k = 0 .. 7) of
# 16 parts (step 2^(28 - 4k)) cover the 2^32 int32 keys; 1.1754943508222875e-38 is float32's smallest normal
# value, the threshold where top_p x Z underflows (the most likely id is then kept alone).


@triton.jit
def _row_scalars(params_ptr, cmax_ptr, row, n_rows, n_chunks, NC: tl.constexpr):
    """(the row's largest scaled logit, its temperature, its min_p)."""
    c = tl.arange(0, NC)
    peak = tl.max(tl.load(cmax_ptr + row * n_chunks + c, mask=c < n_chunks, other=float("-inf")), axis=0)
    return peak, tl.load(params_ptr + row), tl.load(params_ptr + 2 * n_rows + row)


@triton.jit
def _span_weights(logits_ptr, row, start, V, stride_l, peak, temperature, min_p, SIZE: tl.constexpr):
    """(keys int64 [SIZE], e float32 [SIZE], kept [SIZE]) of ids start .. start + SIZE - 1: the monotone keys of the
    logits (NaN as -inf), e = exp(scaled logit - the row's largest) and whether the id has mass that min_p keeps.
    Elementwise: the same values for an id whichever span it is loaded in."""
    ids = start + tl.arange(0, SIZE)
    valid = ids < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + ids, mask=valid, other=float("-inf"))
    x = tl.where(x != x, float("-inf"), x)
    bits = x.to(tl.int32, bitcast=True)
    keys = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    e = tl.exp(_scaled(x, temperature) - peak)
    kept = valid & (e > 0) & (e >= min_p)  # (a row with no finite logit: e is NaN, nothing kept)
    return keys, e, kept


@triton.jit
def _advance(part_ptr, tot_ptr, lo_ptr, params_ptr, k, row, n_rows, n_chunks, NC: tl.constexpr):
    """The search after pass k: (kappa_lo, nb, the sums M of pass k's bounds [16], Z, top_p) with nb = the
    number of pass k's bounds whose M reaches the threshold (at most 15) and kappa_lo = pass k's start + nb
    x its step: the start of pass k + 1 (after the last pass, kappa itself)."""
    c = tl.arange(0, NC)
    b = tl.arange(0, 16)
    z = tl.sum(tl.load(tot_ptr + row * n_chunks + c, mask=c < n_chunks, other=0.0), axis=0)
    parts = tl.load(part_ptr + ((k * n_rows + row) * n_chunks + c[:, None]) * 16 + b[None, :],
                    mask=(c < n_chunks)[:, None], other=0.0)
    m = tl.sum(parts, axis=0)
    top_p = tl.load(params_ptr + 3 * n_rows + row)
    # M does not grow with the bound (sums of fewer non-negative terms), so the bounds that reach it are a prefix
    nb = tl.minimum(tl.sum((m >= tl.maximum(top_p * z, 1.1754943508222875e-38)).to(tl.int32), axis=0), 15)
    step = tl.full((), 1, tl.int64) << (tl.full((), 28, tl.int64) - 4 * k)
    lo = tl.load(lo_ptr + k * n_rows + row) + nb.to(tl.int64) * step
    return lo, nb, m, z, top_p


@triton.jit
def _chunk_mass_kernel(logits_ptr, params_ptr, cmax_ptr, tot_ptr, part_ptr, lo_ptr, cnt_ptr, k, V, stride_l, n_rows,
                       n_chunks, CHUNK: tl.constexpr, SUB: tl.constexpr, NC: tl.constexpr, FIRST: tl.constexpr,
                       LAST: tl.constexpr, PDL: tl.constexpr = False):
    """Pass k of the search. Its start lo_k: -2^31 (FIRST), else `_advance` of pass k - 1 (stored in lo[k, row] by
    the row's first chunk); its bounds lo_k + b x 2^(28 - 4k), b = 1 .. 16. part[k, row, chunk, b - 1] = the
    chunk's sum of e over kept ids with key >= bound b; FIRST: tot[row, chunk] = the chunk's sum of every e (>0);
    LAST (step 1): cnt[row, chunk, j] = the chunk's kept ids with key lo_k + j, j < 16.

    The chunk is read in SUB-id spans; every lane adds its ids' terms for all 16 bounds across the spans in
    registers ([16, SUB] sums), then one reduction per output vector. The order of the additions does not depend on
    the bound or the pass (a dropped id adds an exact zero in its place), so one set of ids sums to one float."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if FIRST:
        lo = tl.full((), -2147483648, tl.int64)
    else:
        lo, _nb, _m, _z, _top_p = _advance(part_ptr, tot_ptr, lo_ptr, params_ptr, k - 1, row, n_rows, n_chunks,
                                           NC)
    if chunk == 0:
        tl.store(lo_ptr + k * n_rows + row, lo)
    step = tl.full((), 1, tl.int64) << (tl.full((), 28, tl.int64) - 4 * k)
    b = tl.arange(0, 16)
    bounds = lo + (b + 1).to(tl.int64) * step
    mass = tl.zeros((16, SUB), tl.float32)
    total = tl.zeros((SUB,), tl.float32)
    ties = tl.zeros((16, SUB), tl.int32)
    peak, temperature, min_p = _row_scalars(params_ptr, cmax_ptr, row, n_rows, n_chunks, NC)
    for s in tl.range(0, CHUNK, SUB):
        keys, e, kept = _span_weights(logits_ptr, row, chunk * CHUNK + s, V, stride_l, peak, temperature, min_p, SUB)
        w = tl.where(kept, e, 0.0)
        mass += tl.where(keys[None, :] >= bounds[:, None], w[None, :], 0.0)
        if FIRST:
            # Z: every id's e, min_p's dropped ones too (the reference's softmax comes before its min_p cut)
            total += tl.where(e > 0, e, 0.0)
        if LAST:
            ties += (kept[None, :] & (keys[None, :] == (lo + b.to(tl.int64))[:, None])).to(tl.int32)
    base = ((k * n_rows + row) * n_chunks + chunk) * 16
    tl.store(part_ptr + base + b, tl.sum(mass, axis=1))
    if FIRST:
        tl.store(tot_ptr + row * n_chunks + chunk, tl.sum(total, axis=0))
    if LAST:
        tl.store(cnt_ptr + (row * n_chunks + chunk) * 16 + b, tl.sum(ties, axis=1))


@triton.jit
def _chunk_race_top_p_kernel(logits_ptr, uniform_ptr, params_ptr, cmax_ptr, tot_ptr, part_ptr, lo_ptr, cnt_ptr,
                             best_ptr, best_id_ptr, k_last, V, stride_l, stride_u, n_rows, n_chunks,
                             CHUNK: tl.constexpr, NC: tl.constexpr, PDL: tl.constexpr = False):
    """best[row, chunk], best_id[row, chunk] as `_chunk_race_kernel`'s, over the ids the top_p cut keeps (every
    kept id where top_p >= 1): keys above kappa, and at kappa the ids of rank r (by id, over the whole row) with
    A + r x e < top_p x Z, A = M(kappa + 1), rank 0 always where A = 0 (the most likely id)."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    peak, temperature, min_p = _row_scalars(params_ptr, cmax_ptr, row, n_rows, n_chunks, NC)
    keys, e, kept = _span_weights(logits_ptr, row, chunk * CHUNK, V, stride_l, peak, temperature, min_p, CHUNK)
    kappa, nb, m, z, top_p = _advance(part_ptr, tot_ptr, lo_ptr, params_ptr, k_last, row, n_rows, n_chunks, NC)
    above = tl.sum(tl.where(tl.arange(0, 16) == nb, m, 0.0), axis=0)  # M(kappa + 1): bound nb + 1 of the pass
    c = tl.arange(0, NC)
    before = tl.sum(tl.load(cnt_ptr + (row * n_chunks + c) * 16 + nb, mask=c < chunk, other=0), axis=0)
    tied = kept & (keys == kappa)
    rank = before + tl.cumsum(tied.to(tl.int32), axis=0) - 1
    before_id = above + rank.to(tl.float32) * e  # the mass before each tied id (others: unused)
    lead = (rank == 0) & (before_id == 0)  # the most likely id, kept whatever top_p x Z rounds to
    cut = (keys > kappa) | (tied & ((before_id < top_p * z) | lead))
    kept = kept & (cut | (tl.zeros_like(e) + top_p >= 1.0))  # (a vector: the interpreter's bools of a scalar
    # comparison do not combine with a vector's)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    u = tl.load(uniform_ptr + row.to(tl.int64) * stride_u + ids, mask=ids < V, other=0.5)
    score = tl.where(kept, e.to(tl.float64) / -tl.log(u), -1.0)
    win = tl.argmax(score, axis=0, tie_break_left=True)
    tl.store(best_ptr + row * n_chunks + chunk, tl.max(score, axis=0))
    tl.store(best_id_ptr + row * n_chunks + chunk, chunk * CHUNK + win)
