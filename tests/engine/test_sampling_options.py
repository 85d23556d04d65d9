"""Logit processing (bias, min_tokens, penalties, min_p) and logprobs, alone and through the engine."""

from __future__ import annotations

import math

import pytest
import torch

import vibeqwen.engine.llm_engine as llm_engine_mod
from oracle_drafts import oracle_drafter
from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.engine.sampler import process_logits, target_probs
from vibeqwen.engine.spec import SpecConfig
from vibeqwen.sampling import SamplingParams

EOS = 248046


def test_process_logits_bias_min_tokens_and_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0])
    p = SamplingParams(logit_bias={3: 10.0}, min_tokens=2, repetition_penalty=2.0)
    out = process_logits(logits, p, prompt_ids=[0], output_ids=[1], stop_ids=frozenset({4}))
    assert out[3] == 10.5 and out[4] == -math.inf  # bias; stop id masked before min_tokens
    assert out[0] == 1.0 and out[1] == -4.0  # seen: positive divided, negative multiplied
    assert out[2] == 1.0 and torch.equal(logits, torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0]))  # input untouched
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, p, prompt_ids=[2], output_ids=[0, 0, 1], stop_ids=frozenset())
    assert torch.allclose(out, torch.tensor([2 - 0.5 - 0.5, -2 - 0.5 - 0.25, 1.0, 0.5, 3.0]))
    out = process_logits(logits, SamplingParams(min_tokens=2), [], [7, 7], frozenset({4}))
    assert out[4] == 3.0  # min_tokens reached: no mask


def test_whole_vocabulary_logit_bias_is_added_once_per_token():
    """A bias on every id (248k keys; the break-it review's request stalled the engine ~1 s a step when it was added
    key by key) gives each logit exactly logit + bias in float32, fresh random values."""
    gen = torch.Generator().manual_seed(11)
    vocab = 248_320
    logits = torch.randn(vocab, generator=gen) * 4
    bias = (torch.rand(vocab, generator=gen) * 200 - 100).tolist()
    p = SamplingParams(logit_bias=dict(enumerate(bias)))
    out = process_logits(logits, p, [], [], frozenset())
    assert torch.equal(out, logits + torch.tensor(bias, dtype=torch.float32))
    p = SamplingParams(logit_bias={7: -3.5, 2: 1.25})
    out = process_logits(logits, p, [], [], frozenset())
    want = logits.clone()
    want[7] -= 3.5
    want[2] += 1.25
    assert torch.equal(out, want)


def test_indexes_follow_assignment_and_are_shared_by_clones():
    p = SamplingParams(stop=["ab"], logit_bias={3: 1.0})
    assert p.stop_strings.strings == ["ab"] and p.logit_bias_tensors[0].tolist() == [3]
    p.stop = ["cd", "cd", ""]
    p.logit_bias = {5: -2.0}
    assert p.stop_strings.strings == ["cd"] and p.logit_bias_tensors[0].tolist() == [5]
    c = p.clone()
    assert c.stop_strings is p.stop_strings and c.logit_bias_tensors is p.logit_bias_tensors
    other = SamplingParams(stop=["cd", "cd", ""], logit_bias={5: -2.0}, max_tokens=3)
    other.share_indexes(p)
    assert other.stop_strings is p.stop_strings and other.logit_bias_tensors is p.logit_bias_tensors
    differs = SamplingParams(stop=["zz"], logit_bias={5: -2.0})
    differs.share_indexes(p)
    assert differs.stop_strings.strings == ["zz"] and differs.logit_bias_tensors is p.logit_bias_tensors


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))
    assert probs[3] == 0 and probs[2] > 0 and torch.isclose(probs.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=2e-5),  # just above the greedy threshold: logits / T stay finite
    SamplingParams(temperature=1.0, top_p=1e-46),  # rounds to 0 in float32: the most likely id is kept
    SamplingParams(temperature=1.0, top_p=1e-300),
    SamplingParams(temperature=1e30),
])
def test_extreme_valid_params_give_a_distribution(params):
    params.validate()
    logits = torch.randn(64) * 20
    probs = target_probs(logits, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all() and torch.isclose(probs.sum(), torch.tensor(1.0))
    if params.top_p < 1:
        assert probs[logits.argmax()] == 1.0
    torch.multinomial(probs, 1)


def test_overflowing_logits_still_sample():
    # a tiny repetition_penalty divides seen positive logits by ~0: +inf; NaN rows fall back to their argmax
    p = SamplingParams(temperature=0.7, repetition_penalty=1e-300)
    out = process_logits(torch.tensor([1.0, 2.0, -1.0, 0.5]), p, prompt_ids=[1], output_ids=[], stop_ids=frozenset())
    assert out[1] == math.inf
    probs = target_probs(out, p)
    assert probs[1] == 1.0 and torch.isfinite(probs).all()
    probs = target_probs(torch.full((8,), float("nan")), SamplingParams(temperature=1.0))
    assert torch.isfinite(probs).all() and probs.sum() == 1.0
    probs = target_probs(torch.tensor([-math.inf, 3.0, -math.inf]), SamplingParams(temperature=1.0, top_k=2))
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_tiny_temperature_is_greedy_and_non_finite_values_are_rejected():
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    for bad in (dict(temperature=math.nan), dict(top_p=math.nan), dict(repetition_penalty=math.inf),
                dict(presence_penalty=math.nan), dict(logit_bias={3: math.nan})):
        with pytest.raises(ValueError, match="finite"):
            SamplingParams(**bad).validate()


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=8))


