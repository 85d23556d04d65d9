"""Speculative decoding is lossless: exact at temperature 0, distribution-preserving above it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import vibeqwen.engine.llm_engine as llm_engine_mod
import vibeqwen.engine.spec as spec_mod
from oracle_drafts import oracle_drafter
from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.engine.sampler import make_generator, sample_rows, target_probs
from vibeqwen.engine.spec import SpecConfig, greedy_accept, ngram_propose, verify, verify_rows
from vibeqwen.model.cache import gdn_bytes_per_slot, kv_bytes_per_block
from vibeqwen.sampling import SamplingParams


def test_ngram_prefers_longest_latest_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_propose(toks, 3, 2, 4) == [7, 8, 5]  # suffix [2, 3]: latest earlier match is at 5
    assert ngram_propose([4, 5, 6, 4, 5, 6, 4, 5], 2, 2, 4) == [6, 4]
    assert ngram_propose([1, 2, 3, 4], 3, 2, 4) == []
    assert ngram_propose([1, 1], 3, 1, 4) == [1]


def _ngram_scan(tokens, k, n_min, n_max):
    """The lookup rule written as a plain scan (what the vectorised ngram_propose must equal)."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        for start in range(size - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[size - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_equals_a_plain_scan_on_random_sequences():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        vocab = int(torch.randint(2, 9, (1,), generator=g))  # small vocabularies: many partial matches
        size = int(torch.randint(0, 60, (1,), generator=g))
        toks = torch.randint(0, vocab, (size,), generator=g).tolist()
        k = int(torch.randint(1, 6, (1,), generator=g))
        lo = int(torch.randint(1, 4, (1,), generator=g))
        hi = lo + int(torch.randint(0, 3, (1,), generator=g))
        assert ngram_propose(toks, k, lo, hi) == _ngram_scan(toks, k, lo, hi), (toks, k, lo, hi)


def test_greedy_accept_matches_verify():
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        d = int(torch.randint(0, 5, (1,), generator=g))
        logits = torch.randn(d + 1, 4, generator=g)
        drafts = torch.randint(0, 4, (d,), generator=g).tolist()
        expect = verify(logits, drafts, SamplingParams(temperature=0), None)
        assert greedy_accept(drafts, logits.argmax(-1).tolist()) == expect


def test_verify_greedy_accepts_longest_matching_prefix():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 2]):
        logits[row, best] = 1.0
    g = SamplingParams(temperature=0)
    assert verify(logits, [3, 5, 7], g, None) == [3, 5, 7, 2]  # all accepted + bonus
    assert verify(logits, [3, 6, 7], g, None) == [3, 5]  # first mismatch replaced by the target's argmax
    assert verify(logits, [4, 5, 7], g, None) == [3]


def _two_drafts():
    """(V, logits [3, V], params, target p at positions 0 and 1, drafts): a so-so first draft, a good second."""
    torch.manual_seed(0)
    v = 6
    logits = torch.randn(3, v) * 1.5
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=5)
    p0, p1 = target_probs(logits[0], params), target_probs(logits[1], params)
    return v, logits, params, p0, p1, [int(torch.argsort(p0)[-2]), int(torch.argmax(p1))]


