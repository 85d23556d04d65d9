"""Sampling of a decode step in a few Triton launches: `top_k_sample` (rows with a top_k), `race_sample` (rows
that keep the whole vocabulary: no top_k, no top_p) and `top_p_sample` (rows with a top_p and no top_k).

The specification is `vibeqwen.engine.sampler` (`candidate_probs` and `race`): `top_k_sample` computes the same
draw for rows with a top_k, without the int64 keys over the whole vocabulary, the vocabulary-wide `torch.topk` and
the ~40 small launches of that path (on an H100 it cost 0.3-0.9 ms a decode step at batch 1-32 with Qwen3.6's
recommended sampling; bench/results/h200_notes.md, thirty-sixth session); `race_sample` the same draw for rows
without a top_k or a top_p, without the vocabulary-wide softmax, mask and float64 division chain (0.5-1.2 ms a step
at batch 1-64 on the H200, thirty-seventh session); `top_p_sample` the same draw for rows with a top_p and no
top_k, with the cut found by a search over the logits' keys instead of a vocabulary-wide sort and cumulative sum
(that path: 1.1-3.9 ms a step at batch 1-64 on an H100, forty-second session). All are gated by
`top_k_sample_available`. Eager launches (the sampler runs after the step's CUDA graph), no host sync. On the CPU
they run only under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from functools import cache, lru_cache

import torch
from vibeqwen_kernels.pdl import pdl_launch

__all__ = ["K_BUCKETS", "MAX_TOP_K", "TOP_P_PASSES", "race_sample", "top_k_sample", "top_k_sample_available",
           "top_p_sample"]

#: the largest top_k this path serves (the candidates of a row are sorted in one program); larger ones and rows
#: without a top_k take `vibeqwen.engine.sampler`'s path
MAX_TOP_K = 128
#: vocabulary ids per program of the first pass; ids must fit the keys' 20 bits
_CHUNK = 4096
_MAX_VOCAB = 1 << 20
#: candidates kept per chunk and row (the kernels' K): the smallest of these >= the batch's largest top_k, so
#: that serving compiles two variants of each kernel (`warm_up` builds them at start-up)
K_BUCKETS = (32, MAX_TOP_K)
#: `top_p_sample`'s search: launches of 16 key ranges each, 4 bits of the 32-bit keys a launch
TOP_P_PASSES = 8
#: ids a `_chunk_mass_kernel` program reads at a time (its [16, span] register sums)
TOP_P_SPAN = 256


@cache
def _kernels(name: str = "_top_k_kernels"):
    """The Triton kernel module `name` of this package, imported on first use (it needs triton)."""
    import importlib

    return importlib.import_module(f"vibeqwen_kernels.sampling.{name}")


def top_k_sample_available(device: torch.device, vocab: int) -> bool:
    """Whether `top_k_sample` can run on `device` for a vocabulary of `vocab` ids: a CUDA device (or the CPU under
    ``TRITON_INTERPRET=1``) with a Triton that has ``tl.topk``, fewer than 2^20 ids, unless
    ``VIBEQWEN_FUSED_SAMPLER=0`` (read at every call)."""
    if os.environ.get("VIBEQWEN_FUSED_SAMPLER", "1") == "0" or not 0 < vocab < _MAX_VOCAB:
        return False
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    return _has_triton_topk()


@lru_cache(maxsize=1)
def _has_triton_topk() -> bool:
    try:
        import triton.language as tl
    except ImportError:
        return False
    return hasattr(tl, "topk")


def _pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _chunking(vocab: int) -> tuple[int, int]:
    """(ids per first-pass program, programs per row) for a vocabulary of `vocab` ids."""
    chunk = min(_CHUNK, _pow2(vocab))
    return chunk, (vocab + chunk - 1) // chunk


def _check_logits(name: str, logits: torch.Tensor) -> None:
    """Raises ValueError (prefixed `name`) unless logits is [n, V] float32 with a unit last stride."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"{name}: logits must be [n, V] float32 with a unit last stride, got "
                         f"{tuple(logits.shape)} {logits.dtype}")


