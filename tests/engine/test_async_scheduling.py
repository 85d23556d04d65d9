"""Async scheduling (decode step N+1 launched before step N's tokens are read) on the CPU reference path:
forced on, it runs the same code as on the GPU, and every output must equal the synchronous engine's.

Each test also checks that steps really went ahead (`stats.async_steps_total`), or, where the overlapped
path must not apply, that none did.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from oracle_drafts import oracle_drafter

import vibeqwen.engine.llm_engine as llm_engine_mod
from vibeqwen.engine.cache import CacheConfig, CacheManager
from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.engine.request import Request
from vibeqwen.engine.scheduler import Scheduler, SchedulerConfig
from vibeqwen.engine.spec import SpecConfig
from vibeqwen.model.cache import gdn_bytes_per_slot, kv_bytes_per_block
from vibeqwen.sampling import SamplingParams

_ids = itertools.count()


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    """(synchronous, async-scheduling) engines of the tiny model."""
    sync = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=16, async_scheduling=False))
    over = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=16, async_scheduling=True))
    assert not sync.async_scheduling and over.async_scheduling
    return sync, over


def _prompts(n, seed=0, longest=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 248044, (int(torch.randint(1, longest, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _mixed_params(n, max_tokens=lambda i: 4 + i % 9):
    """Greedy, seeded (top-k / top-p) and plain-temperature seeded requests of varied lengths."""
    kinds = [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "top_k": 50}, {"temperature": 1.0}]
    return [SamplingParams(max_tokens=max_tokens(i), seed=1000 + i, **kinds[i % 3]) for i in range(n)]


def drive(engine, jobs, abort_after=None, eos=None):
    """Run jobs = [(call index at which it arrives, prompt, params)] to completion, stepping the engine.

    abort_after: job index -> abort it once its caller has seen this many tokens. eos: EOS ids to use.
    Returns ({job index: (tokens, finish reason, logprobs)}, step() calls made). Leaves the cache empty."""
    abort_after = abort_after or {}
    old_eos = engine.eos_token_ids
    if eos is not None:
        engine.eos_token_ids = frozenset(eos)
    rid = {f"a{next(_ids)}": j for j in range(len(jobs))}
    by_job = {j: r for r, j in rid.items()}
    seen = {j: ([], None, []) for j in range(len(jobs))}
    pending = sorted(range(len(jobs)), key=lambda j: jobs[j][0])
    calls = 0
    try:
        while pending or engine.has_unfinished_requests():
            while pending and jobs[pending[0]][0] <= calls:
                j = pending.pop(0)
                engine.add_request(by_job[j], jobs[j][1], jobs[j][2])
            outs = engine.step()
            calls += 1
            for o in outs:
                toks, _, lps = seen[rid[o.request_id]]
                toks.extend(o.new_token_ids)
                lps.extend(o.logprobs or [])
                seen[rid[o.request_id]] = (toks, o.finish_reason, lps)
            for j, m in abort_after.items():
                toks, reason, lps = seen[j]
                if reason is None and len(toks) >= m:
                    engine.abort_request(by_job[j])
                    seen[j] = (toks, "abort", lps)
    finally:
        engine.eos_token_ids = old_eos
    cm = engine.cache_manager
    assert not cm.block_tables and cm.num_free_slots == cm.config.num_slots
    assert cm.num_free_blocks == cm.config.num_blocks
    return seen, calls


def _both(engines, jobs, **kw):
    """Drive both engines; assert equal outputs and the same number of step() calls; return the outputs and
    how many steps went ahead."""
    sync, over = engines
    before = over.stats.async_steps_total
    expected, calls = drive(sync, jobs, **kw)
    got, over_calls = drive(over, jobs, **kw)
    assert got == expected
    assert over_calls == calls  # every step() call commits one step, as the synchronous engine's does
    return expected, over.stats.async_steps_total - before


@pytest.mark.parametrize("n", [1, 3, 16])
def test_greedy_and_seeded_equal_sync(engines, n):
    jobs = [(0, p, sp) for p, sp in zip(_prompts(n, seed=n), _mixed_params(n))]
    out, ahead = _both(engines, jobs)
    assert ahead > 0
    assert all(reason == "length" and len(t) == jobs[j][2].max_tokens for j, (t, reason, _) in out.items())


def test_max_tokens_one_and_one_token_prompts(engines):
    # max_tokens=1 ends at the prefill; one-token prompts sample from their first step
    prompts = _prompts(6, seed=7, longest=3)
    jobs = [(0, p, SamplingParams(temperature=0, max_tokens=1 + 3 * (i % 2))) for i, p in enumerate(prompts)]
    out, ahead = _both(engines, jobs)
    assert ahead > 0 and [len(t) for t, _, _ in out.values()] == [1, 4] * 3


def _stopping_token(engine, prompt, params, at):
    """The token `params` samples at output position `at` for `prompt` (from the synchronous engine)."""
    return drive(engine, [(0, prompt, params)])[0][0][0][at]


@pytest.mark.parametrize("how", ["stop_token_ids", "eos"])
def test_stops_mid_batch_drop_the_token_in_flight(engines, how):
    sync, _ = engines
    prompts = _prompts(8, seed=11)
    params = _mixed_params(8, max_tokens=lambda i: 12)
    # requests 0, 3 and 5 stop early, at different steps, while the others keep decoding
    stop_at = {0: 2, 3: 4, 5: 6}
    stops = {j: _stopping_token(sync, prompts[j], params[j], at) for j, at in stop_at.items()}
    eos = None
    if how == "stop_token_ids":
        for j, tok in stops.items():
            params[j].stop_token_ids = [tok]
    else:
        eos = set(stops.values())
    out, ahead = _both(engines, [(0, p, sp) for p, sp in zip(prompts, params)], eos=eos)
    assert ahead > 0
    for j, at in stop_at.items():
        toks, reason, _ = out[j]
        assert reason == "stop" and len(toks) <= at + 1 and toks[-1] in stops.values()


def test_a_stop_with_a_step_in_flight_leaves_the_engine_idle(engines):
    sync, over = engines
    prompt, params = _prompts(1, seed=18)[0], SamplingParams(temperature=0, max_tokens=12)
    params.stop_token_ids = [_stopping_token(sync, prompt, params, 4)]
    before = over.stats.steps_total
    (toks, reason, _), = drive(over, [(0, prompt, params)])[0].values()
    assert reason == "stop" and len(toks) == 5
    # the step launched ahead of the stop ran for nothing; the engine forgot it
    assert over._inflight is None and over.stats.steps_total - before == 5


def test_abort_in_flight(engines):
    prompts = _prompts(5, seed=12)
    jobs = [(0, p, sp) for p, sp in zip(prompts, _mixed_params(5, max_tokens=lambda i: 10))]
    out, ahead = _both(engines, jobs, abort_after={1: 1, 2: 4, 4: 7})
    assert ahead > 0
    assert [(len(out[j][0]), out[j][1]) for j in (1, 2, 4)] == [(1, "abort"), (4, "abort"), (7, "abort")]


def test_aborting_everything_drops_the_step_in_flight(engines):
    _, over = engines
    req = over.add_request("gone", _prompts(1, seed=13)[0], SamplingParams(temperature=0, max_tokens=20))
    while len(req.output_token_ids) < 3:
        over.step()
    assert over._inflight is not None
    over.abort_request("gone")
    assert over._inflight is None and not over.has_unfinished_requests()
    # the next request runs from a clean state
    assert drive(over, [(0, [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))])[0][0][1] == "length"


def test_requests_arriving_mid_run(engines):
    prompts = _prompts(9, seed=14)
    params = _mixed_params(9, max_tokens=lambda i: 3 + (5 * i) % 11)
    jobs = [(arrival, p, sp) for arrival, p, sp in zip([0, 0, 2, 3, 3, 7, 8, 12, 20], prompts, params)]
    _, ahead = _both(engines, jobs)
    assert ahead > 0


def test_preemption_under_a_small_cache(tiny_checkpoint, tiny_config):
    block, slot = kv_bytes_per_block(tiny_config, 4, torch.float32), gdn_bytes_per_slot(tiny_config, torch.float32)
    # 4 slots and 20 blocks of 4 tokens = 80 tokens for 4 requests that grow to 36-55 tokens each
    engines = [LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=4, block_size=4, cache_memory_bytes=6 * slot + 20 * block, prefix_cache_slots=2,
        async_scheduling=overlap))
        for overlap in (False, True)]
    prompts = [p + [11] * 15 for p in _prompts(4, seed=3)]
    jobs = [(0, p, sp) for p, sp in zip(prompts, _mixed_params(4, max_tokens=lambda i: 20))]
    _, ahead = _both(engines, jobs)
    assert ahead > 0 and engines[1].stats.preemptions_total > 0
    assert engines[1].stats.preemptions_total == engines[0].stats.preemptions_total


def test_requests_that_need_the_host_run_synchronously(engines):
    prompts = _prompts(4, seed=15)
    special = [SamplingParams(temperature=0, max_tokens=6, logprobs=2),
               SamplingParams(temperature=0, max_tokens=6, logit_bias={5: 50.0}),
               SamplingParams(temperature=0.8, max_tokens=6, seed=3, repetition_penalty=1.3),
               SamplingParams(temperature=0, max_tokens=6, min_tokens=2)]
    for sp in special:  # alone: never ahead
        _, ahead = _both(engines, [(0, prompts[0], sp)])
        assert ahead == 0
    # mixed with plain requests: no step of that batch goes ahead, equal outputs (logprobs included)
    jobs = [(0, p, sp) for p, sp in zip(prompts, [special[0]] + _mixed_params(3, max_tokens=lambda i: 9))]
    out, ahead = _both(engines, jobs)
    assert out[0][2] and len(out[0][2]) == 6
    # once the logprobs request is done (6 tokens), the rest goes ahead
    assert ahead > 0


def test_ngram_speculation_goes_ahead_between_hits_and_is_equal(tiny_checkpoint, engines, monkeypatch):
    """n-gram speculation with async scheduling: steps go ahead while no request has drafts; a lookup hit
    stops that, and the drafts looked up after the in-flight step verify synchronously. Whatever the
    drafter does, the outputs equal the synchronous engine's without speculation."""
    sync, _ = engines
    prompts = _prompts(4, seed=16)
    jobs = [(0, p, SamplingParams(temperature=0, max_tokens=16)) for p in prompts]
    expected = drive(sync, jobs)[0]
    oracle = oracle_drafter(prompts, [expected[j][0] for j in range(4)])
    lookups = itertools.count()

    def sometimes(tokens, k, lo, hi):  # a hit on every fifth lookup: drafts right for 0..k tokens
        return oracle(tokens, k, lo, hi) if next(lookups) % 5 == 0 else []

    for drafter, ahead_expected in ((oracle, False), (sometimes, True)):
        monkeypatch.setattr(llm_engine_mod, "ngram_propose", drafter)
        spec = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
            max_num_seqs=8, spec=SpecConfig("ngram", 3), async_scheduling=True))
        assert spec.async_scheduling_active
        assert drive(spec, jobs)[0] == expected
        assert spec.stats.spec_steps_total > 0
        assert (spec.stats.async_steps_total > 0) == ahead_expected  # the oracle drafts at every step
        assert spec.cache_manager.num_free_blocks == spec.cache_manager.config.num_blocks


