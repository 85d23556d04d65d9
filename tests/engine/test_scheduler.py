"""Scheduler on the CPU at toy sizes, with a fake model: token counting, chunked prefill, preemption."""

from __future__ import annotations

import random

import pytest

from vibeqwen.engine.cache import CacheConfig, CacheManager
from vibeqwen.engine.request import Request, RequestStatus
from vibeqwen.engine.scheduler import Scheduler, SchedulerConfig
from vibeqwen.sampling import SamplingParams

EOS = 99


def _sched(num_blocks=16, block_size=4, num_slots=4, max_num_seqs=4, budget=8, lookahead=0):
    cm = CacheManager(CacheConfig(num_blocks, block_size, num_slots))
    return Scheduler(SchedulerConfig(max_num_seqs, budget, lookahead), cm), cm


def _req(rid, prompt_len, max_tokens=4):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=max_tokens),
                   frozenset({EOS}))


def _step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = {x.request.request_id: [token] for x in out.scheduled if x.samples}
    return out, s.update(out, sampled)


def test_chunked_prefill_then_decode_mixed_in_one_batch():
    s, _ = _sched(budget=8)
    a, b = _req("a", 3), _req("b", 12)
    s.add_request(a)
    s.add_request(b)
    out, res = _step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 3), ("b", 5)]
    assert [r.request_id for r, _ in res] == ["a"]  # b's partial chunk samples nothing
    out, res = _step(s)
    # a decodes one token, b continues its prefill with the rest of the budget
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 7)]
    assert [r.request_id for r, _ in res] == ["a", "b"]
    assert b.num_computed_tokens == 12 and b.output_token_ids == [7]


def test_max_tokens_and_eos_finish_and_free():
    s, cm = _sched()
    a, b = _req("a", 2, max_tokens=1), _req("b", 2, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    _step(s)
    assert a.finished and not b.finished
    _, res = _step(s, token=EOS)
    assert a.finish_reason == "length" and b.finish_reason == "stop" and b.output_token_ids[-1] == EOS
    assert not s.has_unfinished() and cm.num_free_blocks == 16 and cm.num_free_slots == 4


def test_max_num_seqs_caps_running():
    s, _ = _sched(max_num_seqs=2, budget=100)
    for i in range(3):
        s.add_request(_req(f"r{i}", 2))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"] and len(s.waiting) == 1


def test_preemption_recomputes_latest_request_and_everything_finishes():
    # 4 blocks of 4 tokens: two requests of 6 prompt + 4 output tokens cannot both grow to 10 tokens
    s, cm = _sched(num_blocks=5, block_size=4, budget=64)
    a, b = _req("a", 6, max_tokens=8), _req("b", 6, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    preempted = []
    for _ in range(50):
        out, _ = _step(s)
        preempted += [r.request_id for r in out.preempted]
        if not s.has_unfinished():
            break
    assert preempted and set(preempted) == {"b"}, "the latest arrival is the victim"
    assert b.num_preemptions >= 1
    assert a.finish_reason == b.finish_reason == "length"
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8
    assert cm.num_free_blocks == 5 and cm.num_free_slots == 4


def test_preempted_request_recomputes_prompt_and_outputs():
    s, cm = _sched(num_blocks=4, block_size=4, budget=64)
    a, b = _req("a", 7, max_tokens=6), _req("b", 4, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    seen_b = []
    for _ in range(40):
        out, _ = _step(s)
        seen_b += [(x.request.num_computed_tokens, x.num_new_tokens) for x in out.scheduled if x.request is b]
        if not s.has_unfinished():
            break
    # after a preemption b restarts from token 0 and recomputes its prompt plus the outputs it had
    # (update() has already advanced num_computed_tokens, so the chunk started at c - n)
    restarts = [n for c, n in seen_b[1:] if c - n == 0]
    assert restarts and restarts[0] > 4


def test_abort_frees_waiting_and_running():
    s, cm = _sched()
    a, b = _req("a", 5), _req("b", 5)
    s.add_request(a)
    _step(s)
    s.add_request(b)
    assert s.abort_request("a") is a and a.status == RequestStatus.FINISHED and a.finish_reason == "abort"
    assert s.abort_request("b") is b and s.abort_request("zzz") is None
    assert cm.num_free_blocks == 16 and cm.num_free_slots == 4 and not s.has_unfinished()


def test_lookahead_reserves_room_for_speculative_tokens():
    s, cm = _sched(block_size=4, lookahead=3)
    s.add_request(_req("a", 4))
    s.schedule()
    assert len(cm.block_tables["a"]) == 2  # 4 tokens + 3 lookahead


def test_request_larger_than_the_cache_is_refused():
    s, _ = _sched(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="cache holds only 8"):
        s.add_request(_req("a", 6, max_tokens=4))


def test_thousands_of_random_requests_leak_nothing():
    rng = random.Random(0)
    s, cm = _sched(num_blocks=24, block_size=4, num_slots=6, max_num_seqs=6, budget=16)
    added, finished = 0, 0
    for step in range(4000):
        if rng.random() < 0.5:
            r = _req(f"r{added}", rng.randint(1, 30), max_tokens=rng.randint(1, 12))
            s.add_request(r)
            added += 1
        if rng.random() < 0.05 and s.running:
            s.abort_request(rng.choice(s.running).request_id)
            finished += 1
        out, res = _step(s, token=EOS if rng.random() < 0.05 else 7)
        finished += sum(r.finished for r, _ in res)
        assert s.cache.num_free_slots + len(s.cache.slots) == 6
        assert {r.request_id for r in s.running} == set(s.cache.slots)
        if len(s.waiting) > 40:  # keep the queue bounded: drain
            while s.has_unfinished():
                _step(s)
    while s.has_unfinished():
        _step(s)
    assert added > 1500
    assert cm.num_free_blocks == 24 and cm.num_free_slots == 6 and not cm.block_tables
