"""Triton kernels of `vibeqwen_kernels.sampling.top_k_sample` (imported on first use)."""

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait

# Keys (as vibeqwen.engine.sampler.order_keys): a float32's bits made monotone, times 2^20, plus 2^20 - 1 - the
# vocabulary id (1048575 below); padding keys are -2^62, below every key (the least, -inf's, is about -2^51).
# tl.topk: largest first (its default in Triton 3.6 and 3.9; 3.6 takes no `descending`), k >= 2 (3.6 has no k = 1).


@triton.jit
def _chunk_top_keys_kernel(logits_ptr, keys_ptr, V, stride_l, stride_k, CHUNK: tl.constexpr, KC: tl.constexpr,
                           PDL: tl.constexpr = False):
    """keys[row, chunk * KC + j] = the KC largest keys of logits[row, chunk * CHUNK:][:CHUNK], descending."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = ids < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + ids, mask=valid, other=0.0)
    x = tl.where(x != x, float("-inf"), x)  # NaN ranks as -inf
    bits = x.to(tl.int32, bitcast=True).to(tl.int64)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = bits * 1048576 + (1048575 - ids).to(tl.int64)
    key = tl.where(valid, key, -4611686018427387904)
    top = tl.topk(key, KC)
    tl.store(keys_ptr + row.to(tl.int64) * stride_k + chunk * KC + tl.arange(0, KC), top)


@triton.jit(do_not_specialize=["n_rows"])
def _top_k_race_kernel(logits_ptr, keys_ptr, uniform_ptr, params_ptr, fallback_ptr, out_ptr, n_keys, stride_l,
                       stride_k, stride_u, n_rows, NK: tl.constexpr, K: tl.constexpr, PDL: tl.constexpr = False):
    """out[row] = the race's winner among the row's top-k candidates (see top_k_sample)."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    j = tl.arange(0, NK)
    keys = tl.load(keys_ptr + row.to(tl.int64) * stride_k + j, mask=j < n_keys, other=-4611686018427387904)
    top = tl.topk(keys, K)  # [K]: value descending, id ascending
    col = tl.arange(0, K)
    temperature = tl.load(params_ptr + row)
    k_row = tl.load(params_ptr + n_rows + row).to(tl.int32)
    min_p = tl.load(params_ptr + 2 * n_rows + row)
    top_p = tl.load(params_ptr + 3 * n_rows + row)
    live = col < k_row
    ids = (1048575 - (top & 1048575)).to(tl.int32)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + ids, mask=live, other=float("-inf"))
    x = tl.where(x != x, float("-inf"), x)
    x = x / temperature
    x = tl.where(x == float("inf"), 3.4028234663852886e38, x)  # the largest float32, as the reference clamps
    peak = tl.max(x, axis=0)
    e = tl.where(live, tl.exp(x - peak), 0.0)
    p = e / tl.sum(e, axis=0)
    p = tl.where(p < min_p * tl.max(p, axis=0), 0.0, p)
    # drop columns whose preceding mass already reaches top_p (< 1: no cut at 1, which rounding could reach);
    # never the first
    limit = tl.where(top_p < 1.0, top_p, 2.0)
    drop = ((tl.cumsum(p, axis=0) - p) >= limit) & (col > 0)
    p = tl.where(drop, 0.0, p)
    total = tl.sum(p, axis=0)
    alive = (total > 0) & (total < float("inf"))
    p = p / total
    u = tl.load(uniform_ptr + row.to(tl.int64) * stride_u + ids, mask=live, other=0.5)
    score = tl.where(p > 0, p.to(tl.float64) / -tl.log(u), -1.0)
    win = tl.argmax(score, axis=0)
    token = tl.sum(tl.where(col == win, ids, 0), axis=0)
    fallback = tl.load(fallback_ptr + row).to(tl.int32)
    tl.store(out_ptr + row, tl.where(alive, token, fallback).to(tl.int64))