def test_mtp_speculation_does_not_go_ahead(tiny_checkpoint, engines):
    """MTP drafts come out of every forward pass (and keep the MTP head's KV cache whole): no async steps,
    and the outputs still equal the synchronous engine's."""
    sync, _ = engines
    prompts = _prompts(3, seed=17)
    jobs = [(0, p, SamplingParams(temperature=0, max_tokens=8)) for p in prompts]
    expected = drive(sync, jobs)[0]
    spec = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=8, spec=SpecConfig("mtp", 2), async_scheduling=True))
    assert spec.async_scheduling and not spec.async_scheduling_active
    assert drive(spec, jobs)[0] == expected
    assert spec.stats.async_steps_total == 0 and spec.stats.spec_steps_total > 0


def test_async_plain_step_cost_is_the_launch_interval(tiny_checkpoint, monkeypatch):
    """Cost-aware speculation weighs drafts against the decode step that would otherwise go ahead: with async
    scheduling its cost is the interval between launches in a row, recorded under the decode key."""
    monkeypatch.setattr(llm_engine_mod, "ngram_propose", lambda tokens, k, lo, hi: [])
    eng = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=8, spec=SpecConfig("ngram", 3, adaptive=True), async_scheduling=True))
    monkeypatch.setattr(eng, "_record_step_cost", lambda sched, ms: None)  # only the async intervals
    drive(eng, [(0, p, SamplingParams(temperature=0, max_tokens=12)) for p in _prompts(2, seed=18)])
    assert eng.stats.async_steps_total > 2
    assert set(eng.step_costs) == {(2, 1, False)} and eng.step_costs[(2, 1, False)] > 0