def test_rejection_sampling_preserves_the_target_distribution():
    """Empirical distribution of the first two output tokens vs the exact target p, for fixed drafts."""
    v, logits, params, p0, p1, drafts = _two_drafts()
    gen = torch.Generator().manual_seed(1)
    n = 20_000
    first = torch.zeros(v)
    second_given = torch.zeros(v)
    count_given = 0
    for _ in range(n):
        out = verify(logits, drafts, params, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            count_given += 1
            second_given[out[1]] += 1
    # 5 sigma of a binomial at n samples
    tol0 = 5 * torch.sqrt(p0 * (1 - p0) / n) + 1e-3
    assert torch.all((first / n - p0).abs() <= tol0), (first / n, p0)
    tol1 = 5 * torch.sqrt(p1 * (1 - p1) / count_given) + 1e-3
    assert torch.all((second_given / count_given - p1).abs() <= tol1), (second_given / count_given, p1)
    assert first[p0 == 0].sum() == 0, "never emits a token outside top-k / top-p"


def test_batched_verification_preserves_the_target_distribution():
    """verify_rows over many copies of one request at once: the same law as `verify`."""
    v, logits, params, p0, p1, drafts = _two_drafts()
    n = 20_000
    out = verify_rows(logits.repeat(n, 1), [drafts] * n, [params] * n, [None] * n)
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=v).float() / n
    assert torch.all((first - p0).abs() <= 5 * torch.sqrt(p0 * (1 - p0) / n) + 1e-3), (first, p0)
    given = [o[1] for o in out if o[0] == drafts[0]]
    second = torch.bincount(torch.tensor(given), minlength=v).float() / len(given)
    assert torch.all((second - p1).abs() <= 5 * torch.sqrt(p1 * (1 - p1) / len(given)) + 1e-3), (second, p1)
    assert all(len(o) == 3 for o in out if o[:2] == drafts)  # both accepted: the bonus token follows


def test_batched_verification_of_a_seeded_request_ignores_its_neighbours():
    torch.manual_seed(1)
    v = 50
    mine = torch.randn(4, v)
    seeded = SamplingParams(temperature=1.0, top_k=10, seed=3)
    drafts = [int(mine[0].argmax()), int(mine[1].argmax()), 7]
    alone = [verify_rows(mine, [drafts], [seeded], [torch.Generator().manual_seed(3)])[0] for _ in range(2)]
    assert alone[0] == alone[1]
    others = torch.randn(2, v)
    mixed = verify_rows(torch.cat([others, mine]), [[1], drafts], [SamplingParams(temperature=0.7, top_p=0.5), seeded],
                        [None, torch.Generator().manual_seed(3)])
    assert mixed[1] == alone[0]
    # a longer neighbour (more drafts, no top_k: the whole vocabulary) changes nothing either
    wide = verify_rows(torch.cat([mine, torch.randn(6, v)]), [drafts, [1, 2, 3, 4, 5]],
                       [seeded, SamplingParams(temperature=1.0, seed=9)],
                       [torch.Generator().manual_seed(3), torch.Generator().manual_seed(9)])
    assert wide[0] == alone[0]
    # next to a request that keeps every id (verified in its own group): the same again
    apart = verify_rows(torch.cat([torch.randn(2, v), mine]), [[3], drafts], [SamplingParams(temperature=1.0), seeded],
                        [None, torch.Generator().manual_seed(3)])
    assert apart[1] == alone[0] and len(apart[0]) in (1, 2)


def test_seeded_verification_draws_each_position_as_plain_sampling_does(monkeypatch):
    """With positions, a seeded request's verified tokens are plain seeded sampling's at those sequence indices,
    however many drafts the step verifies (a preemption or the step budget can change that) and whatever they are."""
    torch.manual_seed(2)
    v, pos = 40, 17
    logits = torch.randn(5, v) * 2
    cases = [SamplingParams(temperature=0.9, top_k=8, seed=5), SamplingParams(temperature=1.1, seed=6),
             SamplingParams(temperature=0.7, top_p=0.8, seed=7)]
    for params in cases:
        plain = [int(sample_rows(logits[j:j + 1], [params], [make_generator(params)], [pos + j])[0]) for j in range(5)]
        for drafts in (plain[:4], plain[:2], plain[:1], [plain[0], plain[1], (plain[2] + 1) % v, 3], [(plain[0] + 1) % v]):
            k = next((j for j, x in enumerate(drafts) if x != plain[j]), len(drafts))
            expected = plain[: k + 1]
            g = make_generator(params)
            assert verify_rows(logits[: len(drafts) + 1], [drafts], [params], [g], [pos]) == [expected]
            # the single-request rule (requests with penalties, bias or a constraint) draws the same
            assert verify(logits[: len(drafts) + 1], drafts, params, make_generator(params), pos) == expected
        # next to other requests, in pieces of VERIFY_ROWS_AT_ONCE rows too (and a request longer than a piece)
        other = SamplingParams(temperature=1.0)
        for at_once in (64, 3, 2):
            monkeypatch.setattr(spec_mod, "VERIFY_ROWS_AT_ONCE", at_once)
            mixed = verify_rows(torch.cat([torch.randn(3, v), logits[:3], torch.randn(2, v), logits]),
                                [[1, 2], plain[:2], [4], plain[:4]], [other, params, other, params],
                                [None, make_generator(params), None, make_generator(params)], [3, pos, 9, pos])
            assert mixed[1] == plain[:3] and mixed[3] == plain and len(mixed[0]) in (1, 2, 3)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, 248044, (n,), generator=g).tolist() for n in (3, 12, 29, 1)]
    ps.append((ps[1] * 4)[:40])  # repetitive: the n-gram drafter finds matches in the prompt
    return ps


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, prompts):
    engine = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=8))
    params = [SamplingParams(temperature=0, max_tokens=12 + i) for i in range(len(prompts))]
    return params, engine.generate_batch(prompts, params)


