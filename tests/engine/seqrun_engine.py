"""Logits of one long prefill over the engine's model, on a private cache (for logprob checks)."""

from __future__ import annotations

import torch

from vibeqwen.model.cache import ModelCache
from vibeqwen.model.state import ForwardBatch


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] float32 logits of one prefill of `tokens`."""
    bs = 16
    cache = ModelCache(model.cfg, -(-len(tokens) // bs), bs, 1, model.dtype)
    batch = ForwardBatch(cache, [len(tokens)], [0], [list(range(cache.num_blocks))], [0])
    return model.logits(model.forward(torch.tensor(tokens), batch.positions(), batch))
