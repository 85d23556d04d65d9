"""Turns a scheduler decision into one forward pass: sampled tokens, speculative verification, MTP drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vibeqwen.engine.cache import CacheManager
from vibeqwen.engine.sampler import process_logits, sample, top_logprobs
from vibeqwen.engine.scheduler import SchedulerOutput
from vibeqwen.engine.spec import SpecConfig, verify
from vibeqwen.model.cache import ModelCache
from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
from vibeqwen.model.state import ForwardBatch


Logprob = tuple[float, list[tuple[int, float]]]  # (logprob of the token, top (id, logprob) alternatives)


@dataclass
class RunnerOutput:
    """tokens: request id -> new tokens (accepted drafts, then one sampled token) for rows that sample.
    logprobs: request id -> one Logprob per token in `tokens` (requests that asked for logprobs).
    prompt_logprobs: request id -> Logprobs of the prompt tokens this step scored (in prompt order).
    mtp_drafts: request id -> the MTP head's k drafts following those tokens (when MTP is on)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    mtp_drafts: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    """Owns the model and its cache tensors; `execute` runs one flattened batch."""

    def __init__(self, model: Qwen3_5MoeForCausalLM, cache: ModelCache, cache_manager: CacheManager,
                 spec: SpecConfig = SpecConfig()):
        self.model = model
        self.cache = cache
        self.cache_manager = cache_manager
        self.spec = spec
        self.device = model.device

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Run the scheduled tokens and sample. Partial prefill chunks sample nothing; a request with drafts
        gets its drafts verified (`spec.verify`) and its GDN state rolled back to the last accepted token."""
        ids, query_lens, context_lens, tables, slots, keep = [], [], [], [], [], []
        for s in output.scheduled:
            r, c, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            known = n - len(s.spec_token_ids)
            ids.extend(r.token_slice(c, c + known) + s.spec_token_ids)
            query_lens.append(n)
            context_lens.append(c)
            tables.append(self.cache_manager.block_tables[r.request_id])
            slots.append(self.cache_manager.slots[r.request_id])
            keep.append(bool(s.spec_token_ids))
        batch = ForwardBatch(self.cache, query_lens, context_lens, tables, slots, keep)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = batch.positions(self.device)
        hidden = self.model.forward(input_ids, positions, batch)

        # rows to score: for each sampling request, its last known token and every draft
        rows, owners = [], []
        for j, s in enumerate(output.scheduled):
            if s.samples:
                last = batch.starts[j] + s.num_new_tokens - 1
                rows.extend(range(last - len(s.spec_token_ids), last + 1))
                owners.append(j)
        result = RunnerOutput()
        logits = self.model.logits(hidden[rows]) if rows else None
        kept = list(query_lens)  # tokens of each sequence whose results stand after verification
        off = 0
        for j in owners:
            s = output.scheduled[j]
            r, d = s.request, len(s.spec_token_ids)
            raw = logits[off : off + d + 1]
            off += d + 1
            block = raw
            if r.params.constraint is not None:
                mask = r.params.constraint.allowed(raw.shape[-1])
                if mask is not None:
                    block = raw.masked_fill(~mask.to(raw.device), float("-inf"))
            if r.params.logit_bias or r.params.needs_history:
                # row i scores the position after the request's outputs plus the first i drafts
                processed = torch.stack([process_logits(block[i], r.params, r.prompt_token_ids,
                                                        r.output_token_ids + s.spec_token_ids[:i], r.stop_ids)
                                         for i in range(d + 1)])
                # min_tokens must not mask the only tokens a constraint allows (e.g. EOS at the end of a
                # grammar): where a row has nothing left, keep it as the constraint left it
                dead = torch.isneginf(processed).all(-1)
                block = torch.where(dead[:, None], block, processed)
            if d:
                tokens = verify(block, s.spec_token_ids, r.params, r.generator)
                kept[j] = s.num_new_tokens - d + len(tokens) - 1
                batch.commit_gdn_state(j, kept[j])
            else:
                tokens = [sample(block[0], r.params, r.generator)]
            result.tokens[r.request_id] = tokens
            if r.params.logprobs is not None:
                result.logprobs[r.request_id] = [top_logprobs(raw[i], t, r.params.logprobs)
                                                 for i, t in enumerate(tokens)]
        self._prompt_logprobs(output, batch, hidden, result)
        if self.spec.uses_mtp and self.model.mtp is not None:
            result.mtp_drafts = self._mtp(output, batch, hidden, positions, kept, result.tokens)
        return result

    def _prompt_logprobs(self, output, batch, hidden, result: RunnerOutput) -> None:
        """Score prompt tokens for requests that asked for prompt logprobs: the row of position p gives the
        logprob of prompt token p+1. Positions already scored (before a preemption) are skipped."""
        for j, s in enumerate(output.scheduled):
            r = s.request
            k = r.params.prompt_logprobs
            if k is None:
                continue
            c, prompt = r.num_computed_tokens, r.prompt_token_ids
            first = max(c, len(r.prompt_logprobs))  # position whose row scores token first + 1
            last = min(c + s.num_new_tokens, len(prompt) - 1)
            if first >= last:
                continue
            rows = [batch.starts[j] + p - c for p in range(first, last)]
            lg = self.model.logits(hidden[rows])
            result.prompt_logprobs[r.request_id] = [top_logprobs(lg[i], prompt[p + 1], k)
                                                    for i, p in enumerate(range(first, last))]

    def _mtp(self, output, batch, hidden, positions, kept, tokens) -> dict[str, list[int]]:
        """Run the MTP head over every position that stands this step (keeping its KV cache complete), then
        draft k tokens autoregressively for each request that sampled."""
        mtp = self.model.mtp
        rows, next_ids, qlens = [], [], []
        for j, s in enumerate(output.scheduled):
            r, c, m = s.request, s.request.num_computed_tokens, kept[j]
            # position p pairs hidden_p with token p+1; the last kept position pairs with the new token
            known = r.token_slice(c + 1, min(c + m, r.num_tokens))
            following = (known + s.spec_token_ids)[: m - 1]
            following.append(tokens[r.request_id][-1] if r.request_id in tokens else r.token_slice(c + m, c + m + 1)[0])
            rows.extend(range(batch.starts[j], batch.starts[j] + m))
            next_ids.extend(following)
            qlens.append(m)
        mbatch = ForwardBatch(self.cache, qlens, batch.context_lens, batch.block_tables, batch.gdn_slots)
        h = mtp.forward(torch.tensor(next_ids, device=self.device), hidden[rows], positions[rows], mbatch)
        k = self.spec.num_speculative_tokens
        drafts: dict[str, list[int]] = {}
        sampling = [(j, s) for j, s in enumerate(output.scheduled) if s.request.request_id in tokens]
        if not sampling:
            return drafts
        last = [mbatch.starts[j] + qlens[j] - 1 for j, _ in sampling]
        cur_h = h[last]
        cur_tok = self.model.logits(cur_h).argmax(-1)
        for j, s in sampling:
            drafts[s.request.request_id] = []
        for step in range(k):
            for idx, (j, s) in enumerate(sampling):
                drafts[s.request.request_id].append(int(cur_tok[idx]))
            if step == k - 1:
                break
            # feed (MTP hidden, drafted token) at the next positions; these K/V entries are provisional and
            # are rewritten by the next step's MTP pass over verified positions
            pos = [batch.context_lens[j] + qlens[j] + step for j, _ in sampling]
            sbatch = ForwardBatch(self.cache, [1] * len(sampling), pos,
                                  [batch.block_tables[j] for j, _ in sampling], [batch.gdn_slots[j] for j, _ in sampling])
            cur_h = mtp.forward(cur_tok, cur_h, torch.tensor(pos, device=self.device), sbatch)
            cur_tok = self.model.logits(cur_h).argmax(-1)
        return drafts
