"""Async scheduling: decode step N+1 is launched before step N's sampled tokens are read on the host.

A decode step's host work (scheduling, building its device metadata, reading the sampled tokens back,
appending them, stop checks, stats) leaves the GPU idle unless it overlaps the GPU work of a neighbouring
step. With async scheduling (`EngineConfig.async_scheduling`, as vLLM's async scheduling and SGLang's
overlap scheduler do) `LLMEngine.step()` runs

    launch N+1 (its input tokens: N's sampled tokens, read on the device) -> wait for N's tokens -> commit N

so N+1's metadata is built while N runs, and N is committed while N+1 runs. Every decoding sequence
advances by exactly one token, so N+1's positions, slot mapping and block tables are known on the host
without N's token values.

Invariants:
- Between two `step()` calls at most one step is in flight (`LLMEngine._inflight`). It is a pure decode
  step (every request `overlappable`) of exactly the scheduler's running requests, minus any aborted since,
  and none of its results is applied to the requests yet: each one's `num_computed_tokens` lags by one.
- `step()` returns the outputs of the step it commits: the one that was in flight when it was called, or,
  when none was, the step it schedules itself. Each call commits exactly one step.
- A request that stops at step N (EOS, a stop id, max_tokens, abort) may still have a row in N+1; that
  row's token is never read (`Scheduler.update` skips finished requests). Its blocks and GDN slot return
  to the free lists at once: whatever reuses them is enqueued after N+1 on the same stream. Requests that
  N's token takes to max_tokens are left out of N+1 to begin with (`Scheduler.schedule_ahead`).
- The tokens' pinned host staging buffers are double-buffered (`ModelRunner.launch_decode`): a step's
  buffer is reused two launches later, after its tokens were read.

Anything else runs the synchronous step, after the in-flight step is committed (see `overlappable` and
`Scheduler.schedule_ahead` for exactly what goes ahead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vibeqwen.engine.scheduler import ScheduledRequest, SchedulerOutput


def overlappable(s: ScheduledRequest) -> bool:
    """A scheduled request the overlapped path runs exactly: one new token that samples (a decode step, or
    a one-token prompt), no drafts, and sampling that reads neither the tokens so far nor anything on the
    host: no constraint, logit_bias, penalties or min_tokens, logprobs or prompt logprobs."""
    p = s.request.params
    return (s.num_new_tokens == 1 and not s.spec_token_ids and s.samples and p.constraint is None
            and not p.logit_bias and not p.needs_history and p.logprobs is None and p.prompt_logprobs is None)


@dataclass
class InFlightStep:
    """A decode step enqueued on the device whose sampled tokens the host has not read yet.

    sched: what ran, one token per request. tokens: int64 [n] on the device, row i sampled for
    sched.scheduled[i] (the next step's input tokens). host: where they land on the host (a pinned staging
    buffer on a GPU, `tokens` itself on the CPU). event: recorded after the copy to `host` (None on the CPU).
    """

    sched: SchedulerOutput
    tokens: torch.Tensor
    host: torch.Tensor
    event: torch.cuda.Event | None = None

    def rows(self, requests) -> list[int]:
        """The rows of `requests` (each must be in this step)."""
        index = {s.request.request_id: i for i, s in enumerate(self.sched.scheduled)}
        return [index[r.request_id] for r in requests]

    def wait(self) -> dict[str, list[int]]:
        """Wait for this step's tokens (its event, not a device sync); request id -> [token]."""
        if self.event is not None:
            self.event.synchronize()
        ids = self.host.tolist()
        return {s.request.request_id: [t] for s, t in zip(self.sched.scheduled, ids)}
