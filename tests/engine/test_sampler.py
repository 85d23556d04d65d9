"""The batched sampler (`sample_rows`, `candidate_probs`): the distribution against a dense reference, the draws'
frequencies against it, and seeded rows that do not depend on the rest of their batch."""

from __future__ import annotations

import math

import pytest
import torch

from vibeqwen.engine.sampler import (
    candidate_probs,
    make_generator,
    monotone_bits,
    order_keys,
    race,
    sample,
    sample_rows,
    target_probs,
)
from vibeqwen.sampling import SamplingParams

V = 300


def dense_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The target distribution written the plain way, over the whole vocabulary (logits without ties)."""
    x = logits.double() / p.temperature
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], -math.inf)
    probs = torch.softmax(x, -1)
    probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    order = torch.argsort(probs, descending=True)
    mass = 0.0
    for i in order.tolist():
        if mass >= p.top_p:
            probs[i] = 0.0
        mass += float(probs[i])
    return (probs / probs.sum()).float()


PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=20),
    SamplingParams(temperature=0.6, top_p=0.95, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=5, min_p=0.1, top_p=0.8),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_candidate_probs_match_the_dense_reference(params):
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    probs, ids = candidate_probs(logits, [params] * 3)
    for r in range(3):
        dense = target_probs(logits[r], params)
        torch.testing.assert_close(dense, dense_reference(logits[r], params), atol=1e-6, rtol=1e-5)
        got = probs[r] if ids is None else torch.zeros(V).scatter_(0, ids[r], probs[r])
        torch.testing.assert_close(got, dense)


def test_a_batch_of_mixed_params_gives_each_row_its_own_distribution():
    torch.manual_seed(1)
    logits = torch.randn(len(PARAMS), V) * 3
    probs, ids = candidate_probs(logits, PARAMS)
    for r, p in enumerate(PARAMS):
        got = torch.zeros(V).scatter_(0, ids[r], probs[r])
        torch.testing.assert_close(got, target_probs(logits[r], p))


def test_a_row_without_top_p_is_not_cut_next_to_one_with_it():
    """Rounding: a dominant id's float32 cumulative sum is 1.0 before the tail's columns, so a top_p of 1 compared
    with `>=` would drop them, but only in batches where another row has a top_p (and so cuts at all)."""
    logits = torch.full((2, V), -30.0)
    logits[:, 0], logits[:, 1:5] = 0.0, -25.0
    p = SamplingParams(temperature=1.0, top_k=5)
    alone, _ = candidate_probs(logits[:1], [p])
    batched, _ = candidate_probs(logits, [p, SamplingParams(temperature=1.0, top_k=5, top_p=0.5)])
    assert (alone[0, 1:] > 0).all() and torch.equal(batched[0], alone[0])
    assert (batched[1, 1:] == 0).all()


@pytest.mark.parametrize("others", [[SamplingParams(temperature=1.0)], [SamplingParams(temperature=0.5, min_p=0.1)],
                                    [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=2.0)]])
def test_a_row_keeps_its_truncation_next_to_rows_without_one(others):
    torch.manual_seed(4)
    p = SamplingParams(temperature=0.9, top_k=7)
    logits = torch.randn(1 + len(others), V) * 3
    probs, ids = candidate_probs(logits, [p, *others])
    rows = [probs[r] if ids is None else torch.zeros(V).scatter_(0, ids[r], probs[r]) for r in range(len(probs))]
    for r, q in enumerate([p, *others]):
        torch.testing.assert_close(rows[r], dense_reference(logits[r], q), atol=1e-6, rtol=1e-5)


def test_draws_follow_the_distribution():
    torch.manual_seed(2)
    row = torch.randn(V) * 2
    p = SamplingParams(temperature=0.8, top_k=12, top_p=0.9)
    n = 20000
    tokens = sample_rows(row.expand(n, V).clone(), [p] * n, [None] * n)
    freq = torch.bincount(tokens, minlength=V).float() / n
    target = target_probs(row, p)
    assert (freq[target == 0] == 0).all()  # never an id outside the candidates
    # within 5 standard errors of every probability
    assert ((freq - target).abs() <= 5 * (target * (1 - target) / n).sqrt() + 1e-4).all(), (freq, target)


def test_seeded_rows_do_not_depend_on_their_batch():
    torch.manual_seed(3)
    logits = torch.randn(4, V) * 2
    seeded = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=7)
    alone = sample(logits[0], seeded, make_generator(seeded))
    gen = make_generator(seeded)
    first = [int(sample_rows(logits[:1], [seeded], [gen])[0]) for _ in range(5)]
    # the same row among others: greedy, unseeded, another seed with a larger top_k and no top_k at all
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.3),
              SamplingParams(temperature=2.0, top_k=200, seed=1)]
    gens = [make_generator(seeded)] + [None, None, make_generator(others[2])]
    mixed = [int(sample_rows(logits, [seeded, *others], gens)[0]) for _ in range(5)]
    assert mixed == first and alone == first[0]
    assert len(set(first)) > 1  # the generator advances between steps


def test_greedy_rows_and_dead_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [float("nan")] * 4, [-math.inf, 3.0, -math.inf, -math.inf]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=2)]
    assert sample_rows(logits, params, [None] * 3).tolist()[0] == 1  # lowest id among tied maxima
    for _ in range(20):
        out = sample_rows(logits, params, [None] * 3).tolist()
        assert out[1] == int(torch.argmax(logits[1])) and out[2] == 1


def test_equal_logits_are_cut_the_same_way_in_any_batch():
    # five ids tie at the top (a bf16 head gives such ties): top_k 2 keeps the two lowest ids, whatever the batch
    logits = torch.full((1, V), -5.0)
    tied = [7, 30, 100, 150, 200]
    logits[0, tied] = 3.0
    mine = SamplingParams(temperature=1.0, top_k=2, seed=5)
    for others in ([], [SamplingParams(temperature=1.0, top_k=5)], [SamplingParams(temperature=1.0, top_p=0.9)]):
        batch = torch.cat([logits, torch.randn(len(others), V)])
        probs, ids = candidate_probs(batch, [mine, *others])
        kept = {int(i) for i, p in zip(ids[0], probs[0]) if p > 0}
        assert kept == {7, 30}, (others, kept)
    # top_p through equal values: the same ids, in id order
    half = SamplingParams(temperature=1.0, top_p=0.5)
    probs, ids = candidate_probs(logits, [half])
    assert {int(i) for i, p in zip(ids[0], probs[0]) if p > 0} == {7, 30, 100}


@pytest.mark.parametrize("vocab", [V, 248320])
def test_the_stable_32_bit_sort_is_the_order_keys_order(vocab):
    """candidate_probs sorts a whole row by a stable descending sort of `monotone_bits`: the same permutation as a sort
    of the distinct 64-bit `order_keys` (value descending, then id ascending), through ties, -0.0 / +0.0 and
    infinities, at the model's vocabulary too."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(3, vocab, generator=g) * 4).to(torch.bfloat16).float()  # a bf16 head's ties
    x[0, ::7] = 0.0
    x[0, 3::11] = -0.0
    x[1, ::5] = float("-inf")
    x[1, :3] = float("inf")
    x[2] = torch.randint(-2, 3, (vocab,), generator=g).float()  # five values only
    got = torch.sort(monotone_bits(x), dim=-1, descending=True, stable=True).indices
    want = torch.sort(order_keys(x), dim=-1, descending=True).indices
    assert torch.equal(got, want)
    assert bool((monotone_bits(torch.tensor([[-0.0, 0.0]])).diff() > 0).all())