def test_schedule_ahead_matches_schedule_or_declines():
    cache = CacheManager(CacheConfig(num_blocks=6, block_size=4, num_slots=3))
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64), cache)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    b = Request("b", [1], SamplingParams(max_tokens=2))  # its next token is its last: not ahead
    for r in (a, b):
        sched.add_request(r)
    first = sched.schedule()
    sched.update(first, {"a": [7], "b": [8]})
    prev = sched.schedule()  # a: position 3, b: position 1 (b finishes with this step's token)
    ahead = sched.schedule_ahead(prev)
    assert [(s.request.request_id, s.num_new_tokens) for s in ahead.scheduled] == [("a", 1)]
    assert len(cache.block_tables["a"]) == 2  # room for 5 tokens: 3 prompt + prev's + this step's
    sched.update(prev, {"a": [9], "b": [10]})
    assert b.finished and not ahead.scheduled[0].request.finished and ahead.scheduled[0].samples
    # a waiting request: the next batch would admit it, so nothing goes ahead and nothing is allocated
    sched.add_request(Request("c", [4, 5], SamplingParams(max_tokens=2)))
    free = cache.num_free_blocks
    assert sched.schedule_ahead(ahead) is None and cache.num_free_blocks == free


def test_server_path_with_stop_strings(engines):
    from vibeqwen.server.async_engine import AsyncEngine

    sync, _ = engines
    prompts = _prompts(3, seed=17)
    params = _mixed_params(3, max_tokens=lambda i: 12)
    text = [sync.tokenizer.decode(drive(sync, [(0, p, sp)])[0][0][0]) for p, sp in zip(prompts, params)]
    for sp, t in zip(params, text):
        if len(t) > 8:
            sp.stop = [t[len(t) // 2 : len(t) // 2 + 3]]

    async def serve(engine):
        ae = AsyncEngine(engine)
        try:
            async def one(i):
                outs = [o async for o in ae.generate(f"s{next(_ids)}", prompts[i], params[i])]
                return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs), outs[-1].finish_reason

            return await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            ae.shutdown()

    before = engines[1].stats.async_steps_total
    assert asyncio.run(serve(engines[1])) == asyncio.run(serve(sync))
    assert engines[1].stats.async_steps_total > before


def _engine(ckpt, **kw):
    kw.setdefault("max_num_seqs", 16)
    return LLMEngine.from_checkpoint(ckpt, config=EngineConfig(**kw))


def _run_alone_or_with(engine, req_params, others=()):
    """Run one request (prompt, params) with `others` (prompt, params) added at once; its output tokens."""
    r = engine.add_request(f"x{next(_ids)}", *req_params)
    for p, sp in others:
        engine.add_request(f"o{next(_ids)}", p, sp)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cache_manager.num_free_blocks == engine.cache_manager.config.num_blocks
    return r.output_token_ids


@pytest.mark.slow
def test_seeded_sampling_with_ngram_is_the_same_ahead_or_padded(tiny_checkpoint, monkeypatch):
    """A seeded sampling request's draws are keyed by sequence position: with speculation on, its steps may go
    ahead (which steps verify drafts then depends on timing) and be padded with other requests' filler drafts,
    and its tokens are the synchronous engine's, alone or next to other requests."""
    monkeypatch.setattr(llm_engine_mod, "ngram_propose",
                        lambda tokens, k, lo, hi: [tokens[-1]] * k if len(tokens) % 4 == 0 else [])
    seeded = ([101, 202, 303, 404, 505] * 3, SamplingParams(temperature=0.8, max_tokens=24, seed=7))
    other = [([1, 2, 3], SamplingParams(temperature=0, max_tokens=24))]
    outs = []
    for overlap, pad in ((False, None), (True, None), (False, True)):
        for extra in ((), other):
            eng = _engine(tiny_checkpoint, spec=SpecConfig("ngram", 3, pad_drafts=pad), async_scheduling=overlap)
            outs.append(_run_alone_or_with(eng, seeded, extra))
            if overlap:
                assert eng.stats.async_steps_total > 0 and eng.stats.spec_steps_total > 0
    assert all(o == outs[0] for o in outs)


def test_cost_aware_retry_survives_async_scheduling(tiny_checkpoint, monkeypatch):
    """Verification once measured as hopeless is retried every ADAPTIVE_RETRY_STEPS declined lookups with
    async scheduling too (a retry falling due at a lookup made while the next step is in flight is kept
    for the next real decision), and lookups made in flight are neither logged nor counted as skipped."""
    monkeypatch.setattr(llm_engine_mod, "ngram_propose", lambda tokens, k, lo, hi: [tokens[-1]] * k)
    eng = _engine(tiny_checkpoint, async_scheduling=True, spec=SpecConfig("ngram", 3, adaptive=True))
    eng.step_costs.update({(1, 1, False): 5.0, (1, 4, False): 1e6})
    eng._cost_samples.update({(1, 1, False): 5, (1, 4, False): 5})
    eng.add_request("x", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=100))
    while eng.has_unfinished_requests():
        eng.step()
    st = eng.stats
    assert st.async_steps_total > 50  # declined lookups keep the steps going ahead
    assert st.spec_steps_total >= 2  # ... and retries still verify (the cost gets re-measured)
    assert eng.step_costs[(1, 4, False)] < 1e6
    # ~95 lookups declined, nearly all made in flight: only the few real decisions are logged and counted
    assert len(eng.spec_policy_log) <= 2 * st.spec_steps_total + 2 and st.spec_skipped_steps_total <= 2 * st.spec_steps_total + 2


