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


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T) restricted to the top_k most likely ids
    (if top_k > 0) and to the smallest set whose mass reaches top_p (the most likely id always kept),
    renormalised. logits: [V] float32 -> probs [V] float32. Not for temperature 0 (greedy)."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # drop ids whose preceding cumulative mass already reaches top_p
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs / probs.sum()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Draw one token id from logits [V] (float32): argmax (lowest id on ties) at temperature 0, else a draw
    from `target_probs` with `generator`."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(target_probs(logits, params), 1, generator=generator))
