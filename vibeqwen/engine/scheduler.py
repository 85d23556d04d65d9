"""Continuous-batching scheduler: FCFS, a per-step token budget, chunked prefill, preemption by recompute.

The scheduler never touches torch. Each step it compares every request's `num_computed_tokens` with its
`num_tokens` (prompt + output so far) and schedules the difference, capped by the token budget: a new
prompt becomes one or more prefill chunks, a running request one decode token, and a preempted request
recomputes its prompt and outputs from scratch (its GDN state is rebuilt from its tokens). Running
requests go first, in arrival order; waiting requests fill what is left of the budget.

With prefix caching (`vibeqwen.engine.prefix_cache`) a request admitted without cache first looks up the longest
cached prefix of its tokens and starts after it; its state is snapshotted at the end of its prompt, where it
finishes, and at a branch point its prefill stops at once (see `_look_up`). Requests with the same prompt at once
(an API request's n choices) prefill it once: the others wait until the first has computed all but its last
token, then start there (`_wait_for_twin`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from vibeqwen.engine.cache import CacheManager
from vibeqwen.engine.prefix_cache import chain_hashes
from vibeqwen.engine.request import Request, RequestStatus

#: Finish reasons after which a request's tokens are cached (an aborted request's are not).
SNAPSHOT_FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: running sequences at once. max_num_batched_tokens: tokens per forward pass.
    num_lookahead_tokens: cache room reserved beyond the scheduled tokens (speculative decoding needs k)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_lookahead_tokens: int = 0


@dataclass
class ScheduledRequest:
    """num_new_tokens tokens of `request` run this step; the last len(spec_token_ids) of them are drafts
    to verify (they follow the request's last known token)."""

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    num_real_drafts: int = 0  # spec_token_ids[:num_real_drafts] came from a drafter, the rest is padding
    skipped: bool = False  # set by Scheduler.update when the request had finished: nothing of this row counts

    def accepted_real(self, num_tokens: int) -> int:
        """Of a verification that produced num_tokens tokens (accepted drafts + 1), the accepted drafts that a
        drafter proposed (what acceptance statistics count; accepted padding is output all the same)."""
        return min(num_tokens - 1, self.num_real_drafts)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last known token, so its logits give the next token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == r.num_tokens


@dataclass
class SchedulerOutput:
    """This step's work: requests with their token counts, and the requests preempted to make room."""
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass runs this step."""
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides which requests run each step and how many of their tokens; owns waiting and running queues."""

    def __init__(self, config: SchedulerConfig, cache: CacheManager):
        self.config = config
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # requests with a row in a step launched but not committed (async scheduling): their GDN state is ahead of
        # their computed tokens, so no snapshot is taken of them (set by the engine)
        self.in_flight: frozenset[str] = frozenset()
        # prefix caching: prompt tokens looked up at first admissions, and those a cached prefix served
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add_request(self, request: Request) -> None:
        """Queue a new request (FCFS). Raises ValueError if it could never fit in the whole cache."""
        blocks = -(-(request.max_total_tokens + self.config.num_lookahead_tokens) // self.cache.block_size)
        if blocks > self.cache.config.num_blocks:
            raise ValueError(
                f"request needs {request.max_total_tokens} tokens of KV cache but the cache holds only "
                f"{self.cache.config.num_blocks * self.cache.block_size}"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort_request(self, request_id: str, reason: str = "abort") -> Request | None:
        """Remove a waiting or running request and free its cache, finishing it with `reason`; return it
        (None if unknown)."""
        for queue in (self.running, self.waiting):
            for r in queue:
                if r.request_id == request_id:
                    queue.remove(r)
                    self._finish(r, reason)
                    return r
        return None

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. Preempts the latest-arrived running requests when KV blocks run out."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        lookahead = self.config.num_lookahead_tokens
        self._mark_twins()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, req.num_computed_tokens, budget)
            spec: list[int] = []
            if n == req.num_tokens - req.num_computed_tokens == 1 and req.spec_token_ids:
                spec = req.spec_token_ids[: budget - 1]  # verify the last token plus the drafts
                n += len(spec)
            real = min(req.num_real_drafts, len(spec))
            while not self.cache.allocate(req.request_id, req.num_computed_tokens + n + lookahead):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, spec, real))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: nothing behind it is left
        if not out.preempted:
            ends = {s.request.request_id: s.request.num_computed_tokens + s.num_new_tokens for s in out.scheduled}
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                if self._wait_for_twin(req, ends):
                    break  # FCFS: the queue waits with it, for a step or a few (the twin's prefill)
                hit = self._look_up(req) if req.num_computed_tokens == 0 else None
                start = hit.num_tokens if hit is not None else req.num_computed_tokens
                n = self._chunk(req, start, budget)
                if hit is not None and not self.cache.allocate_prefix(req.request_id, hit, start + n + lookahead):
                    # a hit ending inside a block needs that block kept while it is copied: one block more than a
                    # cold start needs at the cache's very end, so start cold where only that is short
                    hit, start = None, 0
                    n = self._chunk(req, start, budget)
                if hit is not None:
                    req.num_computed_tokens = start
                elif not self.cache.allocate(req.request_id, start + n + lookahead):
                    break
                if req.num_preemptions == 0 and self._looks_up(req):
                    req.num_cached_tokens = start
                    self.prefix_cache_queries += len(req.prompt_token_ids)
                    self.prefix_cache_hits += start
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, n))
                ends[req.request_id] = start + n
                budget -= n
        return out

    def _twin_candidate(self, req: Request) -> bool:
        """A fresh request that looks up, with a prompt of more than one block (see _wait_for_twin)."""
        return (not req.num_computed_tokens and not req.num_preemptions and self._looks_up(req)
                and len(req.prompt_token_ids) - 1 >= self.cache.block_size)

    def _has_waiting_twin(self, req: Request) -> bool:
        """Whether a waiting request other than `req` is a twin candidate with `req`'s prompt (lengths compared
        first: the prompt keys are hashed only for prompts of equal length)."""
        n = len(req.prompt_token_ids)
        return any(w is not req and len(w.prompt_token_ids) == n and self._twin_candidate(w)
                   and w.prompt_key == req.prompt_key and w.prompt_token_ids == req.prompt_token_ids
                   for w in self.waiting)

    def _mark_twins(self) -> None:
        """A running request still prefilling a prompt that a waiting request shares stops one token before the
        prompt's end for a snapshot (`snapshot_at`), which the waiting one will start on (see _wait_for_twin). Scans
        the queue only while some running request is that far from its prompt's end."""
        if self.cache.prefix is None or not self.waiting:
            return
        for r in self.running:
            n = len(r.prompt_token_ids)
            if (r.num_output_tokens == 0 and r.num_computed_tokens < n - 1 and n - 1 >= self.cache.block_size
                    and n - 1 not in r.snapshot_at and self._looks_up(r) and self._has_waiting_twin(r)):
                r.snapshot_at = sorted({*r.snapshot_at, n - 1})

    def _wait_for_twin(self, req: Request, ends: dict[str, int]) -> bool:
        """Whether `req`, at the head of the queue, waits this step (and the queue behind it: FCFS) for a running
        request with the same prompt (the n choices of one API request, or the same prompt sent twice) that is still
        prefilling it and stops for a snapshot one token before the prompt's end (`snapshot_at`, see _mark_twins):
        admitted at the step that computes that last token, `req` starts on the snapshot and computes one token
        instead of the whole prompt again. Only with the prefix cache, for a fresh request that looks up, a prompt
        of more than one block, and while the twin's prefill has not passed that point by the end of this step
        (`ends`: each scheduled request's computed tokens after it). A twin that leaves (aborted, preempted) or
        whose snapshot is refused holds nothing: `req` then starts on what the cache has."""
        if not self._twin_candidate(req):
            return False
        n = len(req.prompt_token_ids)
        for twin in self.running:
            if (twin.num_output_tokens == 0 and len(twin.prompt_token_ids) == n and n - 1 in twin.snapshot_at
                    and ends.get(twin.request_id, twin.num_computed_tokens) <= n - 1
                    and twin.prompt_key == req.prompt_key and twin.prompt_token_ids == req.prompt_token_ids):
                return True  # (past the point, req starts on the snapshot the twin took there)
        return False

    def _chunk(self, req: Request, start: int, budget: int) -> int:
        """Tokens of `req` to run from position `start` within `budget`: all it has, ending at its snapshot point
        when that comes first."""
        n = min(req.num_tokens - start, budget)
        for point in req.snapshot_at:
            if start < point < start + n:
                return point - start
        return n

    def _look_up(self, req: Request):
        """The longest cached prefix to start `req` on (a `PrefixEntry`, None for none), and where its prefill
        stops for snapshots (`req.snapshot_at`): the deepest block boundary its tokens share with any entry (a
        branch point, say the end of a shared system prompt), or one token before its end when exactly its tokens
        are cached already (an entry at the very end cannot serve it: one token must run); and the request's
        `prefix_cache_point` (where a chat's generation prompt starts), unless that prefix is cached. Requests that
        asked for prompt logprobs compute every prompt token (no lookup)."""
        req.snapshot_at = []
        if not self._looks_up(req):
            return None
        b = self.cache.block_size
        tokens = req.prompt_token_ids if not req.output_token_ids else req.all_token_ids
        hashes = chain_hashes(tokens, b, req.block_hashes)
        limit = len(tokens) - 1
        hit = self.cache.match(tokens, hashes, limit)
        start = hit.num_tokens if hit is not None else 0
        stop = self.cache.prefix.shared_blocks(hashes, limit // b) * b
        if limit >= b and self.cache.prefix.get(tuple(tokens)) is not None:
            stop = limit
        points = {stop}
        if limit >= b and not req.output_token_ids and self._has_waiting_twin(req):
            points.add(limit)  # twins wait behind it (_wait_for_twin): they start one token before the end
        hint = req.params.prefix_cache_point
        if hint is not None and hint <= limit and self.cache.prefix.get(tuple(tokens[:hint])) is None:
            points.add(hint)
        req.snapshot_at = sorted(p for p in points if p > start and p >= b)
        return hit

    def _prompt_end_covered(self, req: Request) -> bool:
        """Whether a snapshot inside the prompt serves what one at its end would: the prompt less its last token
        (a resent prompt's: it also serves the prompt itself, at the cost of one token), or the prompt up to its
        `prefix_cache_point` (a chat's: the next turn renders this reply differently from the generation prompt)."""
        cut = [len(req.prompt_token_ids) - 1]
        if req.params.prefix_cache_point is not None:
            cut.append(req.params.prefix_cache_point)
        return any(self.cache.prefix.get(tuple(req.prompt_token_ids[:n])) is not None for n in cut)

    def _looks_up(self, req: Request) -> bool:
        """Whether `req` starts on the prefix cache: caching is on and it did not ask for prompt logprobs (those
        need every prompt position computed)."""
        return self.cache.prefix is not None and req.params.prompt_logprobs is None

    def _snapshot(self, req: Request, next_token: int | None = None) -> None:
        """Cache `req`'s computed tokens (`CacheManager.snapshot`), unless a launched step is ahead of them.
        next_token: its token after them (default: the one it knows; the first sampled token at a prompt's end)."""
        if self.cache.prefix is None or req.request_id in self.in_flight:
            return
        p = req.num_computed_tokens
        if p < self.cache.block_size:
            return
        tokens = req.token_slice(0, p)
        if next_token is None and p < req.num_tokens:
            next_token = req.token_slice(p, p + 1)[0]
        self.cache.snapshot(req.request_id, tokens, chain_hashes(tokens, self.cache.block_size, req.block_hashes),
                            next_token)

    def schedule_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling: the decode step after `prev`, a decode step (one token per request) whose
        sampled tokens are not known yet, so each request's num_computed_tokens lags by one.

        Every running request gets one token, except those prev's token takes to max_tokens: the batch
        `schedule()` would pick once prev is committed, unless a request stops at prev in another way (its
        row then runs and is dropped, and a request waiting for its sequence slot starts a step later).
        Returns None, allocating nothing, where that batch could differ from what `schedule()` would do:
        requests are waiting (or preempted) while a sequence slot is free, a running request was not in
        prev, the token budget is short, or the KV blocks would need a preemption.
        """
        in_prev = {s.request.request_id for s in prev.scheduled}
        # waiting requests: schedule() would admit one now only if there is a free sequence slot; with every
        # slot taken they wait either way (one that frees at prev is taken a step later than schedule()
        # would: its output is the same, only its start moves)
        full = len(self.running) >= self.config.max_num_seqs
        if (self.waiting and not full) or any(r.request_id not in in_prev for r in self.running):
            return None
        reqs = [r for r in self.running if r.num_output_tokens + 1 < r.params.max_tokens]
        if not reqs or len(reqs) > self.config.max_num_batched_tokens:
            return None
        # room for prev's token and this step's (+ the lookahead), all of it or nothing
        total = [r.num_computed_tokens + 2 + self.config.num_lookahead_tokens for r in reqs]
        if sum(self.cache.blocks_needed(r.request_id, n) for r, n in zip(reqs, total)) > self.cache.num_free_blocks:
            return None
        for r, n in zip(reqs, total):
            self.cache.allocate(r.request_id, n)
        return SchedulerOutput([ScheduledRequest(r, 1) for r in reqs])

    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[tuple[Request, list[int]]]:
        """Advance computed-token counts, append sampled tokens, finish requests that stop.

        sampled: request id -> new tokens (accepted drafts then one sampled token), for every scheduled
        request whose `samples` was true. Tokens after a stop condition are dropped. Returns
        (request, new token ids) per scheduled request that produced tokens.
        """
        results = []
        for s in output.scheduled:
            req = s.request
            if req.finished:  # aborted between schedule() and update(), or stopped at the step before (async)
                s.skipped = True
                continue
            samples = s.samples
            req.spec_token_ids, req.num_real_drafts = [], 0
            if not samples:
                req.num_computed_tokens += s.num_new_tokens
                if req.num_computed_tokens in req.snapshot_at:
                    req.snapshot_at.remove(req.num_computed_tokens)
                    self._snapshot(req)
                continue
            tokens = sampled[req.request_id]
            # the verified prefix: the known tokens run this step plus the accepted drafts
            req.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids) + len(tokens) - 1
            # the prompt is computed: cache it, unless a snapshot inside it serves what this one would
            if req.num_output_tokens == 0 and self.cache.prefix is not None and not self._prompt_end_covered(req):
                self._snapshot(req, next_token=tokens[0])
            if s.num_real_drafts:
                req.num_spec_steps += 1
                req.num_drafted_tokens += s.num_real_drafts
                req.num_accepted_tokens += s.accepted_real(len(tokens))
            kept = []
            for token in tokens:
                kept.append(token)
                reason = req.append_token(token)
                if reason is not None:
                    self.running.remove(req)
                    self._finish(req, reason)
                    break
            else:
                # release blocks reserved for rejected drafts beyond what the next step needs
                self.cache.trim(req.request_id, req.num_tokens + self.config.num_lookahead_tokens)
            results.append((req, kept))
        return results

    def _preempt(self, req: Request) -> None:
        self.cache.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _finish(self, req: Request, reason: str) -> None:
        # a stop (or max_tokens) among accepted drafts drops the drafts after it, which the GDN state has taken in
        # (num_computed_tokens >= num_tokens): only a state short of the last token is the tokens' own
        if reason in SNAPSHOT_FINISH_REASONS and req.num_computed_tokens < req.num_tokens:
            self._snapshot(req)
        self.cache.free(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
