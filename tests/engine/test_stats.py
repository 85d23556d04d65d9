"""EngineStats.reset_counters: every counter and the finished records back to zero, the gauges kept."""

from __future__ import annotations

from vibeqwen.engine.stats import EngineStats, FinishedRequestStats


def test_reset_counters_keeps_the_gauges():
    s = EngineStats(num_running=2, num_waiting=1, kv_usage=0.5, gdn_slot_usage=0.25, prompt_tokens_total=10,
                    generation_tokens_total=3, preemptions_total=1, steps_total=4, async_steps_total=2,
                    prefix_cache_queries_total=7, prefix_cache_hits_total=5, spec_steps_total=2,
                    spec_skipped_steps_total=1, spec_drafted_total=6, spec_accepted_total=3)
    s.record_position(1, True)
    s.finished.append(FinishedRequestStats("warmup-1", "length", 1, 2, 0.5, 0.1, 1.0))
    s.reset_counters()
    totals = {k: v for k, v in vars(s).items() if k.endswith("_total")}
    assert totals and set(totals.values()) == {0}
    assert not s.finished and not s.spec_drafted_per_position and not s.spec_accepted_per_position
    assert (s.num_running, s.num_waiting, s.kv_usage, s.gdn_slot_usage) == (2, 1, 0.5, 0.25)
    assert s.mean_acceptance_length is None
