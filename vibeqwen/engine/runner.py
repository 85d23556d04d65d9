"""Turns a scheduler decision into one forward pass: sampled tokens, speculative verification, MTP drafts."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from vibeqwen.engine.cache import CacheManager
from vibeqwen.engine.inflight import InFlightStep
from vibeqwen.engine.sampler import pinned_to, process_logits, sample, sample_rows, top_logprobs
from vibeqwen.engine.scheduler import SchedulerOutput
from vibeqwen.engine.spec import SpecConfig, greedy_accept, verify, verify_rows
from vibeqwen.model.cache import ModelCache
from vibeqwen.model.mtp import draft_tokens
from vibeqwen.model.quant_linear import prompt_pass
from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
from vibeqwen.model.state import ForwardBatch, GDNHistoryBuffers

log = logging.getLogger(__name__)


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


#: Queries up to this long run with speculative verification in one pass (GPU path); longer ones (prompt
#: chunks, which would otherwise keep a per-token GDN state too) run in a second pass, see
#: `ModelRunner._forward_split`.
SPEC_GROUP_MAX_QUERY = 1

#: A step that mixes decode (or verification) rows with prompt chunks, or runs several prompt chunks, and that no one
#: graph fits, replays one graph per piece when every piece fits one (the decode rows in a decode or verification
#: graph, each chunk in a prefill graph) and there are at most this many chunks; else it runs one eager pass. Why: an
#: eager pass launches ~1000 kernels from Python; on the H200 an eager 1k-token prefill took 55.6 ms against 24.2
#: graphed (bench/results/h200.json), so while a prompt arrives every running sequence's step would cost that.
#: `VIBEQWEN_MIXED_GRAPHS=0` keeps the one eager pass (measuring).
MIXED_GRAPH_MAX_CHUNKS = 4


def mixed_graphs_enabled() -> bool:
    """`VIBEQWEN_MIXED_GRAPHS`: unset or 1 splits mixed steps into graph replays (see MIXED_GRAPH_MAX_CHUNKS), 0 not.

    Raises:
        ValueError: any other value.
    """
    v = os.environ.get("VIBEQWEN_MIXED_GRAPHS", "1")
    if v not in ("0", "1"):
        raise ValueError(f"VIBEQWEN_MIXED_GRAPHS must be 0 or 1, got {v!r}")
    return v == "1"


def mtp_graphs_enabled() -> bool:
    """`VIBEQWEN_MTP_GRAPHS`: 1 captures CUDA graphs of the MTP head's draft passes (`capture_mtp_graphs`), unset or
    0 drafts eagerly (the default until the graphs are measured on a GPU).

    Raises:
        ValueError: any other value.
    """
    from vibeqwen_kernels.switches import env_switch

    return env_switch("VIBEQWEN_MTP_GRAPHS", "0")


def _plain_greedy(s) -> bool:
    """A sequence whose tokens are the plain argmax of its logit rows (what `sample` would return at
    temperature 0, and what `verify` compares its drafts with): greedy, no constraint, bias or penalties."""
    p = s.request.params
    return p.greedy and p.constraint is None and not p.logit_bias and not p.needs_history


def _first_position(s) -> int:
    """The sequence index (into prompt + output) of the first token a scheduled request samples this step: the one
    after its last known token (its drafts' verification rows sample the indices after it). A seeded request's
    draws are keyed by it (`sampler.position_key`)."""
    return s.request.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids)


def _plain_sampled(s) -> bool:
    """A sampling (not greedy) sequence whose logit rows need no processing (no constraint, bias or penalties):
    `sample_rows` draws its token, or `verify_rows` checks its drafts, with the batch's other such sequences."""
    p = s.request.params
    return not p.greedy and p.constraint is None and not p.logit_bias and not p.needs_history


class ModelRunner:
    """Owns the model and its cache tensors; `execute` runs one flattened batch."""

    def __init__(self, model: Qwen3_5MoeForCausalLM, cache: ModelCache, cache_manager: CacheManager,
                 spec: SpecConfig = SpecConfig(), fp8_prefill_w8a8: bool = False, token_vocab: int | None = None):
        self.model = model
        # FP8 projections of passes that carry prompt tokens run W8A8 (EngineConfig.fp8_prefill; GPU path)
        self.fp8_prefill_w8a8 = fp8_prefill_w8a8
        self.cache = cache
        self.cache_manager = cache_manager
        self.spec = spec
        self.device = model.device
        # ids from here up are logits rows no text decodes to (the tokenizer has fewer ids than the LM head rows):
        # masked in rows with a logit_bias, which could otherwise push every real token below them; None: no such rows
        self.token_vocab = token_vocab
        self.graphs = None  # DecodeGraphs, set by `capture_decode_graphs` on the GPU path
        self.verify_graphs = {}  # tokens per sequence -> DecodeGraphs of verification steps (capture_verify_graphs)
        self.prefill_graphs = None  # PrefillGraphs of one sequence's prompt chunk (capture_prefill_graphs)
        self.mtp_graphs = None  # MTPDraftGraphs of the MTP head's draft passes (capture_mtp_graphs)
        mixed_graphs_enabled()  # a bad VIBEQWEN_MIXED_GRAPHS fails the engine's start, not a step
        mtp_graphs_enabled()  # the same for VIBEQWEN_MTP_GRAPHS
        self.history_buffers = None  # GDNHistoryBuffers: preallocated verification history (allocate_history_buffers)
        self.last_graphed = False  # whether the last forward pass replayed a CUDA graph
        # async scheduling: two pinned buffers for the sampled tokens of in-flight steps, used in turn
        self._staging: list[torch.Tensor | None] = [None, None]
        self._launches = 0

    def _table_width(self, max_model_len: int) -> int:
        """Block-table width of the graphs' static buffers: blocks of a sequence of max_model_len tokens plus
        the speculative lookahead (a sequence near max_model_len still has k draft slots)."""
        return -(-(max_model_len + self.spec.num_speculative_tokens) // self.cache.block_size)

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture CUDA graphs of the decode pass for batches up to `max_batch` sequences of up to
        `max_model_len` tokens (GPU path only)."""
        from vibeqwen.model.cuda_graphs import DecodeGraphs, default_batch_sizes

        width = self._table_width(max_model_len)
        self.graphs = DecodeGraphs(self.model, self.cache, width, default_batch_sizes(max_batch))

    def capture_prefill_graphs(self, max_tokens: int, max_model_len: int) -> bool:
        """Capture CUDA graphs of whole prompt chunks of one sequence, up to `max_tokens` tokens, for sequences
        of up to `max_model_len` tokens (`vibeqwen.model.prefill_graphs`; GPU path). Returns whether they are
        on: a failed capture logs a warning and leaves prefill eager (correct, only slower)."""
        from vibeqwen.model.prefill_graphs import GRAPH_MIN_TOKENS, PrefillGraphs

        if max_tokens <= GRAPH_MIN_TOKENS:
            log.info("no prefill CUDA graphs: chunks of at most %d tokens run eagerly", GRAPH_MIN_TOKENS)
            return False
        width = self._table_width(max_model_len)
        def capture():
            with prompt_pass(self.fp8_prefill_w8a8):  # the graphs record the FP8 layers' choice
                return PrefillGraphs(self.model, self.cache, width, max_tokens)

        self.prefill_graphs = self._optional_capture("prefill", "prompt chunks run eagerly", capture)
        return self.prefill_graphs is not None

    def _optional_capture(self, what: str, fallback: str, capture):
        """`capture()`'s graphs, or None where it raises: an optional speed-up must never stop the engine, so the
        failure is logged ("could not capture the <what> CUDA graphs (<error>); <fallback>") and the allocator's
        cached blocks of the failed capture released."""
        try:
            return capture()
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning("could not capture the %s CUDA graphs (%s); %s", what, e, fallback)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return None

    def capture_mtp_graphs(self, max_batch: int, max_model_len: int) -> bool:
        """Capture CUDA graphs of the MTP head's draft passes (`vibeqwen.model.mtp_graphs`) for batches up to
        `max_batch` sequences of up to `max_model_len` tokens, k = the speculative config's drafts (GPU path with
        the MTP head). Returns whether they are on: an MTP layer with BF16 experts (the vendors' checkpoints; its MoE
        syncs with the host) is logged and left eager, a failed capture logs a warning and leaves drafting eager
        (correct, only slower)."""
        from vibeqwen.model.cuda_graphs import default_batch_sizes
        from vibeqwen.model.mtp_graphs import MTPDraftGraphs

        if self.spec.num_speculative_tokens > 1 and not self.model.mtp.layer.mlp.fast:
            log.info("no MTP draft CUDA graphs: the MTP layer's experts are not NVFP4, so its MoE runs the reference "
                     "loop (host syncs); drafting runs eagerly")
            return False
        self.mtp_graphs = self._optional_capture("MTP draft", "drafting runs eagerly", lambda: MTPDraftGraphs(
            self.model, self.cache, self._table_width(max_model_len), default_batch_sizes(max_batch),
            self.spec.num_speculative_tokens, pool=self.graphs.pool if self.graphs is not None else None))
        return self.mtp_graphs is not None

    def allocate_history_buffers(self, max_tokens: int) -> int:
        """Preallocate where verification passes of up to `max_tokens` tokens keep their GDN history (GPU path:
        [max_tokens, Hv, Dk, Dv] in the cache's state dtype + the conv inputs, per GDN layer). Returns the capacity
        in tokens."""
        if self.history_buffers is None or self.history_buffers.capacity < max_tokens:
            if self.verify_graphs:
                # the captured graphs keep writing into the old buffers (alive through their views): both stay
                # allocated, and those graphs' rollbacks take the per-layer path
                log.warning("GDN history buffers grow from %d to %d tokens after verification graphs were "
                            "captured", self.history_buffers.capacity, max_tokens)
            self.history_buffers = GDNHistoryBuffers(self.model.cfg, self.cache.gdn_layers, max_tokens,
                                                     self.model.dtype, self.cache.device,
                                                     state_dtype=self.cache.state_dtype)
        return self.history_buffers.capacity

    def capture_verify_graphs(self, max_batch: int, max_model_len: int, max_tokens: int = 128,
                              query_lens: list[int] | None = None) -> None:
        """Capture CUDA graphs of speculative verification steps, every sequence verifying the same number of
        drafts (query_lens: tokens per sequence, default k + 1), for batches up to `max_batch` sequences with
        at most `max_tokens` tokens in all. The GDN state after every token (2 MiB per token and GDN layer in
        float32, 1 MiB in bfloat16: the cache's state dtype) lands in buffers for `max_tokens` tokens allocated
        once and shared by every graph (and by eager verification passes that fit). The graphs share one memory
        pool of their own. GPU path only; needs query_len <= block size."""
        from vibeqwen.model.cuda_graphs import DecodeGraphs, default_batch_sizes

        cap = self.allocate_history_buffers(max_tokens)
        width = self._table_width(max_model_len)
        pool = next(iter(self.verify_graphs.values())).pool if self.verify_graphs else None
        for q in query_lens or [self.spec.num_speculative_tokens + 1]:
            sizes = [g for g in default_batch_sizes(max_batch) if g * q <= min(max_tokens, cap)]
            if sizes and q not in self.verify_graphs:
                self.verify_graphs[q] = DecodeGraphs(self.model, self.cache, width, sizes, query_len=q,
                                                     keep_states=True, pool=pool,
                                                     history_buffers=self.history_buffers)
                pool = self.verify_graphs[q].pool

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The model's forward pass, replaying a CUDA graph when one fits, or one per piece of a mixed step
        (`MIXED_GRAPH_MAX_CHUNKS`); `last_graphed` says whether every token ran in a graph. Returns hidden [T, H]."""
        self.last_graphed = True
        graph = self._graph_for(batch)
        if graph is not None:
            return graph.run(input_ids, batch)
        pieces = self._graph_pieces(batch)
        if pieces is not None:
            return self._forward_split(input_ids, batch, pieces)
        self.last_graphed = False
        if self.model.fast and any(batch.keep_states) and any(
                q > SPEC_GROUP_MAX_QUERY and not k for q, k in zip(batch.query_lens, batch.keep_states)):
            eager = [(idx, self._sub_batch(batch, idx), None) for idx in self._short_and_chunks(batch) if idx]
            return self._forward_split(input_ids, batch, eager)
        with prompt_pass(self._w8a8(batch.query_lens, batch.keep_states)):
            return self.model.forward(input_ids, batch.device_batch().positions if self.model.fast else
                                      batch.positions(self.device), batch)

    def _graph_for(self, batch: ForwardBatch):
        """The captured graphs that can run `batch` whole (decode, verification of its query length, or a prompt
        chunk's), or None."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs
        vg = self.verify_graphs.get(batch.query_lens[0]) if batch.query_lens else None
        if vg is not None and vg.can_run(batch):
            return vg
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(batch):
            return self.prefill_graphs
        return None

    @staticmethod
    def _short_and_chunks(batch: ForwardBatch) -> tuple[list[int], list[int]]:
        """Sequence indices of the decode / verification rows (a query of at most SPEC_GROUP_MAX_QUERY tokens, or
        drafts to verify) and of the prompt chunks (the rest)."""
        short = [i for i, (q, k) in enumerate(zip(batch.query_lens, batch.keep_states))
                 if k or q <= SPEC_GROUP_MAX_QUERY]
        kept = set(short)
        return short, [i for i in range(len(batch.query_lens)) if i not in kept]

    def _graph_pieces(self, batch: ForwardBatch) -> list[tuple[list[int], ForwardBatch, object]] | None:
        """The pieces a step that no one graph fits runs as, one graph replay each: (sequence indices, their
        sub-batch, the graphs that run it) for its decode / verification rows together, then for each prompt chunk
        alone. None when the step has no prompt chunk, more than MIXED_GRAPH_MAX_CHUNKS of them, is a lone chunk,
        or a piece fits no graph (it runs eagerly then)."""
        if self.prefill_graphs is None or not self.model.fast or not mixed_graphs_enabled():
            return None
        short, chunks = self._short_and_chunks(batch)
        if not chunks or len(chunks) > MIXED_GRAPH_MAX_CHUNKS or (not short and len(chunks) < 2):
            return None
        pieces = []
        for idx in ([short] if short else []) + [[i] for i in chunks]:
            sub = self._sub_batch(batch, idx)
            graph = self._graph_for(sub)
            if graph is None:
                return None
            pieces.append((idx, sub, graph))
        return pieces

    @staticmethod
    def _sub_batch(batch: ForwardBatch, idx: list[int]) -> ForwardBatch:
        """Sequences `idx` of `batch` as a batch of their own (the same cache, history buffers)."""
        sub = ForwardBatch(batch.cache, [batch.query_lens[i] for i in idx], [batch.context_lens[i] for i in idx],
                           [batch.block_tables[i] for i in idx], [batch.gdn_slots[i] for i in idx],
                           [batch.keep_states[i] for i in idx])
        sub.history_buffers = batch.history_buffers
        return sub

    def _w8a8(self, query_lens: list[int], keep_states: list[bool] | None) -> bool:
        """Whether a pass's FP8 projections run W8A8: with fp8_prefill "w8a8", for a pass that carries prompt
        tokens (a sequence with more than one new token and no drafts to verify)."""
        keep = keep_states or [False] * len(query_lens)
        return self.fp8_prefill_w8a8 and any(q > 1 and not k for q, k in zip(query_lens, keep))

    def _forward_split(self, input_ids: torch.Tensor, batch: ForwardBatch,
                       pieces: list[tuple[list[int], ForwardBatch, object]]) -> torch.Tensor:
        """A batch run as several passes, one per piece (sequence indices, their sub-batch, and the graphs that
        replay it or None for an eager pass; sequences are independent, so this is exact).
        Eagerly (GPU path, a batch mixing speculative verification with prompt tokens) the verifying and decoding
        sequences run in one pass, which keeps the GDN state after every token ([tokens, Hv, Dk, Dv] per layer in the
        cache's state dtype), and the prompt chunks in a second, so a 2k-token chunk never has its per-token states
        kept. A verification pass's history stays on its sub-batch (batch.split_passes), which `execute` commits
        through. Returns hidden [T, H] in the batch's row order."""
        hidden = None
        split_history = []
        for idx, sub, graph in pieces:
            rows = [r for i in idx for r in range(batch.starts[i], batch.starts[i] + batch.query_lens[i])]
            # the piece's rows: a slice where they are consecutive (a chunk; the decode rows unless a running
            # request's prompt chunk sits between them), else an index tensor
            if rows == list(range(rows[0], rows[0] + len(rows))):
                sel = slice(rows[0], rows[0] + len(rows))
            else:
                sel = torch.tensor(rows, device=input_ids.device)
            if graph is not None:
                h = graph.run(input_ids[sel], sub)
            else:
                with prompt_pass(self._w8a8(sub.query_lens, sub.keep_states)):
                    h = self.model.forward(input_ids[sel], sub.device_batch().positions, sub)
            if hidden is None:
                hidden = h.new_empty(batch.num_tokens, h.shape[-1])
            hidden[sel] = h  # a graph's output buffer is overwritten by its next replay: copied out now
            for (layer, j), hist in sub.gdn_history.items():
                batch.gdn_history[(layer, idx[j])] = hist
            if sub.gdn_history_batched:
                split_history.append((idx, sub))
        batch.meta = None  # positions etc. come from the full batch's lists from here on
        batch.split_passes = split_history  # commit_gdn_states maps indices through these
        return hidden

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """Run the scheduled tokens and sample. Partial prefill chunks sample nothing; a request with drafts
        gets its drafts verified (`spec.verify`) and its GDN state rolled back to the last accepted token."""
        self.apply_cache_copies()
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
        batch.history_buffers = self.history_buffers
        input_ids = self._to_device(torch.tensor(ids, dtype=torch.long))
        hidden = self.forward(input_ids, batch)
        positions = batch.meta.positions[: len(ids)] if batch.meta is not None else batch.positions(self.device)

        # rows to score: for each sampling request, its last known token and every draft
        rows, owners = [], []
        for j, s in enumerate(output.scheduled):
            if s.samples:
                last = batch.starts[j] + s.num_new_tokens - 1
                rows.extend(range(last - len(s.spec_token_ids), last + 1))
                owners.append(j)
        result = RunnerOutput()
        if rows == list(range(len(rows))):
            logits = self.model.logits(hidden[: len(rows)])
        else:
            logits = self.model.logits(hidden[rows]) if rows else None
        kept = list(query_lens)  # tokens of each sequence whose results stand after verification
        commits: dict[int, int] = {}  # sequences whose GDN state rolls back to kept[j] tokens
        # plain greedy rows (no drafts, constraint, bias or penalties): one argmax and one sync for all
        offsets, off = {}, 0
        for j in owners:
            offsets[j] = off
            off += len(output.scheduled[j].spec_token_ids) + 1
        # and greedy verification (drafts against the argmax of their rows, on host lists): one argmax over
        # every row and one sync for the whole batch, not one per draft
        plain = {j for j in owners if _plain_greedy(output.scheduled[j])}
        argmax = logits.argmax(-1).tolist() if plain else []
        # and plain sampled rows (no constraint, bias or penalties): one batched draw for those without drafts, one
        # batched verification for those with them, one sync each
        sampled = [j for j in owners if _plain_sampled(output.scheduled[j])]
        drawn = [j for j in sampled if not output.scheduled[j].spec_token_ids]
        checked = [j for j in sampled if output.scheduled[j].spec_token_ids]
        draws: dict[int, list[int]] = {}
        if drawn:
            reqs = [output.scheduled[j].request for j in drawn]
            tokens = sample_rows(logits[[offsets[j] for j in drawn]], [r.params for r in reqs],
                                 [r.generator for r in reqs], [_first_position(output.scheduled[j]) for j in drawn]
                                 ).tolist()
            draws.update((j, [t]) for j, t in zip(drawn, tokens))
        if checked:
            scheduled = [output.scheduled[j] for j in checked]
            rows = [offsets[j] + i for j, s in zip(checked, scheduled) for i in range(len(s.spec_token_ids) + 1)]
            draws.update(zip(checked, verify_rows(logits[rows], [s.spec_token_ids for s in scheduled],
                                                  [s.request.params for s in scheduled],
                                                  [s.request.generator for s in scheduled],
                                                  [_first_position(s) for s in scheduled])))
        for j in owners:
            s = output.scheduled[j]
            r, d = s.request, len(s.spec_token_ids)
            off = offsets[j]
            raw = logits[off : off + d + 1]
            if j in plain:
                tokens = greedy_accept(s.spec_token_ids, argmax[off : off + d + 1])
                if d:
                    kept[j] = s.num_new_tokens - d + len(tokens) - 1
                    commits[j] = kept[j]
                result.tokens[r.request_id] = tokens
                if r.params.logprobs is not None:
                    result.logprobs[r.request_id] = [top_logprobs(raw[i], t, r.params.logprobs)
                                                     for i, t in enumerate(tokens)]
                continue
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
                if r.params.logit_bias and self.token_vocab is not None:
                    processed[:, self.token_vocab:] = float("-inf")
                # min_tokens must not mask the only tokens a constraint allows (e.g. EOS at the end of a
                # grammar): where a row has nothing left, keep it as the constraint left it
                dead = torch.isneginf(processed).all(-1)
                block = torch.where(dead[:, None], block, processed)
            if j in draws:
                tokens = draws[j]
            elif d:
                tokens = verify(block, s.spec_token_ids, r.params, r.generator, _first_position(s))
            else:
                tokens = [sample(block[0], r.params, r.generator, _first_position(s))]
            if d:
                kept[j] = s.num_new_tokens - d + len(tokens) - 1
                commits[j] = kept[j]
            result.tokens[r.request_id] = tokens
            if r.params.logprobs is not None:
                result.logprobs[r.request_id] = [top_logprobs(raw[i], t, r.params.logprobs)
                                                 for i, t in enumerate(tokens)]
        if batch.split_passes:  # the verification ran in a sub-batch (see _forward_split): commit through it
            for idx, sub in batch.split_passes:
                sub.commit_gdn_states({idx.index(j): n for j, n in commits.items() if j in idx})
        else:
            batch.commit_gdn_states(commits)
        self._prompt_logprobs(output, batch, hidden, result)
        if self.spec.uses_mtp and self.model.mtp is not None:
            result.mtp_drafts = self._mtp(output, batch, hidden, positions, kept, result.tokens)
        return result

    def launch_decode(self, output: SchedulerOutput, prev: InFlightStep | None = None) -> InFlightStep:
        """Enqueue a decode step and its sampling without reading the tokens back (`InFlightStep.wait`
        does). Every scheduled request must be `inflight.overlappable`.

        prev: the in-flight step this one follows (async scheduling), holding every request here. Its
        sampled tokens are this step's inputs, copied on the device, and it is not committed yet: each
        request's context is num_computed_tokens + 1.
        """
        self.apply_cache_copies()
        reqs = [s.request for s in output.scheduled]
        n = len(reqs)
        context_lens = [r.num_computed_tokens + (prev is not None) for r in reqs]
        if prev is None:
            ids = torch.tensor([r.token_slice(c, c + 1)[0] for r, c in zip(reqs, context_lens)], dtype=torch.long)
            input_ids = self._to_device(ids)
        else:
            rows = prev.rows(reqs)
            input_ids = prev.tokens if rows == list(range(len(prev.sched.scheduled))) else \
                prev.tokens[self._to_device(torch.tensor(rows, dtype=torch.long))]
        batch = ForwardBatch(self.cache, [1] * n, context_lens,
                             [self.cache_manager.block_tables[r.request_id] for r in reqs],
                             [self.cache_manager.slots[r.request_id] for r in reqs], [False] * n)
        hidden = self.forward(input_ids, batch)
        # each row samples the token after its input (sequence index context_len + 1): draws keyed by it
        tokens = sample_rows(self.model.logits(hidden[:n]), [r.params for r in reqs], [r.generator for r in reqs],
                             [c + 1 for c in context_lens])
        if self.device.type != "cuda":
            return InFlightStep(output, tokens, tokens)
        # the staging buffer of the launch before last: its tokens were read before this launch
        turn = self._launches % 2
        self._launches += 1
        buf = self._staging[turn]
        if buf is None or buf.numel() < n:
            buf = self._staging[turn] = torch.empty(max(n, 64), dtype=torch.long, pin_memory=True)
        buf[:n].copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return InFlightStep(output, tokens, buf[:n], event)

    def apply_cache_copies(self) -> None:
        """Enqueue the prefix cache's pending state and block copies (`CacheManager.pending_copies`) on the device,
        ahead of the next forward pass in stream order."""
        if self.cache_manager.pending_copies:
            self.cache.apply_copies(self.cache_manager.take_copies())

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return pinned_to(t, self.device)

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
        tables, slots = [batch.block_tables[j] for j, _ in sampling], [batch.gdn_slots[j] for j, _ in sampling]
        first = [batch.context_lens[j] + qlens[j] for j, _ in sampling]  # each draft pass's first position
        graphs = self.mtp_graphs
        if graphs is not None and graphs.can_run(len(sampling), k, tables):
            ids = graphs.run(h[last], first, tables, slots)
        else:
            steps = [ForwardBatch(self.cache, [1] * len(sampling), [p + s for p in first], tables, slots)
                     for s in range(k - 1)]
            ids = draft_tokens(self.model, h[last], steps)
        # one device-to-host read of the [n, k] drafts (a read per token made every draft pass wait for the GPU,
        # so the host could not queue the next pass's launches ahead of it)
        for (j, s), row in zip(sampling, ids.tolist()):
            drafts[s.request.request_id] = row
        return drafts