def test_a_dead_row_is_a_one_hot_in_target_probs():
    for p in (SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=1.0)):
        for row in (torch.full((V,), float("-inf")), torch.full((V,), float("nan"))):
            probs = target_probs(row, p)
            assert probs.sum() == 1.0 and probs.max() == 1.0, p


def test_the_race_never_picks_an_id_without_mass():
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.5, 0.0]])
    uniform = torch.tensor([[0.0, 0.0, 0.5, 0.0], [0.3, 0.0, 0.7, 0.0]], dtype=torch.float64)  # U = 0: E = inf
    assert race(probs, uniform).tolist() == [2, 2]


@pytest.mark.slow
def test_unlikely_ids_are_drawn_as_often_as_they_should_be():
    # 1% of the mass over 100k ids, each ~1e-7 of the top id's: float32 uniforms (E >= ~6e-8) would starve them
    vocab = 100_000
    probs = torch.full((vocab,), 0.01 / (vocab - 1))
    probs[0] = 0.99
    row = probs.log()
    p = SamplingParams(temperature=1.0)
    torch.manual_seed(6)
    tail = sum(int((sample_rows(row.expand(200, vocab), [p] * 200, [None] * 200) != 0).sum()) for _ in range(20))
    assert 20 <= tail <= 65, tail  # 4000 draws, 40 expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sampling_and_verification_never_wait_for_the_device():
    """Async scheduling launches step N+1 before reading step N's tokens: sample_rows must not sync the host with the
    device (no .item(), no copy from pageable memory). Checked with CUDA's sync debug mode, for a mixed batch; and
    the draws follow the distribution there too."""
    from vibeqwen.engine.spec import verify_rows

    dev = torch.device("cuda")
    vocab = 248320
    torch.manual_seed(7)
    logits = torch.randn(8, vocab, device=dev) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=1),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8),
              SamplingParams(temperature=0.9, min_p=0.05, seed=2), SamplingParams(temperature=0.6, top_k=20),
              SamplingParams(temperature=1.2, top_k=50, top_p=0.9), SamplingParams(temperature=0)]
    gens = [make_generator(p, dev) if p.seed is not None else None for p in params]
    sample_rows(logits, params, gens)  # first use: allocator and pinned-memory set-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample_rows(logits, params, gens)
        keyed = sample_rows(logits, params, gens, list(range(40, 48)))  # seeded rows reseeded by position
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(keyed[[0, 1, 4, 7]], sample_rows(logits, params, gens, list(range(40, 48)))[[0, 1, 4, 7]])
    assert tokens[0] == logits[0].argmax() and tokens[7] == logits[7].argmax()
    # the same law as on the CPU
    row = torch.randn(V, device=dev) * 2
    p = SamplingParams(temperature=0.8, top_k=12, top_p=0.9)
    n = 20000
    drawn = sample_rows(row.expand(n, V).contiguous(), [p] * n, [None] * n)
    freq = torch.bincount(drawn, minlength=V).float().cpu() / n
    target = target_probs(row.cpu(), p)
    assert ((freq - target).abs() <= 5 * (target * (1 - target) / n).sqrt() + 1e-4).all()
    out = verify_rows(logits[1:4], [[int(logits[1].argmax()), 5]], [params[1]], [gens[1]])
    assert 1 <= len(out[0]) <= 3