def _engine(ckpt, method, k, **kw):
    return LLMEngine.from_checkpoint(ckpt, config=EngineConfig(max_num_seqs=8, spec=SpecConfig(method, k), **kw))


@pytest.mark.parametrize("method,k", [("ngram", 3), ("mtp", 1), ("mtp", 3), ("mtp+ngram", 2)])
def test_greedy_output_equals_plain_decoding(tiny_checkpoint, prompts, reference, method, k):
    params, expected = reference
    engine = _engine(tiny_checkpoint, method, k)
    assert engine.generate_batch(prompts, params) == expected
    # mixed batch: speculating requests next to prefills of late arrivals
    first = engine.generate_batch(prompts[:2], params[:2])
    assert first == expected[:2]
    assert engine.cache_manager.num_free_slots == 8 and not engine.cache_manager.block_tables
    if "mtp" in method:
        assert engine.stats.spec_drafted_total > 0


def test_partially_accepted_drafts_roll_back_exactly(tiny_checkpoint, prompts, reference, monkeypatch):
    """Drafts that are right for a while then wrong: acceptance lengths vary, and the GDN state must be
    rolled back to every possible position. An oracle drafter built from the reference output does this."""
    params, expected = reference
    monkeypatch.setattr(llm_engine_mod, "ngram_propose", oracle_drafter(prompts, expected))
    engine = _engine(tiny_checkpoint, "ngram", 4)
    assert engine.generate_batch(prompts, params) == expected
    s = engine.stats
    assert s.spec_accepted_total > 0 and s.spec_accepted_total < s.spec_drafted_total
    assert len(s.spec_accepted_per_position) == 4 and s.spec_accepted_per_position[3] > 0
    assert 1.0 < s.mean_acceptance_length < 5.0


def test_padded_drafts_equal_plain_and_are_not_counted(tiny_checkpoint, prompts, reference, monkeypatch):
    """Draft padding (the GPU path's way to one query length per verification batch): sequences without a
    proposal get filler drafts up to the longest. Output still equals plain decoding; the statistics count
    only proposed drafts; padded steps really have one query length."""
    params, expected = reference
    drafter = oracle_drafter(prompts, expected)
    proposed = {"n": 0}

    def some(tokens, k, lo, hi):
        if tuple(tokens[: len(prompts[1])]) != tuple(prompts[1]) or len(tokens) % 2:
            return []  # only one prompt proposes, every other step
        d = drafter(tokens, k, lo, hi)
        proposed["n"] += len(d)
        return d

    monkeypatch.setattr(llm_engine_mod, "ngram_propose", some)
    engine = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=8, spec=SpecConfig("ngram", 3, pad_drafts=True)))
    padded_steps = {"n": 0}
    execute = engine.runner.execute

    def watch(output):
        decoding = [s for s in output.scheduled if s.request.num_output_tokens > 0]
        if any(s.spec_token_ids for s in decoding) and len(decoding) > 1:
            lens = {len(s.spec_token_ids) for s in decoding}
            if any(s.num_real_drafts < len(s.spec_token_ids) for s in decoding) and len(lens) == 1:
                padded_steps["n"] += 1
        return execute(output)

    engine.runner.execute = watch
    assert engine.generate_batch(prompts, params) == expected
    st = engine.stats
    assert padded_steps["n"] > 0
    assert st.spec_drafted_total == proposed["n"] > 0
    assert st.spec_accepted_total <= st.spec_drafted_total


