"""Speculative decoding through the GPU path's code (Triton kernels under the interpreter, on the CPU):
verification keeps the GDN state after every token (the recurrent kernel's per-token states), rejected drafts
roll back, a batch that mixes verification with a long prefill chunk runs as two passes, and one pass mixes
a verifying sequence with a plain decoding one. Greedy output
must equal plain decoding token for token (float32, so the two runs differ only in summation order)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from interpreted import run_interpreted

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton's interpreter"),
              pytest.mark.slow]

SCRIPT = textwrap.dedent('''
    import sys, torch
    from vibeqwen.engine import llm_engine
    from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
    from vibeqwen.engine.spec import SpecConfig
    from vibeqwen.sampling import SamplingParams

    calls = {"mixed": 0}
    from vibeqwen.engine import runner as runner_mod
    split = runner_mod.ModelRunner._forward_split
    def counting(self, ids, batch, *args, **kwargs):
        calls["mixed"] += 1
        return split(self, ids, batch, *args, **kwargs)
    runner_mod.ModelRunner._forward_split = counting
    forward = runner_mod.ModelRunner.forward
    def watching(self, ids, batch):
        # a verifying sequence next to a plain decoding one, no prompt chunk: one pass, mixed query lengths
        if any(batch.keep_states) and not all(batch.keep_states) and max(batch.query_lens) <= 4 \
                and 1 in batch.query_lens:
            calls["verify+decode"] = calls.get("verify+decode", 0) + 1
        return forward(self, ids, batch)
    runner_mod.ModelRunner.forward = watching
    PROMPTS = {"a": [3, 1, 4, 1, 5, 9, 2, 6], "b": list(range(10, 32))}
    plain_out = {}

    def propose(tokens, k, lo, hi):
        # drafts: the next two tokens plain decoding produced, then a wrong one, so verification accepts some,
        # rejects the rest and rolls the GDN state back to the middle of the pass. b drafts every other step,
        # so some passes mix a verifying sequence with a plain decoding one (query lengths 4 and 1)
        for rid, prompt in PROMPTS.items():
            if tokens[: len(prompt)] == prompt:
                done = len(tokens) - len(prompt)
                if rid == "b" and done % 2:
                    return []
                return (plain_out[rid][done : done + 2] + [5, 5, 5])[:k]
        return []

    llm_engine.ngram_propose = propose

    def run(spec, buffers=False):
        eng = LLMEngine.from_checkpoint(sys.argv[1], config=EngineConfig(
            max_num_seqs=4, max_num_batched_tokens=24, dtype="float32", device="cpu", spec=spec))
        assert eng.model.fast
        if buffers:  # the preallocated history the GPU's verification graphs use, too small for some passes
            eng.runner.allocate_history_buffers(6)
        # a decodes long enough to overlap b's decoding (b drafts every other step: mixed passes)
        a = eng.add_request("a", PROMPTS["a"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        eng.step()  # a prefills alone, then decodes (with drafts) while b's long prompt is chunked
        b = eng.add_request("b", PROMPTS["b"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        return [a.output_token_ids, b.output_token_ids], eng.stats

    plain, _ = run(SpecConfig("off", 3))
    plain_out.update(a=plain[0], b=plain[1])
    # history buffers for 6 tokens: the single-sequence verification passes use them, larger ones allocate
    spec, st = run(SpecConfig("ngram", 3), buffers=True)
    assert st.spec_accepted_total > 0 and calls["mixed"] > 0 and calls.get("verify+decode", 0) > 0, (st, calls)
    assert spec == plain, (spec, plain)
    print("drafted", st.spec_drafted_total, "accepted", st.spec_accepted_total, "passes", calls)
''')


def test_spec_on_fast_path_equals_plain(tmp_path):
    print(run_interpreted(SCRIPT, tmp_path))


MTP_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
    from vibeqwen.engine.runner import ModelRunner
    from vibeqwen.engine.spec import SpecConfig
    from vibeqwen.model.mtp_graphs import MTPDraftGraphs
    from vibeqwen.sampling import SamplingParams

    drafted = []
    mtp = ModelRunner._mtp
    def recording(self, *args):
        out = mtp(self, *args)
        drafted.append(dict(out))
        return out
    ModelRunner._mtp = recording

    def run(spec, fast, graphs=None):
        os.environ["VIBEQWEN_FAST"] = "1" if fast else "0"
        drafted.clear()
        eng = LLMEngine.from_checkpoint(sys.argv[1], config=EngineConfig(
            max_num_seqs=4, max_num_batched_tokens=24, dtype="float32", device="cpu", spec=spec))
        assert eng.model.fast == fast and eng.runner.mtp_graphs is None
        used = []
        if graphs:  # the draft graphs' static buffers, padding and filling, run eagerly (no CUDA here)
            r = eng.runner
            # the tiny checkpoint's MTP experts are BF16, as the vendors': its MoE syncs, so no capture is tried
            assert not eng.model.mtp.layer.mlp.fast and r.capture_mtp_graphs(4, 64) is False
            try:
                MTPDraftGraphs(eng.model, r.cache, 8, [1], 3)
                raise AssertionError("captured over a MoE that syncs")
            except ValueError as e:
                assert "not NVFP4" in str(e), e
            r.mtp_graphs = MTPDraftGraphs(eng.model, r.cache, r._table_width(eng.max_model_len), graphs, 3,
                                          capture=False)
            run_graph = r.mtp_graphs.run
            def counting(hidden, first, tables, slots):
                used.append(len(first))
                return run_graph(hidden, first, tables, slots)
            r.mtp_graphs.run = counting
        # staggered prefills (24-token chunks): draft passes of 1, 2 and 3 sequences
        ps = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(10, 32)), list(range(40, 60))]
        outs = eng.generate_batch(ps, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 3)
        return outs, list(drafted), eng.stats, used

    plain, _, _, _ = run(SpecConfig("off", 3), fast=True)
    fast, fast_drafts, st, _ = run(SpecConfig("mtp", 3, adaptive=False), fast=True)
    assert fast == plain, (fast, plain)
    assert st.spec_drafted_total > 0 and fast_drafts and all(len(d) == 3 for step in fast_drafts
                                                            for d in step.values()), fast_drafts
    assert {len(step) for step in fast_drafts} >= {1, 2, 3}, fast_drafts
    # the draft graphs' buffers (sizes 2 and 4: every batch of 1 or 3 padded with dummy rows) draft the same
    graphed, graphed_drafts, _, used = run(SpecConfig("mtp", 3, adaptive=False), fast=True, graphs=[2, 4])
    assert graphed == plain and graphed_drafts == fast_drafts, (graphed_drafts, fast_drafts)
    assert {1, 2, 3} <= set(used), used
    ref, ref_drafts, _, _ = run(SpecConfig("mtp", 3, adaptive=False), fast=False)
    assert ref == plain, (ref, plain)
    # the GPU path's MTP head (fused norms, positions from the batch) drafts what the reference head drafts
    assert fast_drafts == ref_drafts, (fast_drafts, ref_drafts)
    print("mtp steps", len(fast_drafts), "drafted", st.spec_drafted_total, "accepted", st.spec_accepted_total,
          "graph batches", used)
''')


def test_mtp_on_fast_path_drafts_as_the_reference(tmp_path):
    print(run_interpreted(MTP_SCRIPT, tmp_path))
