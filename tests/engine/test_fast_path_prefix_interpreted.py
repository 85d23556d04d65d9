"""Prefix caching through the GPU path's code (Triton kernels under the interpreter, on the CPU): requests that
start on a cached prefix (shared KV blocks read by the paged attention kernels, a copied partial block, a GDN state
copied into the slot the chunked GDN kernels continue from) give the tokens of requests computed from scratch."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from interpreted import run_interpreted

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton's interpreter"),
              pytest.mark.slow]

SCRIPT = textwrap.dedent('''
    import sys, torch
    from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
    from vibeqwen.sampling import SamplingParams

    def make(on, block_size):
        eng = LLMEngine.from_checkpoint(sys.argv[1], config=EngineConfig(
            max_num_seqs=4, max_num_batched_tokens=32, block_size=block_size, dtype="float32", device="cpu",
            enable_prefix_caching=on))
        assert eng.model.fast
        return eng

    def run(eng, prompts, max_tokens=2):
        reqs = [eng.add_request(f"r{len(eng._requests)}-{i}-{id(p)}", p,
                                SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
                for i, p in enumerate(prompts)]
        while eng.has_unfinished_requests():
            eng.step()
        return [r.output_token_ids for r in reqs], [r.num_cached_tokens for r in reqs]

    g = torch.Generator().manual_seed(0)
    def toks(n):
        return torch.randint(0, 512, (n,), generator=g).tolist()

    # 4-token blocks: hits end inside a block (a copied partial block) as often as not
    on, off = make(True, 4), make(False, 4)
    first = toks(13)
    (a,), _ = run(on, [first])
    system = toks(9)
    run(on, [system + toks(2)])
    run(on, [system + toks(3)])  # shares 2 blocks with the last prompt: its prefill stops at 8 for a snapshot
    # one batch: a conversation's next turn (the first prompt and its reply, less its last token, are cached) and
    # two users of the system prompt (both start at 8, on the same blocks)
    batch = [first + a + toks(3), system + toks(4), system + toks(5)]
    outs, cached = run(on, batch)
    assert cached == [13 + 2 - 1, 8, 8], cached
    expected, _ = run(off, batch)
    assert outs == expected, (outs, expected)
    print("hits", on.stats.prefix_cache_hits_total, "tokens", outs)
''')


def test_prefix_cache_on_fast_path_equals_uncached(tmp_path):
    print(run_interpreted(SCRIPT, tmp_path))