def test_pad_width_follows_the_captured_verification_graphs(tiny_checkpoint):
    """With verification graphs (GPU path) padding targets the smallest captured query length that holds the
    longest proposal and the batch; none fits -> no padding (a padded eager pass only adds tokens)."""
    from types import SimpleNamespace

    engine = _engine(tiny_checkpoint, "ngram", 7)
    reqs = [engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20)) for i in range(3)]
    rooms = {r.request_id: 7 for r in reqs}
    reqs[0].spec_token_ids = [5, 6]
    assert engine._pad_width(rooms) == 0  # auto: no graphs on the CPU
    engine.runner.verify_graphs = {4: SimpleNamespace(max_batch=8), 8: SimpleNamespace(max_batch=2)}
    assert engine._pad_width(rooms) == 3  # q = 4 holds 2 drafts + 1 and 3 sequences
    reqs[0].spec_token_ids = [5, 6, 7, 8]
    assert engine._pad_width(rooms) == 0  # q = 8 would hold the drafts but only 2 sequences
    # one sequence pads to a captured length too: only those replay a graph
    assert engine._pad_width({reqs[0].request_id: 7}) == 7
    assert engine._verification_graphed({reqs[0].request_id: 7}, 7) == (8, True)
    assert engine._verification_graphed(rooms, 7) == (8, False)  # 3 sequences: over q = 8's max_batch
    assert engine._verification_graphed({reqs[0].request_id: 7, reqs[1].request_id: 2}, 7) == (8, False)  # ragged
    reqs[0].spec_token_ids = [5, 6]
    assert engine._verification_graphed(rooms, 3) == (4, True)
    reqs[0].spec_token_ids = []
    assert engine._pad_width(rooms) == 0  # nothing proposed
    engine.runner.verify_graphs = {}
    reqs[0].spec_token_ids = [5, 6]
    assert engine._pad_width({reqs[0].request_id: 7}) == 0  # no graphs: one sequence is never padded



def _costed_engine(ckpt, monkeypatch, verify_ms, retry=10**9):
    """An engine with cost-aware speculation and fixed step costs (1 ms a decode step, verify_ms a
    verification step, whatever the batch): the policy's inputs without the CPU's timing noise."""
    monkeypatch.setattr(llm_engine_mod, "ADAPTIVE_RETRY_STEPS", retry)
    engine = LLMEngine.from_checkpoint(ckpt, config=EngineConfig(
        max_num_seqs=8, spec=SpecConfig("ngram", 3, adaptive=True)))
    monkeypatch.setattr(engine, "_record_step_cost", lambda sched, ms: None)
    engine.step_costs.update({(n, q, False): 1.0 if q == 1 else verify_ms for n in range(1, 9) for q in range(1, 5)})
    return engine


def test_cost_aware_speculation_skips_costly_steps_losslessly(tiny_checkpoint, prompts, reference, monkeypatch):
    """SpecConfig.adaptive: verification that costs more than the drafts can add is skipped (the drafts are
    dropped, the step decodes plainly); cheap verification goes ahead; after ADAPTIVE_RETRY_STEPS skips in a
    row it verifies anyway. The output equals plain decoding in every case."""
    params, expected = reference
    drafter = oracle_drafter(prompts, expected)  # every proposal right: 1/2 expected per draft at first
    monkeypatch.setattr(llm_engine_mod, "ngram_propose", drafter)
    costly = _costed_engine(tiny_checkpoint, monkeypatch, verify_ms=100.0)
    assert costly.generate_batch(prompts, params) == expected
    assert costly.stats.spec_steps_total == 0 and costly.stats.spec_skipped_steps_total > 0
    cheap = _costed_engine(tiny_checkpoint, monkeypatch, verify_ms=1.0)
    assert cheap.generate_batch(prompts, params) == expected
    assert cheap.stats.spec_steps_total > 0 and cheap.stats.spec_skipped_steps_total == 0
    retrying = _costed_engine(tiny_checkpoint, monkeypatch, verify_ms=100.0, retry=3)
    assert retrying.generate_batch(prompts, params) == expected
    assert retrying.stats.spec_steps_total > 0 and retrying.stats.spec_skipped_steps_total > 0


