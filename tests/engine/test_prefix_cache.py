"""Automatic prefix caching: the bookkeeping at toy sizes, then the engine on the tiny model, where a request served
from the cache must give exactly the tokens (and scores) of one computed from scratch."""

from __future__ import annotations

import random

import pytest
import torch

from vibeqwen.engine.cache import CacheConfig, CacheManager
from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.engine.prefix_cache import PrefixCache, chain_hashes
from vibeqwen.engine.request import Request
from vibeqwen.engine.scheduler import Scheduler, SchedulerConfig
from vibeqwen.engine.spec import SpecConfig
from vibeqwen.sampling import SamplingParams

B = 4  # block size of the toy caches


def _hashes(tokens):
    return chain_hashes(tokens, B, [])


def _cached_request(cm: CacheManager, rid: str, tokens: list[int]) -> None:
    """A request that computed `tokens` and was snapshotted, then freed (its blocks stay cached)."""
    assert cm.allocate(rid, len(tokens))
    assert cm.snapshot(rid, tokens, _hashes(tokens))
    cm.free(rid)


# ---- bookkeeping ----
def test_chain_hashes_extend_and_depend_on_every_earlier_token():
    a = list(range(10))
    known = chain_hashes(a[:5], B, [])
    assert len(known) == 1
    assert chain_hashes(a, B, known) is known and known == _hashes(a) and len(known) == 2
    b = [99] + a[1:]
    assert all(x != y for x, y in zip(_hashes(a), _hashes(b)))  # a change in block 0 changes every later hash
    assert _hashes(a[:4] + [7, 7, 7, 7])[0] == known[0]


def test_snapshot_then_match_shares_full_blocks_and_copies_the_partial_one():
    cm = CacheManager(CacheConfig(num_blocks=16, block_size=B, num_slots=2, num_prefix_slots=2))
    prompt = list(range(10, 20))  # 10 tokens: blocks 0, 1 full, block 2 holds 2
    assert cm.allocate("a", 10)
    table_a, slot_a = list(cm.block_tables["a"]), cm.slots["a"]
    assert cm.snapshot("a", prompt, _hashes(prompt))
    entry = cm.prefix.get(tuple(prompt))
    assert entry.blocks == table_a and entry.slot == 2  # prefix slots follow the running ones
    assert cm.take_copies() == [("state", slot_a, 2)]
    cm.free("a")
    assert cm.num_free_blocks == 16  # cached blocks count as free
    assert len(cm._free_blocks) == 13  # but stay out of the free list

    longer = prompt + [1, 2, 3, 4, 5]
    hit = cm.match(longer, _hashes(longer), len(longer) - 1)
    assert hit is entry
    assert cm.allocate_prefix("b", hit, 15)
    table_b = cm.block_tables["b"]
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2] and len(table_b) == 4
    assert cm.take_copies() == [("state", 2, cm.slots["b"]), ("block", table_a[2], table_b[2])]
    assert cm.num_free_blocks == 16 - 3 - 1  # b's own 2 blocks, 2 shared (still cached: no), the copied one
    cm.free("b")
    assert cm.num_free_blocks == 16 and len(cm.prefix) == 1


def test_match_respects_the_limit_and_checks_tokens_not_only_hashes():
    pc = PrefixCache(B, [5, 6])
    tokens = list(range(8))
    pc.insert(tuple(tokens), [0, 1], _hashes(tokens))
    assert pc.lookup(tokens + [9], _hashes(tokens + [9]), 8).num_tokens == 8
    assert pc.lookup(tokens, _hashes(tokens), 7) is None  # a hit must leave a token to run
    forged = [1] * 8 + [9]  # other tokens presented with the cached prefix's hashes (a collision)
    assert pc.lookup(forged, _hashes(tokens), 8) is None
    assert pc.shared_blocks(_hashes(tokens[:4] + [0, 0, 0, 0]), 2) == 1


def test_an_entry_with_a_next_token_serves_only_sequences_that_continue_with_it():
    pc = PrefixCache(B, [5, 6])
    tokens = list(range(6))
    pc.insert(tuple(tokens), [0, 1], _hashes(tokens), next_token=40)
    assert pc.lookup(tokens + [40, 1], _hashes(tokens + [40, 1]), 7).num_tokens == 6
    assert pc.lookup(tokens + [41, 1], _hashes(tokens + [41, 1]), 7) is None


