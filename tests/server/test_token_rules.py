"""vLLM's `allowed_token_ids` and `bad_words` (`TokenRules`): the masks they give, and what the real engine on the
tiny checkpoint samples under them."""

from __future__ import annotations

import pytest

from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.sampling import SamplingParams
from vibeqwen.server.token_rules import TokenRules


def test_masks_follow_the_output():
    rules = TokenRules(allowed_ids=[1, 2, 3, 4], bad_words=[[9], [2, 3], [1, 2, 4]])
    mask = rules.allowed(10)
    assert mask.tolist() == [False, True, True, True, True, False, False, False, False, False]
    rules.accept(2)  # "2 3" would complete
    assert not rules.allowed(10)[3] and rules.allowed(10)[4]
    rules.accept(1)
    rules.accept(2)  # "1 2 4" and "2 3" would complete
    m = rules.allowed(10)
    assert not m[4] and not m[3] and m[1] and m[2]
    free = TokenRules(bad_words=[[5, 6]])
    assert free.allowed(10) is None  # nothing to mask yet
    free.accept(5)
    assert free.allowed(10).tolist() == [True] * 6 + [False] + [True] * 3
    # every allowed id would complete a bad word: the allowed ids stay
    cornered = TokenRules(allowed_ids=[1, 2], bad_words=[[1], [2]])
    assert cornered.allowed(4).tolist() == [False, True, True, False]
    many = TokenRules(bad_words=[[i, i + 1, i + 2] for i in range(0, 30000, 3)])
    many.accept(3)
    many.accept(4)
    assert many.allowed(30010).sum() == 30009 and not many.allowed(30010)[5]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=4))


PROMPT = list(range(400, 420))


def test_the_engine_samples_only_allowed_ids(engine):
    allowed = [7, 11, 13, 900]
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=s, ignore_eos=True,
                             constraint=TokenRules(allowed_ids=allowed)) for s in range(3)]
    for tokens in engine.generate_batch([PROMPT] * 3, params):
        assert tokens and set(tokens) <= set(allowed), tokens


def test_the_engine_never_completes_a_bad_word(engine):
    (free,) = engine.generate_batch([PROMPT], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)])
    word = free[4:6]  # a pair the greedy reply writes
    (ruled,) = engine.generate_batch([PROMPT], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                               constraint=TokenRules(bad_words=[word]))])
    first = next(i for i in range(len(free) - 1) if free[i : i + 2] == word)
    assert ruled[: first + 1] == free[: first + 1]  # the same reply up to the word's last token
    pairs = list(zip(ruled, ruled[1:]))
    assert tuple(word) not in pairs, (word, ruled)
    one = free[2]
    (ruled,) = engine.generate_batch([PROMPT], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                               constraint=TokenRules(bad_words=[[one]]))])
    assert one not in ruled and len(ruled) == 16