def test_position_keyed_cpu_draws_use_all_64_bits_of_the_key():
    """A CPU torch.Generator keeps 32 bits of its seed: keyed rows are drawn by Philox on all 64 bits, so keys that
    share their low 32 bits give different draws (two positions of one long reply would otherwise share them)."""
    from vibeqwen.engine.sampler import draw_uniforms, position_key

    g = torch.Generator()
    key = position_key(7, 3)
    u = draw_uniforms(3, 50, torch.device("cpu"), [g, g, g], [key, key ^ (1 << 40), key])
    assert not torch.equal(u[0], u[1]) and torch.equal(u[0], u[2])
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert position_key(7, 3) != position_key(7, 4) != position_key(8, 3)


def test_distinct_seeds_give_distinct_draws():
    logits = torch.randn(V) * 0.1  # nearly flat: draws follow the generator
    draws = {}
    for seed in (0, 2**63, 5, 2**63 + 5, -1, 2**63 - 1, 2**64 - 1, 2**32):
        p = SamplingParams(temperature=1.0, seed=seed)
        gen = make_generator(p)
        draws[seed] = tuple(sample(logits, p, gen) for _ in range(8))
    assert len(set(draws.values())) == len(draws), draws


@pytest.mark.parametrize("k", [7, 2048, 2049, 248320, 100003])
def test_row_cumsum_is_the_cumulative_sum(k):
    """The chunked scan: within float32 rounding of the exact sums at any row length, padded or not, and never
    stepping down (a top_p cut through it keeps a prefix of the columns)."""
    from vibeqwen.engine.sampler import row_cumsum

    g = torch.Generator().manual_seed(k)
    x = torch.softmax(torch.randn(3, k, generator=g) * 3, -1).sort(-1, descending=True).values
    got, want = row_cumsum(x), x.double().cumsum(-1)
    assert torch.equal(row_cumsum(x[1:2]), got[1:2])  # a row alone: the same sums as in its batch
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5)
    assert bool((got.diff(dim=-1) >= 0).all())


def test_a_top_p_cut_does_not_depend_on_the_batch():
    """At the model's vocabulary a top_p row keeps the same columns, with the same probabilities, alone and among
    other rows, on one CPU thread (as the tests run: with more, torch splits a lone row's softmax and sums across
    threads, and the last bits move)."""
    vocab = 248320
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(8, vocab, generator=g)  # flat rows: cuts deep in the vocabulary, where roundings differ
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.9, 0.99, 0.999, 0.5)] * 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        probs, ids = candidate_probs(logits, params)
        for i in range(8):
            alone, alone_ids = candidate_probs(logits[i:i + 1], params[i:i + 1])
            assert torch.equal(alone_ids[0], ids[i]) and torch.equal(alone[0], probs[i]), i
    finally:
        torch.set_num_threads(threads)