def test_allocation_pressure_evicts_the_least_recently_used_entries():
    cm = CacheManager(CacheConfig(num_blocks=8, block_size=B, num_slots=2, num_prefix_slots=3))
    first, second = [1] * 8, [2] * 8
    _cached_request(cm, "a", first)
    _cached_request(cm, "b", second)
    assert len(cm.prefix) == 2 and cm.num_free_blocks == 8
    cm.prefix.touch(cm.prefix.get(tuple(first)))  # `second` is now the oldest
    assert cm.allocate("c", 20)  # 5 blocks: 4 free, one reclaimed from `second`
    assert cm.prefix.get(tuple(second)) is None and cm.prefix.get(tuple(first)) is not None
    assert not cm.allocate("d", 17)  # 5 more: only the 3 left (2 of them `first`'s) could be had
    assert cm.prefix.get(tuple(first)) is not None  # a failed allocation evicts nothing
    cm.free("c")
    assert cm.num_free_blocks == 8


def test_full_prefix_slots_evict_the_oldest_entry():
    cm = CacheManager(CacheConfig(num_blocks=32, block_size=B, num_slots=1, num_prefix_slots=2))
    prompts = [[i] * 6 for i in range(3)]
    for i, p in enumerate(prompts):
        _cached_request(cm, f"r{i}", p)
    assert [e.tokens for e in cm.prefix.entries()] == [tuple(prompts[1]), tuple(prompts[2])]
    assert cm.num_free_blocks == 32
    assert cm.clear_prefix_cache() == 2 and len(cm._free_blocks) == 32


def test_eviction_keeps_entries_that_would_free_nothing():
    cm = CacheManager(CacheConfig(num_blocks=6, block_size=B, num_slots=2, num_prefix_slots=3))
    held, cached = [1] * 8, [2] * 8
    _cached_request(cm, "old", cached)
    assert cm.allocate("run", 8) and cm.snapshot("run", held, _hashes(held))  # its blocks stay in "run"'s table
    cm.prefix.touch(cm.prefix.get(tuple(cached)))  # the held entry is now the oldest
    assert cm.allocate("new", 12)  # 3 blocks, 2 free: only the entry of `cached` can give the third
    assert cm.prefix.get(tuple(held)) is not None and cm.prefix.get(tuple(cached)) is None


def test_a_pinned_hit_is_refused_rather_than_evicted_under_pressure():
    cm = CacheManager(CacheConfig(num_blocks=4, block_size=B, num_slots=2, num_prefix_slots=1))
    tokens = list(range(8))
    _cached_request(cm, "a", tokens)
    hit = cm.match(tokens + [1], _hashes(tokens + [1]), 8)
    # 2 shared blocks + 3 new ones would need 5 of 4 blocks: refused, nothing changes
    assert not cm.allocate_prefix("b", hit, 20)
    assert "b" not in cm.slots and cm.num_free_blocks == 4 and cm.prefix.get(tuple(tokens)) is hit
    assert cm.allocate_prefix("b", hit, 16)
    assert cm.num_free_blocks == 0


def test_random_operations_with_sharing_leak_nothing():
    rng = random.Random(1)
    cm = CacheManager(CacheConfig(num_blocks=48, block_size=B, num_slots=6, num_prefix_slots=4))
    live: dict[str, list[int]] = {}
    vocab = [0, 1]  # two tokens: prefixes repeat often
    for step in range(4000):
        op = rng.random()
        if op < 0.4 and len(live) < 6:
            rid = f"r{step}"
            tokens = [rng.choice(vocab) for _ in range(rng.randint(2, 24))]
            hit = cm.match(tokens, _hashes(tokens), len(tokens) - 1)
            ok = cm.allocate_prefix(rid, hit, len(tokens)) if hit else cm.allocate(rid, len(tokens))
            if ok:
                live[rid] = tokens
        elif op < 0.6 and live:
            rid = rng.choice(list(live))
            cm.snapshot(rid, live[rid], _hashes(live[rid]))
        elif op < 0.75 and live:
            rid = rng.choice(list(live))
            extra = [rng.choice(vocab) for _ in range(rng.randint(1, 6))]
            if cm.allocate(rid, len(live[rid]) + len(extra)):
                live[rid] = live[rid] + extra
        elif live:
            rid = rng.choice(list(live))
            cm.free(rid)
            del live[rid]
        cm.take_copies()
        held = [b for t in cm.block_tables.values() for b in t]
        entry_blocks = [b for e in cm.prefix.entries() for b in e.blocks]
        for block in range(48):
            assert cm._refs[block] == held.count(block) + entry_blocks.count(block)
            assert cm._entry_refs[block] == entry_blocks.count(block)
        in_use = set(held) | set(entry_blocks)
        assert set(cm._free_blocks).isdisjoint(in_use) and len(cm._free_blocks) + len(in_use) == 48
        cached = {b for b in set(entry_blocks) if b not in held}
        assert cm.num_free_blocks == len(cm._free_blocks) + len(cached)
        # every live request's shared blocks really hold its tokens: they came from entries of equal prefixes
        for rid, tokens in live.items():
            for e in cm.prefix.entries():
                n = min(len(tokens), e.num_tokens) // B
                for k in range(n):
                    if cm.block_tables[rid][k] == e.blocks[k]:
                        assert tokens[: (k + 1) * B] == list(e.tokens[: (k + 1) * B])
    for rid in list(live):
        cm.free(rid)
    cm.clear_prefix_cache()
    assert len(cm._free_blocks) == 48 and cm.num_free_slots == 6 and cm.prefix.num_free_slots == 4


