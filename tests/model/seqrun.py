"""Drive the model directly over the paged cache, one or several sequences, for model-level tests."""

from __future__ import annotations

import torch

from vibeqwen.model.cache import ModelCache
from vibeqwen.model.state import ForwardBatch


class Sequences:
    """Owns a small ModelCache; sequence i gets GDN slot i and a disjoint, scrambled block range."""

    def __init__(self, model, num_seqs: int = 4, block_size: int = 8, max_len: int = 512,
                 state_dtype: torch.dtype = torch.float32):
        blocks_per_seq = -(-max_len // block_size)
        self.model = model
        self.cache = ModelCache(model.cfg, num_seqs * blocks_per_seq, block_size, num_seqs, model.dtype,
                                state_dtype=state_dtype)
        # reversed block order: a bug that assumes contiguous blocks shows up
        self.tables = [list(range((i + 1) * blocks_per_seq - 1, i * blocks_per_seq - 1, -1)) for i in range(num_seqs)]
        self.lens = [0] * num_seqs

    def run(self, feeds: dict[int, list[int]], keep: set[int] = frozenset()) -> torch.Tensor:
        """Run one flattened pass: feeds maps sequence index -> its new tokens; sequences in `keep` keep their GDN
        state after every token (a speculative verification pass: see `self.last_batch.commit_gdn_state`).
        Returns logits [T, V]."""
        seqs = list(feeds)
        batch = ForwardBatch(self.cache, [len(feeds[i]) for i in seqs], [self.lens[i] for i in seqs],
                             [self.tables[i] for i in seqs], seqs, [i in keep for i in seqs])
        ids = torch.tensor([t for i in seqs for t in feeds[i]])
        hidden = self.model.forward(ids, batch.positions(), batch)
        for i in seqs:
            self.lens[i] += len(feeds[i])
        self.last_batch = batch
        return self.model.logits(hidden)
