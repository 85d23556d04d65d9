"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, with a per-request generator; a whole
batch of rows in a few launches (`sample_rows`)."""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from functools import partial

import numpy as np
import torch
from vibeqwen_kernels.sampling import (
    K_BUCKETS,
    MAX_TOP_K,
    race_sample,
    top_k_sample,
    top_k_sample_available,
    top_p_sample,
)

from vibeqwen.sampling import SamplingParams

log = logging.getLogger(__name__)


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator for one request: seeded from `params.seed` (any value in [-2^63, 2^64), mixed by a hash
    first: torch folds the seed's high bits away, so 0 and 2^63, say, would give the same draws), else from the OS
    entropy pool."""
    gen = torch.Generator(device=device)
    if params.seed is not None:
        digest = hashlib.blake2b(params.seed.to_bytes(9, "little", signed=True), digest_size=8).digest()
        gen.manual_seed(int.from_bytes(digest, "little") >> 1)
    else:
        gen.seed()
    return gen


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                   stop_ids: frozenset[int]) -> torch.Tensor:
    """Apply logit_bias, min_tokens and the repetition/presence/frequency penalties to one row.

    logits: [V] float32 (not modified); prompt_ids / output_ids: the request's tokens before this position;
    stop_ids: ids masked while fewer than min_tokens have been generated. Returns a new [V] float32 tensor.
    Order as in vLLM: bias, min_tokens, then penalties.
    """
    out = logits.float().clone()
    if params.logit_bias:
        ids, bias = params.logit_bias_on(out.device)
        out.index_add_(0, ids, bias)
    if len(output_ids) < params.min_tokens and stop_ids:
        out[list(stop_ids)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=out.device)
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=out.device), minlength=out.numel()).float()
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return out


def candidate_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The distribution each row samples from, over its candidate ids, for a batch of rows in a few launches
    (no per-row loop, no host sync): softmax(logits / T) restricted to the top_k most likely ids (if top_k > 0;
    exactly top_k of them), then to ids with probability >= min_p * the largest, then to the smallest set whose
    mass reaches top_p (the most likely id always kept), renormalised. Ids of equal logits rank by id (the lower
    first: `order_keys`), so the top_k cut and the top_p cut through equal values are the same in any batch.

    logits: [n, V] float32 (already processed); params: n non-greedy SamplingParams. Returns (probs, ids):
    probs [n, K] float32, finite, each row summing to 1; ids [n, K] int64, the vocabulary id of each column
    (columns sorted most likely first), or None where K = V and column j is id j (no row has a top_k or top_p:
    nothing is sorted). Scaled logits that overflow to +inf (a tiny repetition_penalty) become the largest
    float32, NaN ones -inf, and a row left with no mass at all (every logit -inf or NaN) becomes a one-hot at its
    argmax.
    """
    n, vocab = logits.shape
    dev = logits.device
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    # one host-to-device copy for the per-row values (top_k < 2^24 is exact in float32)
    temps, top_ks, min_ps, top_ps = to_device(
        [[p.temperature for p in params], ks, [p.min_p for p in params], [p.top_p for p in params]],
        torch.float32, dev)[:, :, None]
    x = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    fallback = torch.argmax(logits.float(), dim=-1, keepdim=True)  # a NaN row's NaN, as torch.argmax finds it
    ids = None
    truncate_p = any(p.top_p < 1.0 for p in params)
    if min(ks) < vocab or truncate_p:  # (a positive temperature keeps the order: select before scaling)
        k = max(ks)
        if k == vocab:  # the order_keys order from a stable sort of 32-bit keys (half the radix passes)
            _, ids = torch.sort(monotone_bits(x), dim=-1, descending=True, stable=True)
        else:
            _, ids = torch.topk(order_keys(x), k, dim=-1)
        x = x.gather(1, ids)
        if min(ks) < k:  # rows with a smaller top_k drop their columns past it
            x = x.masked_fill(torch.arange(k, device=dev) >= top_ks, float("-inf"))
    x = torch.nan_to_num(x / temps, posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.min_p > 0 for p in params):
        peak = probs[:, :1] if ids is not None else probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < min_ps * peak, 0.0)
    if truncate_p:  # the columns run from the most likely down
        # drop columns whose preceding cumulative mass already reaches top_p; never the first (a top_p below
        # float32's smallest value compares as 0). Rows with top_p 1 cut nothing: their float32 cumulative sum may
        # round to 1 before the last candidate, and whether they were cut must not depend on a batchmate's top_p
        drop = (row_cumsum(probs) - probs) >= torch.where(top_ps < 1.0, top_ps, 2.0)
        drop[:, 0] = False
        probs = probs.masked_fill(drop, 0.0)
    total = probs.sum(-1, keepdim=True)
    alive = torch.isfinite(total) & (total > 0)
    # a row with no mass left: a one-hot at its argmax
    if ids is None:
        one_hot = torch.zeros_like(probs).scatter_(1, fallback, 1.0)
    else:
        one_hot = torch.zeros_like(probs)
        one_hot[:, 0] = 1.0
        ids = torch.where(alive, ids, torch.cat([fallback, ids[:, 1:]], dim=1))
    return torch.where(alive, probs / total, one_hot), ids


def row_cumsum(x: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """The inclusive cumulative sum along the last dimension of x [n, K] float32, as a scan of `chunk`-column pieces
    plus the sum through the pieces before each: on a GPU torch's scan of a whole 248k-column row runs in one
    thread block (~300 us a step at batch 8-64, bench/kernels/bench_sampler.py --profile), the pieces in parallel.

    A row's sums should not depend on the other rows or their number (a seeded request's top_p cut): every row takes
    the same pieces at any n, and the pieces' ends are summed in float64 (a scan of one row may run another
    algorithm than a scan of many; in float64 their roundings agree once rounded to float32, barring a value within
    2^-29 of a float32 rounding boundary). Within a few float32 ulps of the exact sums, and never decreasing where
    x >= 0 and each piece's scan does not (a top_p cut keeps a prefix). Rows of at most 4 pieces scan whole."""
    n, k = x.shape
    if k <= 4 * chunk:
        return x.cumsum(-1)
    pad = -k % chunk
    pieces = (torch.nn.functional.pad(x, (0, pad)) if pad else x).reshape(n, -1, chunk).cumsum(-1)
    ends = pieces[:, :, -1].double().cumsum(-1).to(x.dtype)  # the sum through each piece's last column
    pieces[:, 1:] += ends[:, :-1, None]
    # the two roundings of a piece's end (its own column, the scan of the ends) may differ by an ulp: no piece
    # starts below the largest end before it, so the sums never step down between pieces
    floor = pieces[:, :, -1].cummax(-1).values
    pieces[:, 1:] = torch.maximum(pieces[:, 1:], floor[:, :-1, None])
    return pieces.reshape(n, -1)[:, :k]