def _scheduler(num_blocks=64, prefix_slots=4, budget=64):
    cm = CacheManager(CacheConfig(num_blocks, B, 4, prefix_slots))
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), cm)


def _finish_prompt(s: Scheduler, req: Request) -> None:
    """Run the scheduler until `req` has sampled its first token (the model is not run: token 7 is sampled)."""
    while req.num_output_tokens == 0:
        out = s.schedule()
        s.update(out, {x.request.request_id: [7] for x in out.scheduled if x.samples})
        s.cache.take_copies()


def test_scheduler_starts_after_the_cached_prefix_and_splits_at_a_branch_point():
    s = _scheduler()
    system = list(range(100, 111))  # 11 shared tokens: 2 full blocks
    a = Request("a", system + [1, 2, 3], SamplingParams(max_tokens=4))
    s.add_request(a)
    _finish_prompt(s, a)
    assert a.num_cached_tokens == 0 and s.cache.prefix.get(tuple(a.prompt_token_ids)) is not None

    b = Request("b", system + [4, 5, 6], SamplingParams(max_tokens=4))  # shares 2 blocks with a, no snapshot there
    s.add_request(b)
    out = s.schedule()
    chunk = next(x for x in out.scheduled if x.request is b)
    assert b.num_cached_tokens == 0 and b.snapshot_at == [8] and chunk.num_new_tokens == 8
    s.update(out, {x.request.request_id: [7] for x in out.scheduled if x.samples})
    assert s.cache.prefix.get(tuple(system[:8])) is not None  # the branch point's snapshot
    _finish_prompt(s, b)

    c = Request("c", system + [9], SamplingParams(max_tokens=4))
    s.add_request(c)
    out = s.schedule()
    chunk = next(x for x in out.scheduled if x.request is c)
    assert c.num_cached_tokens == 8 and chunk.num_new_tokens == 4 and c.num_computed_tokens == 8
    assert s.prefix_cache_hits == 8 and s.prefix_cache_queries == 14 + 14 + 12


def test_a_hit_that_does_not_fit_at_the_cache_end_starts_cold():
    """A hit ending inside a block keeps that block while it is copied: at the very end of the cache that is one
    block more than a cold start needs, and the request must start cold rather than wait (and block the queue)."""
    s = _scheduler(num_blocks=4)
    a = Request("a", list(range(13)), SamplingParams(max_tokens=1))
    s.add_request(a)
    _finish_prompt(s, a)
    assert a.finished and s.cache.num_free_blocks == 4 and len(s.cache._free_blocks) == 0
    b = Request("b", list(range(13)) + [7, 8], SamplingParams(max_tokens=1))
    s.add_request(b)
    out = s.schedule()
    assert [x.request for x in out.scheduled] == [b] and out.scheduled[0].num_new_tokens == 15
    assert b.num_cached_tokens == 0 and len(s.cache.prefix) == 0  # the entry gave its blocks up


