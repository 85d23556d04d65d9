"""Prometheus metrics at `GET /metrics`, read from the engine's `EngineStats` at scrape time.

Gauges and counters mirror the engine's own fields (the engine thread updates them every step), so no
hook sits in the step loop. The latency histograms (time to first token, time per output token,
end-to-end) and the finished-request counter are fed from `EngineStats.finished`: each scrape folds in
the requests that finished since the previous one. Names follow vLLM's (`vibeqwen:` prefix).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0)


class _Histogram:
    """Cumulative bucket counts built by hand (the observations come from the engine's records)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def family(self, name: str, doc: str, labels: dict[str, str]) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=list(labels))
        cumulative, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += count
            cumulative.append((bound, running))
        fam.add_metric(list(labels.values()), cumulative, self.sum)
        return fam


class EngineCollector(Collector):
    """Reads `stats` (an `EngineStats`) at every scrape. Requests whose id starts with `ignore_prefix`
    (the start-up warm-up) stay out of the histograms."""

    def __init__(self, stats: Any, model_name: str, ignore_prefix: str = "warmup-") -> None:
        self.stats = stats
        self.labels = {"model_name": model_name}
        self.ignore_prefix = ignore_prefix
        self._last_seen: Any = None
        self._ttft = _Histogram(TTFT_BUCKETS)
        self._tpot = _Histogram(TPOT_BUCKETS)
        self._e2e = _Histogram(E2E_BUCKETS)
        self._finished: dict[str, int] = {}
        self._prompt_tokens = _Histogram((16, 64, 256, 1024, 4096, 16384, 65536, 262144))
        self._generation_tokens = _Histogram((1, 16, 64, 256, 1024, 4096, 16384, 65536))

    def _fold_finished(self) -> None:
        # The engine thread appends; list() of a deque runs under the GIL, so the copy is consistent.
        records = list(self.stats.finished)
        new = records
        if self._last_seen is not None:
            for i in range(len(records) - 1, -1, -1):
                if records[i] is self._last_seen:
                    new = records[i + 1 :]
                    break
        if records:
            self._last_seen = records[-1]
        for r in new:
            if r.request_id.startswith(self.ignore_prefix):
                continue
            self._finished[r.finish_reason] = self._finished.get(r.finish_reason, 0) + 1
            self._prompt_tokens.observe(r.prompt_tokens)
            self._generation_tokens.observe(r.output_tokens)
            if r.ttft is not None:
                self._ttft.observe(r.ttft)
            if r.tpot is not None:
                self._tpot.observe(r.tpot)
            self._e2e.observe(r.e2e)

    def collect(self) -> Iterator[Any]:
        s, labels = self.stats, self.labels
        names, values = list(labels), list(labels.values())
        self._fold_finished()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vibeqwen:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vibeqwen:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("vibeqwen:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", s.kv_usage)
        yield gauge("vibeqwen:gdn_slot_usage_perc", "Fraction of GDN state slots in use (0-1).", s.gdn_slot_usage)
        yield counter("vibeqwen:prompt_tokens", "Prompt tokens prefilled.", s.prompt_tokens_total)
        yield counter("vibeqwen:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield counter("vibeqwen:num_preemptions", "Requests preempted.", s.preemptions_total)
        yield counter("vibeqwen:engine_steps", "Engine steps run.", s.steps_total)
        yield counter("vibeqwen:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries_total)
        yield counter("vibeqwen:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      s.prefix_cache_hits_total)
        yield counter("vibeqwen:async_scheduled_steps", "Decode steps launched before the previous step's tokens "
                      "were read (async scheduling).", s.async_steps_total)
        finished = CounterMetricFamily("vibeqwen:request_success", "Finished requests by finish reason.",
                                       labels=[*names, "finished_reason"])
        for reason, count in sorted(self._finished.items()):
            finished.add_metric([*values, reason], count)
        yield finished
        yield self._ttft.family("vibeqwen:time_to_first_token_seconds", "Time to first token.", labels)
        yield self._tpot.family("vibeqwen:time_per_output_token_seconds", "Time per output token after the "
                                "first.", labels)
        yield self._e2e.family("vibeqwen:e2e_request_latency_seconds", "End-to-end request latency.", labels)
        yield self._prompt_tokens.family("vibeqwen:request_prompt_tokens", "Prompt tokens per request.", labels)
        yield self._generation_tokens.family("vibeqwen:request_generation_tokens", "Generated tokens per "
                                             "request.", labels)
        # speculative decoding
        yield counter("vibeqwen:spec_decode_num_drafts", "Speculative verification steps.", s.spec_steps_total)
        yield counter("vibeqwen:spec_decode_num_skipped_steps", "Steps whose drafts the cost-aware policy "
                      "dropped (verifying them would have cost more than they were expected to add).",
                      s.spec_skipped_steps_total)
        yield counter("vibeqwen:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_drafted_total)
        yield counter("vibeqwen:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_total)
        mean = s.mean_acceptance_length
        yield gauge("vibeqwen:spec_decode_mean_acceptance_length", "Tokens per verification step (1 + accepted "
                    "drafts per step; NaN before any speculation).", math.nan if mean is None else mean)
        per_pos = GaugeMetricFamily("vibeqwen:spec_decode_acceptance_rate_per_position",
                                    "Acceptance rate of drafts at each position.", labels=[*names, "position"])
        for pos, rate in enumerate(s.acceptance_rate_per_position):
            per_pos.add_metric([*values, str(pos)], rate)
        yield per_pos


def make_registry(stats: Any, model_name: str) -> CollectorRegistry:
    """A registry of its own (not the process-global one), so several apps can live in one process."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