def test_logit_bias_and_min_tokens_through_the_engine(engine):
    forced = 1234
    out = engine.generate_batch([[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=4, logit_bias={forced: 100})])
    assert out == [[forced] * 4]
    eos_bias = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, logit_bias={EOS: 100})
    (toks,) = engine.generate_batch([[5, 6, 7]], [eos_bias])
    assert len(toks) == 4 and EOS not in toks[:3] and toks[3] == EOS


def test_a_bias_on_every_real_token_never_reaches_the_padding_rows(engine):
    """The LM head has more rows (248,320) than the tokenizer ids (248,077): with every real token biased down, the
    padding rows (text nothing decodes to) would win; rows with a logit_bias never sample them."""
    n_tok = engine.tokenizer.vocab_size
    assert engine.runner.token_vocab == n_tok < engine.model.cfg.vocab_size
    ban = dict.fromkeys(range(n_tok), -100.0)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=6, seed=3, logit_bias=ban)
        (toks,) = engine.generate_batch([[5, 6, 7]], [params])
        assert toks and all(t < n_tok for t in toks), toks
    # the real tokens' order is unchanged by a uniform bias: greedy picks what it picks without one
    (plain,) = engine.generate_batch([[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=1)])
    (biased,) = engine.generate_batch([[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=1, logit_bias=ban)])
    assert plain[0] >= n_tok or biased == plain


def test_logprobs_match_the_model_and_survive_chunking_and_speculation(tiny_checkpoint, engine):
    prompt = list(range(300, 340))
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    rid = "lp"
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    toks = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in o.logprobs]
    assert len(lps) == 5 and outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == len(prompt) - 1
    for tok, (lp, alts) in zip(toks, lps):
        assert len(alts) == 3 and alts[0][0] == tok and math.isclose(lp, alts[0][1])  # greedy: top-1
        assert lp <= 0
    # the model's own log_softmax agrees (one long prefill of prompt + outputs)
    from seqrun_engine import full_logits  # noqa: E402

    logits = full_logits(engine.model, prompt + toks)
    ref = torch.log_softmax(logits, -1)
    for i, (lp, _) in enumerate(outs[0].prompt_logprobs):
        assert math.isclose(lp, float(ref[i, prompt[i + 1]]), abs_tol=1e-4)
    for i, (lp, _) in enumerate(lps):
        assert math.isclose(lp, float(ref[len(prompt) - 1 + i, toks[i]]), abs_tol=1e-4)
    # chunked prefill and MTP speculation give the same numbers
    other = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=16, spec=SpecConfig("mtp", 2)))
    other.add_request(rid, prompt, params)
    outs2 = []
    while other.has_unfinished_requests():
        outs2 += other.step()
    assert [t for o in outs2 for t in o.new_token_ids] == toks
    lps2 = [lp for o in outs2 for lp in o.logprobs]
    assert all(math.isclose(a[0], b[0], abs_tol=1e-4) for a, b in zip(lps, lps2))
    assert len(outs2[0].prompt_logprobs) == len(prompt) - 1
    assert all(math.isclose(a[0], b[0], abs_tol=1e-4) for a, b in zip(outs[0].prompt_logprobs, outs2[0].prompt_logprobs))


def test_penalties_stay_exact_under_speculation(tiny_checkpoint, engine, monkeypatch):
    prompts = [[9, 9, 9, 4, 4], list(range(50, 70))]
    params = [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.7,
                             frequency_penalty=0.4)] * 2
    expected = engine.generate_batch(prompts, params)
    monkeypatch.setattr(llm_engine_mod, "ngram_propose", oracle_drafter(prompts, expected))
    spec = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=8, spec=SpecConfig("ngram", 3)))
    assert spec.generate_batch(prompts, params) == expected
    assert spec.stats.spec_accepted_total > 0


def test_invalid_sampling_values_are_refused():
    for bad in (dict(min_p=1.5), dict(presence_penalty=3), dict(repetition_penalty=0), dict(logprobs=21),
                dict(min_tokens=20, max_tokens=10), dict(logit_bias={1: 101})):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate()


class _OnlyEvenTokensThenEOS:
    """A toy constraint: even ids only, and after 3 tokens only EOS."""

    def __init__(self):
        self.seen = []

    def allowed(self, vocab_size):
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        if len(self.seen) >= 3:
            mask[EOS] = True
        else:
            mask[0::2] = True
        return mask

    def accept(self, token_id):
        self.seen.append(token_id)


def test_token_constraint_masks_every_step_and_sees_every_token(tiny_checkpoint):
    eng = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=4, spec=SpecConfig("mtp", 2)))
    c = _OnlyEvenTokensThenEOS()
    (toks,) = eng.generate_batch([[3, 5, 7, 9]], [SamplingParams(temperature=0.8, seed=3, max_tokens=10, constraint=c)])
    assert c.seen == toks and len(toks) == 4 and all(t % 2 == 0 for t in toks[:3]) and toks[3] == EOS


def test_min_tokens_never_masks_the_only_allowed_token(tiny_checkpoint):
    """A constraint that allows only EOS next, with min_tokens not yet reached: EOS stays sampleable."""

    class OnlyEOS:
        def allowed(self, vocab_size):
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[EOS] = True
            return mask

        def accept(self, token_id):
            pass

    eng = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=2))
    (toks,) = eng.generate_batch([[1, 2]], [SamplingParams(temperature=0, max_tokens=3, min_tokens=2,
                                                          constraint=OnlyEOS())])
    assert toks[0] == EOS
    with pytest.raises(ValueError, match="logit_bias"):
        eng.add_request("x", [1], SamplingParams(logit_bias={10**7: 1.0}))