def test_a_prefix_cache_point_splits_the_prefill_and_replaces_the_prompt_end_snapshot():
    """A chat's prompt carries the position where its generation prompt starts: the next turn repeats the
    conversation up to there (not the generation prompt), so the snapshot goes there, besides a branch point."""
    s = _scheduler()
    system = list(range(500, 509))  # 9 tokens: 2 shared blocks
    a = Request("a", system + [1, 2, 3, 4, 90, 91], SamplingParams(max_tokens=2, prefix_cache_point=13))
    s.add_request(a)
    _finish_prompt(s, a)
    assert s.cache.prefix.get(tuple(a.prompt_token_ids[:13])) is not None
    assert s.cache.prefix.get(tuple(a.prompt_token_ids)) is None  # no prompt-end snapshot: the point replaces it
    b = Request("b", system + [5, 6, 7, 8, 90, 91], SamplingParams(max_tokens=2, prefix_cache_point=13))
    s.add_request(b)
    sizes = []
    while b.num_output_tokens == 0:
        out = s.schedule()
        sizes += [x.num_new_tokens for x in out.scheduled if x.request is b]
        s.update(out, {x.request.request_id: [7] for x in out.scheduled if x.samples})
    assert b.num_cached_tokens == 0 and sizes == [8, 5, 2]  # a branch point at 8, its own point at 13
    turn2 = a.prompt_token_ids[:13] + [92, 93, 94]  # the next turn: the conversation up to a's point, then more
    c = Request("c", turn2, SamplingParams(max_tokens=2, prefix_cache_point=15))
    s.add_request(c)
    s.schedule()
    assert c.num_cached_tokens == 13


def test_a_point_too_short_for_a_snapshot_leaves_the_prompt_end_snapshot():
    s = _scheduler()
    a = Request("a", list(range(600, 610)), SamplingParams(max_tokens=2, prefix_cache_point=2))  # below a block
    s.add_request(a)
    _finish_prompt(s, a)
    assert s.cache.prefix.get(tuple(a.prompt_token_ids)) is not None


def test_scheduler_caches_a_resent_prompt_one_token_short():
    s = _scheduler()
    prompt = list(range(200, 210))
    runs = []
    for i in range(3):
        r = Request(f"r{i}", list(prompt), SamplingParams(max_tokens=2))
        s.add_request(r)
        _finish_prompt(s, r)
        runs.append(r.num_cached_tokens)
    assert runs == [0, 0, 9]


def test_twins_wait_for_the_first_prefill_and_start_one_token_short():
    """Requests with the same prompt at once (an API request's n choices): the first prefills and stops one token
    short for a snapshot; the others wait, then start on it in the step that runs its last token. The queue behind
    them waits too (FCFS: a later request must not take the twins' slots or budget)."""
    s = _scheduler(budget=64)
    prompt = list(range(700, 730))  # 30 tokens
    twins = [Request(f"n{i}", list(prompt), SamplingParams(max_tokens=2)) for i in range(3)]
    other = Request("o", list(range(800, 812)), SamplingParams(max_tokens=2))
    for r in [*twins, other]:
        s.add_request(r)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("n0", 29)]
    assert [r.request_id for r in s.waiting] == ["n1", "n2", "o"]  # waiting, in order
    s.update(out, {x.request.request_id: [7] for x in out.scheduled if x.samples})
    assert s.cache.prefix.get(tuple(prompt[:29])) is not None
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("n0", 1), ("n1", 1), ("n2", 1),
                                                                                   ("o", 12)]
    assert [r.num_cached_tokens for r in twins] == [0, 29, 29] and not s.waiting
    assert s.prefix_cache_hits == 58
    s.update(out, {x.request.request_id: [7] for x in out.scheduled if x.samples})
    assert all(r.num_output_tokens == 1 for r in twins)
    assert s.cache.prefix.get(tuple(prompt)) is None  # the entry one token short serves the whole prompt too