def _check_draw_inputs(name: str, logits: torch.Tensor, params: torch.Tensor, uniform: torch.Tensor,
                       fallback: torch.Tensor) -> None:
    """The checks `top_k_sample` and `race_sample` share, after `_check_logits`: params [4, n] float32 contiguous,
    uniform [n, V] float64 with a unit last stride, fallback [n] int64, one device, and CUDA unless under
    ``TRITON_INTERPRET=1``. Raises ValueError (prefixed `name`)."""
    n, vocab = logits.shape
    if params.shape != (4, n) or params.dtype != torch.float32 or not params.is_contiguous():
        raise ValueError(f"{name}: params must be [4, {n}] float32, contiguous, got {tuple(params.shape)} "
                         f"{params.dtype}")
    if uniform.shape != (n, vocab) or uniform.dtype != torch.float64 or uniform.stride(-1) != 1:
        raise ValueError(f"{name}: uniform must be [{n}, {vocab}] float64 with a unit last stride")
    if fallback.shape != (n,) or fallback.dtype != torch.int64:
        raise ValueError(f"{name}: fallback must be [{n}] int64")
    if len({t.device for t in (logits, params, uniform, fallback)}) != 1:
        raise ValueError(f"{name}: tensors on several devices")
    if logits.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(f"{name}: needs CUDA tensors (got {logits.device}); use "
                         "vibeqwen.engine.sampler.sample_rows or TRITON_INTERPRET=1")


def _vocab_draw_output(name: str, logits: torch.Tensor, params: torch.Tensor, uniform: torch.Tensor,
                       fallback: torch.Tensor) -> torch.Tensor:
    """The checks of `race_sample` and `top_p_sample` (`_check_logits`, a vocabulary of 1 to 2^31 - 1 ids,
    `_check_draw_inputs`); returns their output, int64 [n] uninitialised. Raises ValueError (prefixed `name`)."""
    _check_logits(name, logits)
    n, vocab = logits.shape
    if vocab < 1 or vocab >= 1 << 31:
        raise ValueError(f"{name}: a vocabulary of {vocab} ids")
    _check_draw_inputs(name, logits, params, uniform, fallback)
    return torch.empty(n, dtype=torch.int64, device=logits.device)


