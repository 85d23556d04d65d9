"""Engine statistics: queue sizes, cache usage, token counters and per-request latencies.

The engine updates an `EngineStats` every step; the metrics endpoint and the periodic log line read it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("vibeqwen.stats")


@dataclass
class FinishedRequestStats:
    """Latencies of one finished request, in seconds (None when undefined, e.g. TPOT of one token)."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    tpot: float | None
    e2e: float


@dataclass
class EngineStats:
    """Counters and gauges of the engine, updated every step (read by /metrics and the log line).

    num_running / num_waiting: requests; kv_usage / gdn_slot_usage: fractions in [0, 1]; *_total: monotonic
    counters; finished: the latest finished requests' latencies (seconds).
    """
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    gdn_slot_usage: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    steps_total: int = 0
    async_steps_total: int = 0  # decode steps launched before the previous step's tokens were read
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache (first admissions)
    prefix_cache_hits_total: int = 0  # of those, tokens a cached prefix served
    finished: deque[FinishedRequestStats] = field(default_factory=lambda: deque(maxlen=10_000))
    # speculative decoding
    spec_steps_total: int = 0
    spec_skipped_steps_total: int = 0  # steps whose drafts the cost-aware policy dropped (SpecConfig.adaptive)
    spec_drafted_total: int = 0
    spec_accepted_total: int = 0
    spec_drafted_per_position: list[int] = field(default_factory=list)
    spec_accepted_per_position: list[int] = field(default_factory=list)

    def reset_counters(self) -> None:
        """Zero every counter and drop the finished-request records (the gauges stay): the server calls it after
        its warm-up generation, so /metrics counts the clients' requests only."""
        for name, value in vars(self).items():
            if name.endswith("_total") and isinstance(value, int):
                setattr(self, name, 0)
        self.finished.clear()
        self.spec_drafted_per_position.clear()
        self.spec_accepted_per_position.clear()

    def record_position(self, pos: int, accepted: bool) -> None:
        """Count one draft at draft position `pos` (0-based) and whether it was accepted."""
        while len(self.spec_drafted_per_position) <= pos:
            self.spec_drafted_per_position.append(0)
            self.spec_accepted_per_position.append(0)
        self.spec_drafted_per_position[pos] += 1
        self.spec_accepted_per_position[pos] += accepted

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verification step: 1 + accepted drafts / steps (None before any speculation)."""
        return None if not self.spec_steps_total else 1 + self.spec_accepted_total / self.spec_steps_total

    def expected_accepted(self, drafts: int) -> float:
        """Expected accepted drafts of a proposal of `drafts` tokens: sum over positions of the observed rate
        at which a draft at that position was accepted (a draft is accepted only with every earlier one),
        smoothed as (accepted + 1) / (drafted + 2), so positions not seen yet count 1/2."""
        a, d = self.spec_accepted_per_position, self.spec_drafted_per_position
        return sum(((a[i] if i < len(a) else 0) + 1) / ((d[i] if i < len(d) else 0) + 2) for i in range(drafts))

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Accepted / drafted at each draft position (0-based)."""
        return [a / d if d else 0.0 for a, d in zip(self.spec_accepted_per_position, self.spec_drafted_per_position)]


class StatsLogger:
    """Logs one line like other engines every `interval` seconds while there is work."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self._last = time.monotonic()
        self._last_prompt = 0
        self._last_gen = 0

    def maybe_log(self, s: EngineStats, force: bool = False) -> None:
        """Log throughput since the last line, queues and cache usage, if `interval` has passed (or `force`)."""
        now = time.monotonic()
        dt = now - self._last
        if not force and dt < self.interval:
            return
        prompt_tps = (s.prompt_tokens_total - self._last_prompt) / max(dt, 1e-9)
        gen_tps = (s.generation_tokens_total - self._last_gen) / max(dt, 1e-9)
        self._last, self._last_prompt, self._last_gen = now, s.prompt_tokens_total, s.generation_tokens_total
        if not force and s.num_running == 0 and s.num_waiting == 0 and prompt_tps == 0 and gen_tps == 0:
            return
        queries = s.prefix_cache_queries_total
        hit_rate = 100 * s.prefix_cache_hits_total / queries if queries else 0.0
        log.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, GDN slot usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
            "Preemptions: %d",
            prompt_tps, gen_tps, s.num_running, s.num_waiting, 100 * s.kv_usage, 100 * s.gdn_slot_usage, hit_rate,
            s.preemptions_total,
        )