def test_a_twin_arriving_mid_prefill_waits_and_no_twin_waits_without_the_cache():
    s = _scheduler(budget=8)  # the 30-token prompt takes 4 steps
    prompt = list(range(900, 930))
    a = Request("a", list(prompt), SamplingParams(max_tokens=2))
    s.add_request(a)
    out = s.schedule()
    s.update(out, {})
    b = Request("b", list(prompt), SamplingParams(max_tokens=2))  # the same prompt, a step later
    s.add_request(b)
    sizes = []
    while b.num_output_tokens == 0:
        out = s.schedule()
        sizes.append([(x.request.request_id, x.num_new_tokens) for x in out.scheduled])
        s.update(out, {x.request.request_id: [7] for x in out.scheduled if x.samples})
    assert 29 in a.snapshot_at or s.cache.prefix.get(tuple(prompt[:29])) is not None
    assert b.num_cached_tokens == 29 and sizes[-1] == [("a", 1), ("b", 1)], sizes
    # a prompt of one block or less, a prompt-logprobs request, or no prefix cache: nobody waits
    for kw, tokens in (({}, list(range(10, 10 + B))), ({"prompt_logprobs": 1}, prompt)):
        s2 = _scheduler()
        reqs = [Request(f"x{i}", list(tokens), SamplingParams(max_tokens=2, **kw)) for i in range(2)]
        for r in reqs:
            s2.add_request(r)
        assert len(s2.schedule().scheduled) == 2
    off = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), CacheManager(CacheConfig(64, B, 4, 0)))
    for i in range(2):
        off.add_request(Request(f"y{i}", list(prompt), SamplingParams(max_tokens=2)))
    assert len(off.schedule().scheduled) == 2


def test_no_lookup_for_prompt_logprobs_and_no_snapshot_while_in_flight():
    s = _scheduler()
    prompt = list(range(300, 310))
    a = Request("a", prompt, SamplingParams(max_tokens=2))
    s.add_request(a)
    _finish_prompt(s, a)
    b = Request("b", prompt + [1], SamplingParams(max_tokens=2, prompt_logprobs=1))
    s.add_request(b)
    _finish_prompt(s, b)
    assert b.num_cached_tokens == 0 and s.prefix_cache_queries == 10  # b's prompt was not looked up
    c = Request("c", list(range(400, 410)), SamplingParams(max_tokens=2))
    s.add_request(c)
    _finish_prompt(s, c)
    s.in_flight = frozenset({"c"})  # a launched step holds c: its state is ahead of its computed tokens
    out = s.schedule()
    s.update(out, {x.request.request_id: [7] for x in out.scheduled if x.samples})
    assert c.finished and s.cache.prefix.get(tuple(c.token_slice(0, c.num_computed_tokens))) is None


# ---- the engine: cached prefixes give the tokens of computed ones ----
@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    """(prefix caching on, off) with 4-token blocks, so hits end mid-block often."""
    def make(on, **kw):
        return LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
            max_num_seqs=8, block_size=B, max_num_batched_tokens=64, enable_prefix_caching=on, **kw))
    return make(True), make(False)


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 248044, (n,), generator=g).tolist()


def _run(engine, prompt, params):
    req = engine.add_request(f"t{next(_ids)}", prompt, params)
    while not req.finished:
        engine.step()
    return req


_ids = iter(range(10**9))


def test_multi_turn_conversation_reuses_prompt_and_reply(engines):
    on, off = engines
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    history = _tokens(21, seed=1)
    for turn in range(4):
        a, b = _run(on, history, greedy), _run(off, history, greedy)
        assert a.output_token_ids == b.output_token_ids
        for (lp_a, top_a), (lp_b, top_b) in zip(a.output_logprobs, b.output_logprobs):
            assert lp_a == pytest.approx(lp_b, abs=1e-4)
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
        if turn:  # the previous turn's prompt and reply (but its last token, never run) came from the cache
            assert a.num_cached_tokens == len(history) - 5 - 1
        history = history + a.output_token_ids + _tokens(5, seed=10 + turn)
    assert on.cache_manager.num_free_blocks == on.cache_manager.config.num_blocks


def test_shared_system_prompt_and_resent_prompts(engines):
    on, off = engines
    system = _tokens(26, seed=2)
    params = SamplingParams(temperature=0, max_tokens=5)
    cached = []
    for i in range(4):
        prompt = system + _tokens(3 + i, seed=20 + i)
        a, b = _run(on, prompt, params), _run(off, prompt, params)
        assert a.output_token_ids == b.output_token_ids
        cached.append(a.num_cached_tokens)
    assert cached == [0, 0, 24, 24]  # the second request split its prefill at 24 (6 shared blocks) for a snapshot
    prompt = _tokens(13, seed=3)
    runs = [_run(on, prompt, params) for _ in range(3)]
    assert [r.num_cached_tokens for r in runs] == [0, 0, 12]
    assert all(r.output_token_ids == _run(off, prompt, params).output_token_ids for r in runs)