def top_k_sample(logits: torch.Tensor, params: torch.Tensor, max_top_k: int, uniform: torch.Tensor,
                 fallback: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn as `vibeqwen.engine.sampler.candidate_probs` + `race` draw it: among the row's
    top_k ids (value descending, equal values by id ascending; NaN ranks as -inf), softmax(logits / temperature),
    ids under min_p x the largest probability dropped, then those whose preceding mass reaches top_p (top_p < 1;
    never the first), renormalised; the winner of the exponential race p / -log(U) with U = uniform[row, id]
    (float64, so ids far below the top one can still win). A row left with no mass takes fallback[row].

    logits: [n, V] float32, unit last stride, V < 2^20. params: [4, n] float32, contiguous: each row's temperature
    (> 0), top_k (a whole number, 1 <= top_k <= max_top_k), min_p and top_p. max_top_k: the batch's largest top_k
    (<= MAX_TOP_K), a host int. uniform: [n, V] float64, unit last stride. fallback: [n] int64 (the row's argmax).
    All on one device. Returns int64 [n]. Two launches, whatever n; no host sync.

    Ties with the reference: the candidate set and order are the same bit for bit (the same integer keys); the
    probabilities may differ in the last float32 bits (Triton's exp and sums), which changes a draw only where
    two race scores or a top_p cumulative sum lie within such rounding of each other.

    Raises:
        ValueError: shapes, dtypes, strides, devices or max_top_k out of range, or a CPU tensor outside the
            interpreter.
    """
    _check_logits("top_k_sample", logits)
    n, vocab = logits.shape
    if not 0 < vocab < _MAX_VOCAB:
        raise ValueError(f"top_k_sample: a vocabulary of {vocab} ids (the keys hold ids below 2^20)")
    if not 1 <= max_top_k <= min(MAX_TOP_K, vocab):
        raise ValueError(f"top_k_sample: max_top_k must be in [1, {min(MAX_TOP_K, vocab)}], got {max_top_k}")
    _check_draw_inputs("top_k_sample", logits, params, uniform, fallback)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    kern = _kernels()
    chunk, n_chunks = _chunking(vocab)
    kc = min(next(b for b in K_BUCKETS if b >= max_top_k), chunk)  # each chunk's candidates hold the row's top k
    keys = torch.empty(n, n_chunks * kc, dtype=torch.int64, device=logits.device)
    kern._chunk_top_keys_kernel[(n, n_chunks)](logits, keys, vocab, logits.stride(0), keys.stride(0), CHUNK=chunk,
                                               KC=kc, num_warps=4, **pdl_launch(logits.device))
    nk = _pow2(n_chunks * kc)
    kern._top_k_race_kernel[(n,)](logits, keys, uniform, params, fallback, out, n_chunks * kc, logits.stride(0),
                                  keys.stride(0), uniform.stride(0), n, NK=nk, K=kc,
                                  num_warps=8 if nk >= 4096 else 4, **pdl_launch(logits.device))
    return out


def race_sample(logits: torch.Tensor, params: torch.Tensor, uniform: torch.Tensor, fallback: torch.Tensor
                ) -> torch.Tensor:
    """One token per row over the whole vocabulary, drawn as `vibeqwen.engine.sampler.candidate_probs` + `race`
    draw it for rows without a top_k or a top_p: p = softmax(logits / temperature) (NaN logits as -inf, +inf as
    the largest float32), ids under min_p x the largest probability dropped; the winner of the exponential race
    p / -log(U) with U = uniform[row, id], the lowest id on ties. A row whose scaled logits are all -inf takes
    fallback[row]. Scores are taken as e / -log(U) with e = exp(scaled logit - the row's largest): the softmax's
    sum divides every score alike, so only float32 rounding of p separates the two, which changes a draw only
    where two race scores (or a probability and the min_p cut) lie within such rounding of each other, or where
    p underflows to 0 while e does not and every other kept id has U exactly 0.

    logits: [n, V] float32, unit last stride. params: [4, n] float32, contiguous, as `top_k_sample`'s (temperature >
    0, top_k unused, min_p in [0, 1], top_p unused). uniform: [n, V] float64, unit last stride. fallback: [n] int64
    (the row's argmax). All on one device. Returns int64 [n]. Three launches, whatever n; no host sync.

    Raises:
        ValueError: shapes, dtypes, strides or devices out of range, or a CPU tensor outside the interpreter.
    """
    out = _vocab_draw_output("race_sample", logits, params, uniform, fallback)
    n, vocab = logits.shape
    if n == 0:
        return out
    kern = _kernels("_race_kernels")
    chunk, n_chunks, nc, cmax, best, best_id = _race_start(kern, logits, params)
    kern._chunk_race_kernel[(n, n_chunks)](logits, uniform, params, cmax, best, best_id, vocab, logits.stride(0),
                                           uniform.stride(0), n, n_chunks, CHUNK=chunk, NC=nc, num_warps=4,
                                           **pdl_launch(logits.device))
    return _race_finish(kern, best, best_id, fallback, out)


def _race_start(kern, logits: torch.Tensor, params: torch.Tensor) -> tuple:
    """The whole-vocabulary draws' first launch (`_chunk_max_kernel`: each chunk's largest scaled logit, cmax) and
    the per-chunk buffers the race fills: (chunk, n_chunks, NC, cmax float32 [n, n_chunks], best float64
    [n, n_chunks], best_id int32 [n, n_chunks])."""
    n, vocab = logits.shape
    chunk, n_chunks = _chunking(vocab)
    dev = logits.device
    cmax = torch.empty(n, n_chunks, dtype=torch.float32, device=dev)
    best = torch.empty(n, n_chunks, dtype=torch.float64, device=dev)
    best_id = torch.empty(n, n_chunks, dtype=torch.int32, device=dev)
    kern._chunk_max_kernel[(n, n_chunks)](logits, params, cmax, vocab, logits.stride(0), n, n_chunks, CHUNK=chunk,
                                          num_warps=4, **pdl_launch(dev))
    return chunk, n_chunks, _pow2(n_chunks), cmax, best, best_id


def _race_finish(kern, best: torch.Tensor, best_id: torch.Tensor, fallback: torch.Tensor, out: torch.Tensor
                 ) -> torch.Tensor:
    """The last launch (`_race_reduce_kernel`): each row's winner over its chunks' best scores into out (fallback
    where no id has mass); returns out."""
    n, n_chunks = best.shape
    kern._race_reduce_kernel[(n,)](best, best_id, fallback, out, n_chunks, NC=_pow2(n_chunks), num_warps=1,
                                   **pdl_launch(best.device))
    return out


def top_p_sample(logits: torch.Tensor, params: torch.Tensor, uniform: torch.Tensor, fallback: torch.Tensor
                 ) -> torch.Tensor:
    """One token per row over the whole vocabulary with a top_p cut, drawn as `vibeqwen.engine.sampler`'s
    `candidate_probs` + `race` draw it for rows without a top_k: p = softmax(logits / temperature) (NaN logits as
    -inf, +inf as the largest float32), ids under min_p x the largest probability dropped, then the ids whose
    preceding mass (value descending, equal values by id ascending) reaches top_p (never the most likely; a row
    with top_p >= 1 cuts nothing); the winner of the exponential race p / -log(U) with U = uniform[row, id], the
    lowest id on ties. A row whose scaled logits are all -inf takes fallback[row].

    No sort: the cut is found by a search over the logits' 32-bit monotone keys (`_top_p_kernels`), 8 launches
    that each split the cut's key range in 16 and sum the mass above each part per vocabulary chunk. The mass is
    summed in another order than the reference's cumulative sum, which moves the cut only where the mass before
    an id lies within float32 rounding of top_p; the race as `race_sample`'s.

    logits: [n, V] float32, unit last stride. params: [4, n] float32, contiguous, as `top_k_sample`'s
    (temperature > 0, top_k unused, min_p in [0, 1], top_p in (0, 1]). uniform: [n, V] float64, unit last
    stride. fallback: [n] int64 (the row's argmax). All on one device. Returns int64 [n].
    TOP_P_PASSES + 3 launches, whatever n; no host sync.

    Raises:
        ValueError: shapes, dtypes, strides or devices out of range, or a CPU tensor outside the interpreter.
    """
    out = _vocab_draw_output("top_p_sample", logits, params, uniform, fallback)
    n, vocab = logits.shape
    if n == 0:
        return out
    race, kern = _kernels("_race_kernels"), _kernels("_top_p_kernels")
    chunk, n_chunks, nc, cmax, best, best_id = _race_start(race, logits, params)
    dev = logits.device
    tot = torch.empty(n, n_chunks, dtype=torch.float32, device=dev)
    part = torch.empty(TOP_P_PASSES, n, n_chunks, 16, dtype=torch.float32, device=dev)
    lo = torch.empty(TOP_P_PASSES, n, dtype=torch.int64, device=dev)
    cnt = torch.empty(n, n_chunks, 16, dtype=torch.int32, device=dev)
    grid = (n, n_chunks)
    for k in range(TOP_P_PASSES):
        kern._chunk_mass_kernel[grid](logits, params, cmax, tot, part, lo, cnt, k, vocab, logits.stride(0), n,
                                      n_chunks, CHUNK=chunk, SUB=min(chunk, TOP_P_SPAN), NC=nc, FIRST=k == 0,
                                      LAST=k == TOP_P_PASSES - 1, num_warps=4, **pdl_launch(dev))
    kern._chunk_race_top_p_kernel[grid](logits, uniform, params, cmax, tot, part, lo, cnt, best, best_id,
                                        TOP_P_PASSES - 1, vocab, logits.stride(0), uniform.stride(0), n, n_chunks,
                                        CHUNK=chunk, NC=nc, num_warps=4, **pdl_launch(dev))
    return _race_finish(race, best, best_id, fallback, out)
