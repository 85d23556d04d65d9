"""Token sampling from logits: greedy, temperature, top-k, top-p, with a per-request generator."""

from __future__ import annotations

import torch

from vibeqwen.sampling import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator for one request: seeded by `params.seed`, else from the OS entropy pool."""
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
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


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T) restricted to the top_k most likely ids
    (if top_k > 0), to the smallest set whose mass reaches top_p (the most likely id always kept) and to ids
    with probability >= min_p * the largest, renormalised. logits: [V] float32 (already processed) -> probs
    [V] float32, finite and summing to 1 for any valid params: scaled logits that overflow to +inf (a tiny
    repetition_penalty) become the largest float32, NaN ones -inf, and a row left with no mass at all (every
    logit -inf or NaN) becomes a one-hot at its argmax. No host sync. Not for greedy params."""
    logits = logits.float()
    fallback = torch.argmax(logits)
    logits = torch.nan_to_num(logits / params.temperature, nan=float("-inf"), posinf=torch.finfo(torch.float32).max,
                              neginf=float("-inf"))
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # drop ids whose preceding cumulative mass already reaches top_p; never the most likely one (a top_p
        # below float32's smallest value compares as 0)
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    total = probs.sum()
    one_hot = torch.zeros_like(probs).scatter_(0, fallback.reshape(1), 1.0)
    return torch.where(torch.isfinite(total) & (total > 0), probs / total, one_hot)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Draw one token id from processed logits [V] (float32): argmax (lowest id on ties) at temperature 0,
    else a draw from `target_probs` with `generator`."""
    return int(sample_tensor(logits, params, generator))


def sample_tensor(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """`sample` without reading the result on the host: the token id as an int64 tensor [1] on the logits'
    device (no host sync on a GPU; the generator advances exactly as `sample` advances it)."""
    if params.greedy:
        return torch.argmax(logits).reshape(1)
    return torch.multinomial(target_probs(logits, params), 1, generator=generator)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of raw logits [n, V] (rows need no logit processing: no bias, penalties or
    constraint), on the device, without a host sync: int64 [n]. Row i gives what `sample(logits[i],
    params[i], generators[i])` gives; greedy rows share one argmax."""
    tokens = logits.argmax(-1)
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[i : i + 1] = sample_tensor(logits[i], p, g)
    return tokens


def top_logprobs(logits: torch.Tensor, token_id: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of token_id, the k most likely (id, logprob)) under log_softmax(logits) of one raw row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(lp, k) if k else None
    alts = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return float(lp[token_id]), alts