def test_twins_give_the_tokens_of_prompts_computed_whole(engines):
    """n choices of one prompt added at once: the first prefills, the others start one token short on its snapshot;
    greedy and seeded outputs are those of the engine without the cache."""
    on, off = engines
    prompt = _tokens(37, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=5), SamplingParams(temperature=0.8, max_tokens=5, seed=11),
              SamplingParams(temperature=0.8, max_tokens=5, seed=12)]
    outs = {}
    for name, engine in (("on", on), ("off", off)):
        reqs = [engine.add_request(f"tw{name}{i}-{next(_ids)}", list(prompt), p) for i, p in enumerate(params)]
        while not all(r.finished for r in reqs):
            engine.step()
        outs[name] = reqs
    assert [r.output_token_ids for r in outs["on"]] == [r.output_token_ids for r in outs["off"]]
    assert [r.num_cached_tokens for r in outs["on"]] == [0, 36, 36]


def test_seeded_sampling_and_prompt_logprobs_are_unchanged_by_the_cache(engines):
    on, off = engines
    prompt = _tokens(30, seed=4)
    _run(on, prompt[:22], SamplingParams(temperature=0, max_tokens=1))  # cache a prefix
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=5)
    a = _run(on, prompt, seeded)
    assert a.num_cached_tokens == 22 and a.output_token_ids == _run(off, prompt, seeded).output_token_ids
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    a, b = _run(on, prompt, scored), _run(off, prompt, scored)
    assert a.num_cached_tokens == 0 and len(a.prompt_logprobs) == len(prompt) - 1
    assert [lp for lp, _ in a.prompt_logprobs] == pytest.approx([lp for lp, _ in b.prompt_logprobs], abs=1e-4)


def test_batched_hits_with_eviction_and_preemption(tiny_checkpoint, engines):
    """A cache too small for every entry: requests sharing prefixes run together, entries are evicted for running
    requests, some requests are preempted and restart (from their own snapshots); the tokens never change."""
    from vibeqwen.model.cache import gdn_bytes_per_slot, kv_bytes_per_block

    _, off = engines
    cfg = off.model.cfg
    block, slot = kv_bytes_per_block(cfg, B, torch.float32), gdn_bytes_per_slot(cfg, torch.float32)
    small = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=4, block_size=B, max_num_batched_tokens=32, cache_memory_bytes=7 * slot + 16 * block,
        prefix_cache_slots=3))
    assert small.cache_manager.config.num_blocks == 16
    base = _tokens(18, seed=6)
    prompts = [base + _tokens(2 + i % 3, seed=30 + i) for i in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=12)] * 10
    expected = off.generate_batch(prompts, params)
    assert small.generate_batch(prompts[:2], params[:2]) == expected[:2]
    assert small.generate_batch(prompts, params) == expected
    assert small.stats.prefix_cache_hits_total > 0 and small.stats.preemptions_total > 0
    assert small.cache_manager.num_free_blocks == 16 and small.cache_manager.num_free_slots == 4


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_speculative_decoding_on_cached_prefixes(tiny_checkpoint, engines, method):
    _, off = engines
    spec = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=8, block_size=B, spec=SpecConfig(method, 3)))
    history = _tokens(17, seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    for turn in range(3):
        a = _run(spec, history, greedy)
        assert a.output_token_ids == _run(off, history, greedy).output_token_ids
        assert (a.num_cached_tokens > 0) == (turn > 0)
        history = history + a.output_token_ids + _tokens(3, seed=40 + turn)


def test_mtp_drafts_read_the_kv_of_a_request_computed_whole(tiny_checkpoint):
    """The MTP head pairs each position's hidden state with the next token, so its K/V at a cached prefix's last
    position depends on the token after the prefix: with MTP drafting, a hit needs the same token there. Then the
    MTP layer's K/V over a hit request's prompt equals that of the request computed whole, and so do its drafts."""
    def make(on):
        return LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
            max_num_seqs=4, block_size=B, spec=SpecConfig("mtp", 3), enable_prefix_caching=on))

    on, off = make(True), make(False)
    assert on.cache_manager.match_next_token
    system = _tokens(14, seed=9)
    users = [system + _tokens(3, seed=70 + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6)
    for u in users[:2]:
        _run(on, u, params)
    entry = on.cache_manager.prefix.get(tuple(system[:12]))  # the branch point's snapshot
    assert entry is not None and entry.next_token == users[1][12]
    mtp = on.model.cfg.num_hidden_layers

    def first_step(engine, prompt):
        req = engine.add_request(f"m{next(_ids)}", prompt, params)
        while not req.output_token_ids:
            engine.step()
        table = engine.cache_manager.block_tables[req.request_id]
        pos = torch.arange(len(prompt))
        slots = torch.tensor(table)[pos // B] * B + pos % B
        k = engine.runner.cache.k[mtp].flatten(0, 1)[slots].clone()
        drafts = list(req.spec_token_ids)
        while not req.finished:
            engine.step()
        return req, k, drafts

    same = users[1][:13] + _tokens(2, seed=80)  # continues the branch point with the same token: a hit
    other = system[:12] + [users[1][12] + 1] + _tokens(2, seed=81)  # another token after it: no hit
    for prompt, hit in ((same, 12), (other, 0)):
        a, k_on, d_on = first_step(on, prompt)
        b, k_off, d_off = first_step(off, prompt)
        torch.testing.assert_close(k_on, k_off, rtol=1e-5, atol=1e-5)
        assert d_on == d_off and a.output_token_ids == b.output_token_ids
        assert a.num_cached_tokens == hit


def test_a_stop_among_accepted_drafts_leaves_no_snapshot_past_it(tiny_checkpoint, engines, monkeypatch):
    """Drafts accepted after a stop token are dropped, but the GDN state has taken them in: the finished request's
    state is past its tokens and must not be cached as theirs (the next turn resends exactly those tokens)."""
    from vibeqwen.engine import llm_engine

    _, off = engines
    prompt = _tokens(14, seed=11)
    plain = _run(off, prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)).output_token_ids
    assert plain[2] not in plain[:2]

    def propose(tokens, k, lo, hi):  # the plain continuation: drafts [o1, o2, o3] after the prompt step
        done = len(tokens) - len(prompt)
        return plain[done:done + k] if tokens[:len(prompt)] == prompt else []

    monkeypatch.setattr(llm_engine, "ngram_propose", propose)
    spec = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=4, block_size=B, spec=SpecConfig("ngram", 3)))
    first = _run(spec, prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                              stop_token_ids=[plain[2]]))
    assert first.output_token_ids == plain[:3] and first.num_computed_tokens > first.num_tokens - 1
    monkeypatch.undo()
    follow = prompt + first.output_token_ids + _tokens(3, seed=12)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    a, b = _run(spec, follow, greedy), _run(off, follow, greedy)
    assert a.num_cached_tokens == len(prompt) and a.output_token_ids == b.output_token_ids


