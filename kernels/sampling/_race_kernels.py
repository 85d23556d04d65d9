"""Triton kernels of `vibeqwen_kernels.sampling.race_sample` (imported on first use).

A row's draw over its whole vocabulary in three launches: each chunk's largest scaled logit, then each chunk's race
winner against the row's largest, then the row's winner among its chunks'."""

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait


@triton.jit
def _scaled(x, temperature):
    """logits / temperature as `vibeqwen.engine.sampler.candidate_probs` scales them: NaN as -inf, +inf (also from
    an overflowing division) as the largest float32."""
    x = tl.where(x != x, float("-inf"), x)
    y = x / temperature
    return tl.where(y == float("inf"), 3.4028234663852886e38, y)


@triton.jit
def _chunk_max_kernel(logits_ptr, params_ptr, cmax_ptr, V, stride_l, n_rows, n_chunks, CHUNK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """cmax[row, chunk] = the largest scaled logit of logits[row, chunk * CHUNK:][:CHUNK] (-inf if none)."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = ids < V
    temperature = tl.load(params_ptr + row)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + ids, mask=valid, other=float("-inf"))
    tl.store(cmax_ptr + row * n_chunks + chunk, tl.max(_scaled(x, temperature), axis=0))


@triton.jit
def _chunk_race_kernel(logits_ptr, uniform_ptr, params_ptr, cmax_ptr, best_ptr, best_id_ptr, V, stride_l, stride_u,
                       n_rows, n_chunks, CHUNK: tl.constexpr, NC: tl.constexpr, PDL: tl.constexpr = False):
    """best[row, chunk], best_id[row, chunk] = the chunk's largest race score e / -log(U) and its id (the lowest on
    ties), e = exp(scaled logit - the row's largest), over the ids with e > 0 and e >= min_p; -1 where there is none
    (or the row has no finite logit: e is NaN)."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    c = tl.arange(0, NC)
    peak = tl.max(tl.load(cmax_ptr + row * n_chunks + c, mask=c < n_chunks, other=float("-inf")), axis=0)
    temperature = tl.load(params_ptr + row)
    min_p = tl.load(params_ptr + 2 * n_rows + row)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = ids < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + ids, mask=valid, other=float("-inf"))
    e = tl.exp(_scaled(x, temperature) - peak)
    kept = valid & (e > 0) & (e >= min_p)  # p < min_p * p_max, with p = e / sum and p_max = 1 / sum
    u = tl.load(uniform_ptr + row.to(tl.int64) * stride_u + ids, mask=valid, other=0.5)
    score = tl.where(kept, e.to(tl.float64) / -tl.log(u), -1.0)
    win = tl.argmax(score, axis=0, tie_break_left=True)
    tl.store(best_ptr + row * n_chunks + chunk, tl.max(score, axis=0))
    tl.store(best_id_ptr + row * n_chunks + chunk, chunk * CHUNK + win)


@triton.jit
def _race_reduce_kernel(best_ptr, best_id_ptr, fallback_ptr, out_ptr, n_chunks, NC: tl.constexpr,
                        PDL: tl.constexpr = False):
    """out[row] = the id of the row's largest chunk score (the lowest chunk on ties), or fallback[row] where no id
    has mass."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, NC)
    best = tl.load(best_ptr + row * n_chunks + c, mask=c < n_chunks, other=-2.0)
    win = tl.argmax(best, axis=0, tie_break_left=True)
    token = tl.load(best_id_ptr + row * n_chunks + win)
    alive = tl.max(best, axis=0) >= 0
    fallback = tl.load(fallback_ptr + row).to(tl.int32)
    tl.store(out_ptr + row, tl.where(alive, token, fallback).to(tl.int64))