def test_async_step_cost_forgets_a_dropped_step(tiny_checkpoint, monkeypatch):
    """The launch interval of a dropped in-flight step (every request in it aborted) must not be paired with
    the next launch, which follows idle time and prefill steps."""
    monkeypatch.setattr(llm_engine_mod, "ngram_propose", lambda tokens, k, lo, hi: [])
    eng = _engine(tiny_checkpoint, spec=SpecConfig("ngram", 3, adaptive=True), async_scheduling=True)
    sp = SamplingParams(temperature=0, max_tokens=40)
    for i in range(2):
        eng.add_request(f"a{i}", [1, 2, 3, 4 + i], sp)
    for _ in range(6):
        eng.step()
    assert eng._inflight is not None and eng._last_ahead is not None
    for i in range(2):
        eng.abort_request(f"a{i}")
    eng.add_request("b", [5, 6, 7], sp)
    eng.step()  # drops the dead in-flight step, then runs b's prefill synchronously
    assert eng._last_ahead is None


def test_prompt_tokens_not_counted_for_rows_finished_in_flight(engines):
    """A row whose request finished (here: aborted) while its step was in flight counts no prompt tokens."""
    totals = []
    for eng in engines:
        before = eng.stats.prompt_tokens_total
        sp = SamplingParams(temperature=0, max_tokens=10)
        eng.add_request("pa", [11], sp)  # one-token prompts: their first step already goes ahead
        eng.add_request("pb", [12], sp)
        eng.step()
        eng.abort_request("pa")
        while eng.has_unfinished_requests():
            eng.step()
        totals.append(eng.stats.prompt_tokens_total - before)
    assert totals == [2, 2]


def test_full_batch_with_a_queue_goes_ahead(tiny_checkpoint):
    """With every sequence slot taken, waiting requests wait either way: decode steps go ahead, and the
    outputs equal the synchronous engine's (a request waiting for a freed slot only starts a step later)."""
    jobs = [(0, [1 + i, 2, 3], SamplingParams(temperature=0, max_tokens=12 + i)) for i in range(6)]
    outs, ahead = [], 0
    for overlap in (False, True):
        eng = _engine(tiny_checkpoint, max_num_seqs=2, async_scheduling=overlap)
        queued_ahead = 0
        for j, (_, p, sp) in enumerate(jobs):
            eng.add_request(f"q{j}", p, sp)
        reqs = list(eng.scheduler.waiting)
        while eng.has_unfinished_requests():
            full_with_queue = bool(eng.scheduler.waiting) and len(eng.scheduler.running) == 2
            before = eng.stats.async_steps_total
            eng.step()
            queued_ahead += (eng.stats.async_steps_total - before) if full_with_queue else 0
        outs.append([r.output_token_ids for r in reqs])
        ahead = queued_ahead
    assert outs[0] == outs[1]
    assert ahead > 10