def test_cost_aware_speculation_weighs_expected_tokens(tiny_checkpoint):
    """The decision: with requests waiting, (n + expected accepted drafts) tokens per verification step's cost
    against n tokens per decode step's; with none waiting, the mean time per output token over the running
    sequences (a sequence without drafts of its own gains nothing). Expected acceptance per position is
    (accepted + 1) / (drafted + 2); unmeasured shapes are tried; decode and verification steps are measured,
    prompt steps are not."""
    engine = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=8, spec=SpecConfig("ngram", 3, adaptive=True)))
    st = engine.stats
    assert st.expected_accepted(3) == 1.5
    st.record_position(0, True), st.record_position(0, True), st.record_position(1, False)
    assert st.expected_accepted(2) == (2 + 1) / (2 + 2) + (0 + 1) / (1 + 2)
    reqs = [engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20)) for i in range(2)]
    rooms = {r.request_id: 3 for r in reqs}
    reqs[0].spec_token_ids = [5, 6, 7]
    assert engine._worth_speculating(rooms)  # nothing measured yet: try it
    gain = st.expected_accepted(3)  # ~1.6 tokens on top of 2
    # nothing else waiting: mean time per token, c/(1 + gain) + c against 2 plain steps
    latency_even = 10.0 * 2 / (1 / (1 + gain) + 1)
    engine.step_costs.update({(2, 1, False): 10.0, (2, 4, False): latency_even * 0.99})
    assert engine._worth_speculating(rooms)
    engine.step_costs[(2, 4, False)] = latency_even * 1.01
    assert not engine._worth_speculating(rooms)
    assert engine.spec_policy_log[-1][-2:] == (False, False)  # nothing waiting, not verified
    # a request waiting for a slot: throughput, (2 + gain) tokens against 2
    engine.add_request("queued", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20))
    throughput_even = 10.0 * (2 + gain) / 2
    assert latency_even < throughput_even
    engine.step_costs[(2, 4, False)] = throughput_even * 0.99
    assert engine._worth_speculating(rooms)
    engine.step_costs[(2, 4, False)] = throughput_even * 1.01
    assert not engine._worth_speculating(rooms)
    assert engine.spec_policy_log[-1][-2:] == (True, False)
    reqs[1].params = dataclasses.replace(reqs[1].params, seed=7)
    assert not engine._worth_speculating(rooms)  # a seeded request too: its draws are keyed by position
    engine.step_costs.clear()
    for r in reqs:
        engine.abort_request(r.request_id)
    engine.abort_request("queued")
    engine.generate_batch([[1, 2, 3, 4, 5, 6]] * 2, [SamplingParams(temperature=0, max_tokens=4)] * 2)
    assert (2, 1, False) in engine.step_costs and all(q <= 4 for _, q, _ in engine.step_costs)


def test_unmeasured_eager_verification_next_to_graphs_waits_for_a_retry(tiny_checkpoint, monkeypatch):
    """With verification graphs captured, a verification step no graph runs (a query length not captured, or
    more sequences than the graph takes) is host-bound and may compile kernels for a second: unmeasured, it
    is declined until a retry measures it. A graphed one that is unmeasured is tried at once."""
    from types import SimpleNamespace

    monkeypatch.setattr(llm_engine_mod, "ADAPTIVE_RETRY_STEPS", 3)
    engine = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=8, spec=SpecConfig("ngram", 7, adaptive=True)))
    reqs = [engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20)) for i in range(2)]
    engine.runner.verify_graphs = {8: SimpleNamespace(max_batch=1, sizes=[1])}
    engine.step_costs[(2, 1, False)] = 3.0
    for r in reqs:
        r.spec_token_ids = [5, 6, 7]
    rooms = {r.request_id: 7 for r in reqs}
    assert engine._pad_width(rooms) == 0  # q = 8's graph takes one sequence
    assert [engine._worth_speculating(rooms, 0) for _ in range(3)] == [False, False, True]  # the third: a retry
    assert engine.spec_policy_log[-1][:3] == (2, 4, False)
    engine.step_costs[(1, 1, False)] = 3.0
    one = {reqs[0].request_id: 7}
    assert engine._pad_width(one) == 7 and engine._worth_speculating(one, 7)  # graphed, unmeasured: tried