def monotone_bits(x: torch.Tensor) -> torch.Tensor:
    """int32 [n, V] keys of float32 values x [n, V] (no NaN) that order as the values do, -0.0 just below +0.0: the
    float's bits with negative values' magnitude bits flipped (the high part of `order_keys`). A stable descending
    sort of them gives `order_keys`' order (equal keys keep the ascending ids)."""
    bits = x.contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys [n, V] of float32 values x [n, V] (no NaN) that sort as (value descending, id ascending) and are
    all distinct: the top k of a row, and the order among equal values (frequent: the logits come from a bf16
    head), then do not depend on how many columns the batch asks for or on the sort's algorithm. The float's bits
    made monotone (negative values' magnitude bits flipped) above 20 bits of the inverted id.

    Raises ValueError for a vocabulary of 2^20 ids or more."""
    vocab = x.shape[-1]
    if vocab >= 1 << 20:
        raise ValueError(f"order_keys: a vocabulary of {vocab} ids does not fit 20 bits")
    return monotone_bits(x).to(torch.int64) * (1 << 20) + ((1 << 20) - 1 - torch.arange(vocab, device=x.device))


def pinned_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host sync: copied from pinned memory on a GPU (a copy from pageable memory
    may wait for the stream's work, which async scheduling must not); returned as is on the CPU."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a `dtype` tensor on `device`, by `pinned_to`."""
    return pinned_to(torch.tensor(values, dtype=dtype), device)


def race(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The exponential race (the Gumbel-max trick): per row of probs [n, K], the column maximising p / E with
    E = -log(U) ~ Exp(1) from uniforms U [n, K] in [0, 1), so that column j wins with probability p_j. int64 [n].

    U is float64: E then reaches ~1e-16, where float32's U (steps of 2^-24) stops at ~6e-8 and an id under ~1e-7 of
    the top one's probability could never win. Columns with p = 0 never win, even where U = 0 (E = inf)."""
    score = probs.double() / uniform.log_().neg_()
    return torch.where(probs > 0, score, -1.0).argmax(-1)


def position_key(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draws for the token at sequence `position` (0-based index into
    prompt + output): 63 bits of a blake2b hash of both. Keying the draws by position makes a seeded request's
    token there the same however its steps fell: with or without speculative drafts, and whatever a preemption or
    the step budget did to them (`spec.verify_rows` samples every verified position with its own draws).

    Raises:
        OverflowError: `seed` outside [-2^71, 2^71) or `position` outside [0, 2^64) (SamplingParams keeps seeds
            in [-2^63, 2^64); positions are sequence indices)."""
    digest = hashlib.blake2b(seed.to_bytes(9, "little", signed=True) + position.to_bytes(8, "little"),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def draw_uniforms(n: int, vocab: int, device: torch.device, generators: Sequence[torch.Generator | None],
                  keys: Sequence[int | None] | None = None) -> torch.Tensor:
    """float64 uniforms [n, vocab] for `race`, one per vocabulary id: row i from generators[i] where it is given (a
    seeded request: its draws do not depend on the other rows), reseeded with keys[i] first where that is given
    (`position_key`), the rest from the device's default generator."""
    uniform = torch.rand(n, vocab, device=device, dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is None:
            continue
        if keys is not None and keys[i] is not None:
            if g.device.type == "cpu":
                # a CPU generator keeps 32 bits of a seed (two of a long reply's positions would share draws at
                # ~L^2 / 2^33): Philox keyed by all 64
                uniform[i] = torch.from_numpy(np.random.Generator(np.random.Philox(keys[i])).random(vocab)).to(device)
                continue
            g.manual_seed(keys[i])
        uniform[i].uniform_(generator=g)
    return uniform


def row_keys(params: Sequence[SamplingParams], positions: Sequence[int] | None) -> list[int | None] | None:
    """`draw_uniforms`' keys for rows sampling the tokens at `positions` (sequence indices, one a row; None: draw on
    from each generator's state): `position_key` for seeded rows, None for the others."""
    if positions is None:
        return None
    return [None if p.seed is None else position_key(p.seed, pos) for p, pos in zip(params, positions)]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`candidate_probs` of one row as a dense distribution: logits [V] float32 (already processed) -> probs [V]
    float32, finite and summing to 1. No host sync. Not for greedy params."""
    probs, ids = candidate_probs(logits[None], [params])
    # (add: a dead row's fallback id heads its columns and may come again further on, with 0)
    return probs[0] if ids is None else torch.zeros(logits.shape[-1], device=logits.device).scatter_add_(
        0, ids[0], probs[0])


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           position: int | None = None) -> int:
    """Draw one token id from processed logits [V] (float32): argmax (lowest id on ties) at temperature 0,
    else a draw from `target_probs` with `generator`: `sample_rows` of this one row (the token at sequence index
    `position`, if given)."""
    return int(sample_rows(logits[None], [params], [generator], None if position is None else [position])[0])


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None], positions: Sequence[int] | None = None
                ) -> torch.Tensor:
    """One token per row of processed logits [n, V] (float32), on the device, without a host sync: int64 [n].

    Greedy rows (temperature 0) take their argmax (lowest id on ties). The other rows draw from `candidate_probs`
    by the exponential race (`race`, the Gumbel-max trick, as vLLM samples) with a uniform for every vocabulary id,
    all rows in one pass. A seeded request (params.seed) draws its uniforms from its own generator, so its tokens
    do not depend on the other rows of the batch; with `positions` (the sequence index of the token each row
    samples), from its generator reseeded by `position_key` for that index, so they do not depend on how its steps
    fell either. Unseeded rows share one draw from the device's default generator. On a GPU, rows with a top_k up
    to `vibeqwen_kernels.sampling.MAX_TOP_K` (Qwen3.6's recommended sampling has 20) draw the same way in two
    Triton launches (`top_k_sample`: no vocabulary-wide keys or sort), rows that keep the whole vocabulary (no
    top_k, no top_p: temperature and min_p only) in three (`race_sample`: no vocabulary-wide softmax, mask and
    division chain), and rows with a top_p but no top_k in eleven (`top_p_sample`: the cut found by a search over
    the logits' keys, not a sort of the vocabulary); ``VIBEQWEN_FUSED_SAMPLER=0`` keeps all three here. Rows with a
    top_k above MAX_TOP_K sort the vocabulary here.
    """
    tokens = logits.argmax(-1)
    vocab = logits.shape[-1]
    available = top_k_sample_available(logits.device, vocab)
    fused, fused_race = available and not _fused_failed, available and not _race_failed
    fused_top_p = available and not _top_p_failed
    # rows that keep every id (no top_k, no top_p), rows the fused top-k kernels draw, the rest (PyTorch ops), and
    # rows with a top_p but no top_k: apart, so that no row is sorted or selected for another's sake
    # (candidate_probs works to the widest row of its batch)
    groups: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    for i, p in enumerate(params):
        if p.greedy:
            continue
        top_k = 0 < p.top_k < vocab
        if not top_k:
            group = 0 if p.top_p >= 1.0 else 3 if fused_top_p else 2
        else:
            group = 1 if fused and p.top_k <= MAX_TOP_K else 2
        groups[group].append(i)
    draws = {0: partial(_fused_vocab, top_p=False) if fused_race else None, 1: _fused_draw,
             3: partial(_fused_vocab, top_p=True)}
    for group, rows in enumerate(groups):
        if not rows:
            continue
        sub = [params[i] for i in rows]
        index = to_device(rows, torch.long, logits.device) if len(rows) < len(params) else None
        x = logits if index is None else logits[index]
        uniform = draw_uniforms(len(rows), vocab, logits.device,
                                [generators[i] if p.seed is not None else None for i, p in zip(rows, sub)],
                                row_keys(sub, None if positions is None else [positions[i] for i in rows]))
        picked = None
        if draws.get(group) is not None:  # a fused draw: the rows' argmax for rows with no mass
            fallback = tokens if index is None else tokens[index]
            picked = draws[group](x, sub, uniform, fallback)
        if picked is None:
            probs, ids = candidate_probs(x, sub)
            choice = race(probs, uniform if ids is None else uniform.gather(1, ids))
            picked = choice if ids is None else ids.gather(1, choice[:, None])[:, 0]
        if index is None:
            return picked
        tokens[index] = picked
    return tokens


_fused_failed = False  # the fused kernels failed once (e.g. a Triton without their features): not tried again
_race_failed = False  # the same for race_sample's kernels
_top_p_failed = False  # the same for top_p_sample's


def warm_up(vocab: int, device: torch.device) -> None:
    """Build the fused sampler's kernels for a vocabulary of `vocab` ids on `device` (each top_k bucket of
    `vibeqwen_kernels.sampling.K_BUCKETS`, and the whole-vocabulary race), so that no request waits for a compile;
    a build that fails is reported here and the PyTorch path samples from then on. The whole-vocabulary kernels'
    first draws are also checked against the PyTorch path (`check_race`, `check_top_p`). A no-op where the kernels
    do not run."""
    if not top_k_sample_available(device, vocab):
        return
    if not _fused_failed:
        logits = torch.zeros(1, vocab, device=device)
        for k in K_BUCKETS:
            params = [SamplingParams(temperature=1.0, top_k=min(k, vocab - 1))]
            if _fused_draw(logits, params, draw_uniforms(1, vocab, device, [None]), logits.argmax(-1)) is None:
                break
    if not _race_failed:
        check_race(vocab, device)
    if not _top_p_failed:
        check_top_p(vocab, device)


def check_race(vocab: int, device: torch.device) -> bool:
    """A start-up check of `race_sample` against the PyTorch path (`candidate_probs` + `race`) on fixed rows and
    uniforms: random logits at temperatures 0.6-1.5 and min_p 0-0.3, a row with NaN entries and two +inf ones, a
    row of only -inf (its argmax), and min_p probes (an id 1e-3 x the temperature inside the cut and one outside,
    each forced to win if kept). Rows whose top two race scores are within a relative 1e-5 are not compared. A
    disagreement (or a kernel that fails to build or launch) is reported and turns the whole-vocabulary kernels
    off for this process. Returns whether they passed (True without checking below 2 ids). Syncs the device
    (start-up only); uses its own CPU generator, none that requests draw from.

    Raises:
        ValueError: from `race_sample`, for arguments it refuses (a bug here)."""
    global _race_failed
    if vocab < 2:
        return True
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, vocab, generator=g) * 3
    u = torch.rand(8, vocab, generator=g, dtype=torch.float64)
    knobs = [(1.0, 0.0), (0.6, 0.05), (1.5, 0.0), (0.8, 0.3), (1.0, 0.0), (1.0, 0.0), (0.7, 0.1), (0.7, 0.1)]
    x[4, : vocab // 2] = float("nan")
    x[4, [0, vocab - 1]] = float("inf")
    x[5] = float("-inf")
    for row in (6, 7):  # min_p probes: ids 0 (the peak), 1 just inside the cut, 2 just outside (if there)
        t, mp = knobs[row]
        cut = t * math.log(mp)
        x[row] = -1e4
        x[row, 0] = 0.0
        x[row, 1] = cut + 1e-3 * t
        if vocab > 2:
            x[row, 2] = cut - 1e-3 * t
        u[row] = 1e-300
        u[row, min(row - 5, vocab - 1)] = 1 - 2**-52  # id 1 (kept: wins), id 2 (dropped: id 0 wins)
    params = [SamplingParams(temperature=t, min_p=mp) for t, mp in knobs]
    x, u = x.to(device), u.to(device)
    got = _fused_vocab(x, params, u, x.argmax(-1), top_p=False)
    if got is None:
        return False
    probs, _ = candidate_probs(x, params)
    want = race(probs, u.clone())
    scores = torch.where(probs > 0, probs.double() / -u.log(), -1.0).topk(2, dim=-1).values
    clear = scores[:, 0] > scores[:, 1] * (1 + 1e-5)
    clear[5] = True  # no mass: the argmax, both ways
    wrong = ((got != want) & clear).nonzero().flatten().tolist()
    if wrong:
        _race_failed = True
        log.warning("the fused whole-vocabulary sampler disagreed with the PyTorch path at start-up (rows %s: %s "
                    "against %s); sampling such rows with PyTorch ops", wrong, got[wrong].tolist(),
                    want[wrong].tolist())
    return not wrong


def check_top_p(vocab: int, device: torch.device) -> bool:
    """A start-up check of `top_p_sample` against the PyTorch path (`candidate_probs` + `race`) on fixed rows and
    uniforms: random logits (rounded to 0.1: ties at the cut) at temperatures 0.6-1.5, top_p 0.3-0.95 and min_p
    0-0.1, a row with NaN entries and two +inf ones, a row of only -inf (its argmax), a top_p under float32's
    smallest value (the most likely id alone), and cut probes on a row of equal logits (top_p just above one half:
    the id that ends the cut and the next one, each forced to win if kept). Rows whose top two race scores are
    within a relative 1e-5, or whose mass before an id lies within 1e-5 of top_p, are not compared. A
    disagreement (or a kernel that fails to build or launch) is reported and turns those kernels off for this
    process (the other fused kernels stay on). Returns whether they passed (True without checking below 4 ids).
    Syncs the device (start-up only); uses its own CPU generator, none that requests draw from.

    Raises:
        ValueError: from `top_p_sample`, for arguments it refuses (a bug here)."""
    global _top_p_failed
    if vocab < 4:
        return True
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(9, vocab, generator=g) * 3).round(decimals=1)
    u = torch.rand(9, vocab, generator=g, dtype=torch.float64)
    knobs = [(1.0, 0.9, 0.0), (0.6, 0.5, 0.0), (1.5, 0.95, 0.05), (0.8, 0.3, 0.1), (1.0, 0.8, 0.0), (1.0, 0.9, 0.0),
             (0.7, 1e-40, 0.0), (1.0, 0.5, 0.0), (1.0, 0.5, 0.0)]
    x[4, : vocab // 2] = float("nan")
    x[4, [0, vocab - 1]] = float("inf")
    x[5] = float("-inf")
    half = vocab // 2  # equal logits: every id holds 1 / vocab, and the cut keeps ids 0 .. half
    for row in (7, 8):
        knobs[row] = (1.0, (half + 0.3) / vocab, 0.0)
        x[row] = 0.0
        u[row] = 1e-300
        u[row, half + row - 7] = 1 - 2**-52  # id half (kept: wins), id half + 1 (dropped: id 0 wins)
    params = [SamplingParams(temperature=t, top_p=tp, min_p=mp) for t, tp, mp in knobs]
    x, u = x.to(device), u.to(device)
    got = _fused_vocab(x, params, u, x.argmax(-1), top_p=True)
    if got is None:
        return False
    probs, ids = candidate_probs(x, params)
    uc = u.gather(1, ids)
    want = ids.gather(1, race(probs, uc.clone())[:, None])[:, 0]
    scores = torch.where(probs > 0, probs.double() / -uc.log(), -1.0).topk(2, dim=-1).values
    tops = torch.tensor([p.top_p for p in params], device=device)[:, None]
    near_cut = ((mass_before(x, params, ids) - tops).abs() <= 1e-5).any(-1)
    clear = (scores[:, 0] > scores[:, 1] * (1 + 1e-5)) & ~near_cut
    # no mass: the argmax; a tiny top_p: the most likely id alone; the probes: one id forced
    clear[5] = clear[6] = clear[7] = clear[8] = True
    wrong = ((got != want) & clear).nonzero().flatten().tolist()
    if wrong:
        _top_p_failed = True
        log.warning("the fused top-p sampler disagreed with the PyTorch path at start-up (rows %s: %s against %s); "
                    "sampling such rows with PyTorch ops", wrong, got[wrong].tolist(), want[wrong].tolist())
    return not wrong


def mass_before(logits: torch.Tensor, params: Sequence[SamplingParams], ids: torch.Tensor) -> torch.Tensor:
    """The mass `candidate_probs`' top_p cut compares with top_p, before the cut: for logits [n, V] float32 and the
    columns' ids [n, V] (its whole-vocabulary order), float32 [n, V], column j = the softmax(logits / T) mass (min_p
    applied) of the columns before j. For checks of a cut at float32 rounding (`check_top_p`, tests)."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    min_ps = torch.tensor([p.min_p for p in params], device=logits.device)[:, None]
    x = torch.nan_to_num(logits.float(), nan=float("-inf")).gather(1, ids)
    probs = torch.softmax(torch.nan_to_num(x / temps, posinf=torch.finfo(torch.float32).max, neginf=float("-inf")), -1)
    probs = probs.masked_fill(probs < min_ps * probs[:, :1], 0.0)
    return row_cumsum(probs) - probs


def _fused_draw(x: torch.Tensor, params: Sequence[SamplingParams], uniform: torch.Tensor, fallback: torch.Tensor
                ) -> torch.Tensor | None:
    """`top_k_sample` of rows with a top_k (x [n, V] float32, uniform [n, V] float64, fallback [n] int64: the rows'
    argmax); None, with a warning the first time, when the kernels cannot be built or launched here."""
    global _fused_failed
    values = to_device([[p.temperature for p in params], [p.top_k for p in params], [p.min_p for p in params],
                        [p.top_p for p in params]], torch.float32, x.device)
    try:
        return top_k_sample(x.contiguous(), values, max(p.top_k for p in params), uniform, fallback)
    except ValueError:  # bad arguments: a bug here, not a kernel that cannot run
        raise
    # a compile or launch failure: the batched PyTorch path draws the same tokens
    except Exception as e:  # noqa: BLE001
        _fused_failed = True
        log.warning("the fused top-k sampler failed (%s: %s); sampling with PyTorch ops from now on",
                    type(e).__name__, e)
        return None


def _fused_vocab(x: torch.Tensor, params: Sequence[SamplingParams], uniform: torch.Tensor, fallback: torch.Tensor,
                 *, top_p: bool) -> torch.Tensor | None:
    """`race_sample` of rows that keep the whole vocabulary, or (`top_p`) `top_p_sample` of rows with a top_p but no
    top_k (x [n, V] float32, uniform [n, V] float64, fallback [n] int64: the rows' argmax); None, with a warning the
    first time, when those kernels cannot be built or launched here (then only they are turned off)."""
    global _race_failed, _top_p_failed
    values = to_device([[p.temperature for p in params], [0.0] * len(params), [p.min_p for p in params],
                        [p.top_p if top_p else 1.0 for p in params]], torch.float32, x.device)
    try:
        return (top_p_sample if top_p else race_sample)(x.contiguous(), values, uniform, fallback)
    except ValueError:  # bad arguments: a bug here, not a kernel that cannot run
        raise
    except Exception as e:  # noqa: BLE001 - a compile or launch failure: the PyTorch path draws the same tokens
        if top_p:
            _top_p_failed = True
        else:
            _race_failed = True
        log.warning("the fused %s sampler failed (%s: %s); sampling such rows with PyTorch ops from now on",
                    "top-p" if top_p else "whole-vocabulary", type(e).__name__, e)
        return None


def top_logprobs(logits: torch.Tensor, token_id: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of token_id, the k most likely (id, logprob)) under log_softmax(logits) of one raw row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(lp, k) if k else None
    alts = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return float(lp[token_id]), alts