def test_async_scheduling_with_prefix_caching(tiny_checkpoint, engines):
    _, off = engines
    eng = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=8, block_size=B, async_scheduling=True, prefix_cache_slots=24))
    base = _tokens(15, seed=8)
    prompts = [base + _tokens(1 + i, seed=50 + i) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=9 + i) for i in range(6)]
    expected = off.generate_batch(prompts, params)
    for _ in range(3):  # the second round snapshots one token short of each prompt, the third starts there
        assert eng.generate_batch(prompts, params) == expected
    assert eng.stats.async_steps_total > 0 and eng.stats.prefix_cache_hits_total > 0
    assert eng.cache_manager.num_free_blocks == eng.cache_manager.config.num_blocks


def test_prefix_slots_come_out_of_the_budget_and_zero_turns_caching_off(tiny_checkpoint):
    from vibeqwen.model.cache import gdn_bytes_per_slot, kv_bytes_per_block

    def make(**kw):
        return LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=4, block_size=B, **kw))

    default = make()
    c = default.cache_manager.config
    assert c.num_prefix_slots == 8 and default.runner.cache.ssm_stacked.shape[1] == 4 + 8 + 1
    off = make(prefix_cache_slots=0)
    assert off.cache_manager.prefix is None and off.cache_manager.config.num_prefix_slots == 0
    cfg = default.model.cfg
    slot, block = gdn_bytes_per_slot(cfg, torch.float32), kv_bytes_per_block(cfg, B, torch.float32)
    assert off.cache_manager.config.num_blocks - c.num_blocks in (8 * slot // block, 8 * slot // block + 1)
    # a small budget gives the snapshots at most a quarter of it
    small = make(cache_memory_bytes=4 * slot + 64 * block)
    assert small.cache_manager.config.num_prefix_slots == (4 * slot + 64 * block) // 4 // slot
    assert make(enable_prefix_caching=False).cache_manager.prefix is None
    with pytest.raises(ValueError, match="prefix_cache_slots"):
        EngineConfig(prefix_cache_slots=-1)