def test_step_costs_keep_the_minimum_of_the_first_samples(tiny_checkpoint):
    """A first step of a shape that includes a compile must not make it look expensive: the first three
    samples keep their minimum; later ones move the average slowly up and quickly down."""
    from types import SimpleNamespace

    engine = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=8, spec=SpecConfig("ngram", 3, adaptive=True)))
    step = SimpleNamespace(num_new_tokens=1, spec_token_ids=[])
    sched = SimpleNamespace(scheduled=[step, step])
    for ms, want in [(900.0, 900.0), (5.0, 5.0), (6.0, 5.0), (7.0, 0.9 * 5.0 + 0.1 * 7.0)]:
        engine._record_step_cost(sched, ms)
        assert engine.step_costs[(2, 1, False)] == pytest.approx(want)
    engine._record_step_cost(sched, 1.0)
    assert engine.step_costs[(2, 1, False)] == pytest.approx(0.5 * (0.9 * 5.0 + 0.1 * 7.0) + 0.5)


def test_seeded_speculative_sampling_does_not_depend_on_the_batch(tiny_checkpoint, prompts):
    engine = _engine(tiny_checkpoint, "mtp", 3)
    mine = SamplingParams(temperature=0.8, top_k=50, seed=11, max_tokens=16, ignore_eos=True)
    before = engine.stats.spec_drafted_total
    (alone,) = engine.generate_batch([prompts[4]], [mine])
    mixed = engine.generate_batch(
        [prompts[0], prompts[4], prompts[2]],
        [SamplingParams(temperature=1.0, max_tokens=10), mine,
         SamplingParams(temperature=0.5, top_p=0.7, seed=1, max_tokens=20, ignore_eos=True)])
    assert mixed[1] == alone and len(alone) == 16
    assert engine.stats.spec_drafted_total > before  # drafts were verified


def test_speculation_under_preemption_abort_and_max_length(tiny_checkpoint, prompts, reference, monkeypatch):
    params, expected = reference
    eng = _engine(tiny_checkpoint, "mtp", 2)
    block = kv_bytes_per_block(eng.model.cfg, 4, torch.float32, extra_layers=1)
    slot = gdn_bytes_per_slot(eng.model.cfg, torch.float32)
    small = _engine(tiny_checkpoint, "mtp", 2, block_size=4, cache_memory_bytes=10 * slot + 26 * block,
                    prefix_cache_slots=2)
    assert small.generate_batch(prompts, params) == expected
    assert small.stats.preemptions_total > 0
    assert small.cache_manager.num_free_blocks == small.cache_manager.config.num_blocks
    # abort mid-speculation frees everything
    gen = small.generate(prompts[2], SamplingParams(temperature=0, max_tokens=30))
    next(gen), next(gen)
    gen.close()
    assert not small.has_unfinished_requests() and not small.cache_manager.block_tables
    # drafts never push past max_tokens
    out = small.generate_batch([prompts[4]], [SamplingParams(temperature=0, max_tokens=2)])
    assert len(out[0]) == 2


