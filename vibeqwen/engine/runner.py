"""Turns a scheduler decision into one forward pass and one sampled token per finishing row."""

from __future__ import annotations

import torch

from vibeqwen.engine.cache import CacheManager
from vibeqwen.engine.sampler import sample
from vibeqwen.engine.scheduler import SchedulerOutput
from vibeqwen.model.cache import ModelCache
from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
from vibeqwen.model.state import ForwardBatch


class ModelRunner:
    """Owns the model and its cache tensors; `execute` runs one flattened batch."""

    def __init__(self, model: Qwen3_5MoeForCausalLM, cache: ModelCache, cache_manager: CacheManager):
        self.model = model
        self.cache = cache
        self.cache_manager = cache_manager
        self.device = model.device

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        """Run the scheduled tokens; return request id -> sampled token for rows that complete a request's
        known tokens (partial prefill chunks sample nothing)."""
        ids, query_lens, context_lens, tables, slots = [], [], [], [], []
        for s in output.scheduled:
            r, c, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            ids.extend(r.all_token_ids[c : c + n])
            query_lens.append(n)
            context_lens.append(c)
            tables.append(self.cache_manager.block_tables[r.request_id])
            slots.append(self.cache_manager.slots[r.request_id])
        batch = ForwardBatch(self.cache, query_lens, context_lens, tables, slots)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model.forward(input_ids, batch.positions(self.device), batch)
        rows = [(s, batch.starts[j] + s.num_new_tokens - 1) for j, s in enumerate(output.scheduled) if s.samples]
        if not rows:
            return {}
        logits = self.model.logits(hidden[[r for _, r in rows]])
        return {s.request.request_id: sample(logits[j], s.request.params, s.request.generator)
                for j, (s, _) in enumerate(rows)}