@pytest.mark.parametrize("method,k", [("ngram", 3), ("mtp", 2)])
def test_seeded_speculative_sampling_equals_plain_seeded_sampling(tiny_checkpoint, prompts, method, k, monkeypatch):
    """Seeded draws keyed by sequence position: the speculative engine's tokens are the plain engine's, batched,
    under preemption, and with a step budget too small for every request's drafts (up to near-ties of the
    verification pass's rounding, which these prompts do not meet)."""
    params = [SamplingParams(temperature=0.9, top_k=40, seed=21, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=22, max_tokens=18, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=23, max_tokens=16, ignore_eos=True,
                             repetition_penalty=1.3)]  # processed logits: the single-request verification
    chosen = [prompts[0], prompts[3], prompts[1]]
    plain = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=8))
    expected = [plain.generate_batch([pr], [sp])[0] for pr, sp in zip(chosen, params)]
    assert [len(o) for o in expected] == [20, 18, 16]
    if method == "ngram":  # drafts right for 0..k tokens, then wrong: every acceptance length
        monkeypatch.setattr(llm_engine_mod, "ngram_propose", oracle_drafter(chosen, expected))
    engine = _engine(tiny_checkpoint, method, k)
    assert engine.generate_batch(chosen, params) == expected
    assert engine.stats.spec_drafted_total > 0
    if method == "ngram":
        assert engine.stats.spec_accepted_total > 0
    block = kv_bytes_per_block(engine.model.cfg, 4, torch.float32, extra_layers=1)
    slot = gdn_bytes_per_slot(engine.model.cfg, torch.float32)
    small = _engine(tiny_checkpoint, method, k, block_size=4, cache_memory_bytes=10 * slot + 9 * block,
                    prefix_cache_slots=2)
    assert small.generate_batch(chosen, params) == expected
    assert small.stats.preemptions_total > 0
    tight = _engine(tiny_checkpoint, method, k, max_num_batched_tokens=5)  # drafts cut to the budget left
    assert tight.generate_batch(chosen, params) == expected


def test_bad_spec_config_and_missing_mtp_weights(tiny_checkpoint, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match="must be one of"):
        SpecConfig("eagle", 2)
    with pytest.raises(ValueError, match=">= 1"):
        SpecConfig("mtp", 0)
    ckpt = tmp_path / "no-mtp"
    shutil.copytree(tiny_checkpoint, ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        t = load_file(ckpt / shard)
        save_file({k: v for k, v in t.items() if not k.startswith("mtp.")}, ckpt / shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no mtp"):
        _engine(ckpt, "mtp", 2)
    assert _engine(ckpt, "ngram", 2).generate_batch([[1, 2, 3]], [SamplingParams(temperature=0, max_tokens=2)])


def test_bad_mtp_graphs_switch_fails_the_engine_start(tiny_checkpoint, monkeypatch):
    """VIBEQWEN_MTP_GRAPHS takes 0 or 1; another value stops the engine's start with the variable named, not a
    later step. On the CPU path the switch captures nothing (the graphs are a GPU path's)."""
    monkeypatch.setenv("VIBEQWEN_MTP_GRAPHS", "yes")
    with pytest.raises(ValueError, match="VIBEQWEN_MTP_GRAPHS must be 0 or 1"):
        _engine(tiny_checkpoint, "mtp", 2)
    monkeypatch.setenv("VIBEQWEN_MTP_GRAPHS", "1")
    engine = _engine(tiny_checkpoint, "mtp", 2)
    assert engine.runner.mtp_graphs is None
    assert engine.generate_batch([[1, 2, 3]], [SamplingParams(temperature=0, max_tokens=3)])


def test_mtp_draft_graphs_refuse_what_they_cannot_run(tiny_checkpoint):
    from vibeqwen.model.mtp_graphs import MTPDraftGraphs

    mtp = _engine(tiny_checkpoint, "mtp", 2)
    plain = _engine(tiny_checkpoint, "off", 2)
    with pytest.raises(ValueError, match="k >= 1"):
        MTPDraftGraphs(mtp.model, mtp.runner.cache, 8, [1], 0, capture=False)
    with pytest.raises(ValueError, match="MTP head"):
        MTPDraftGraphs(plain.model, plain.runner.cache, 8, [1], 2, capture=False)
    with pytest.raises(ValueError, match="GPU path"):  # the reference path reads host lists the graphs freeze
        MTPDraftGraphs(mtp.model, mtp.runner.cache, 8, [1], 2, capture=False)
