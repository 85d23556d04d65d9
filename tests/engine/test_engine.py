"""The engine core on the tiny model: batching, chunked prefill and preemption never change the tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
from vibeqwen.engine.request import ContextLengthError
from vibeqwen.model.cache import gdn_bytes_per_slot, kv_bytes_per_block
from vibeqwen.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=16))


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 248044, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _alone(engine, prompt, params):
    return [t for t, _ in engine.generate(prompt, params)]


def test_batched_greedy_equals_alone(engine):
    prompts = _prompts(10)
    params = [SamplingParams(temperature=0, max_tokens=3 + i) for i in range(10)]
    alone = [_alone(engine, p, sp) for p, sp in zip(prompts, params)]
    assert engine.generate_batch(prompts, params) == alone
    assert engine.cache_manager.num_free_slots == 16 and not engine.cache_manager.block_tables


def test_seeded_sampling_is_batch_invariant(engine):
    prompts = _prompts(6, seed=1)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=8, seed=100 + i) for i in range(6)]
    alone = [_alone(engine, p, sp) for p, sp in zip(prompts, params)]
    assert engine.generate_batch(prompts, params) == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=8)
    assert _alone(engine, prompts[0], unseeded) != _alone(engine, prompts[0], unseeded)  # fresh entropy


def test_chunked_prefill_gives_the_same_tokens(tiny_checkpoint, engine):
    small = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=7))
    prompts = _prompts(4, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=5)] * 4
    assert small.generate_batch(prompts, params) == engine.generate_batch(prompts, params)


def test_preemption_keeps_outputs_exact(tiny_checkpoint, engine):
    cfg = engine.model.cfg
    block, slot = kv_bytes_per_block(cfg, 4, torch.float32), gdn_bytes_per_slot(cfg, torch.float32)
    # 4 slots and 20 blocks of 4 tokens = 80 tokens for 4 requests that grow to 36-55 tokens each
    small = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=4, block_size=4, cache_memory_bytes=6 * slot + 20 * block, prefix_cache_slots=2))
    prompts = [p + [11] * 15 for p in _prompts(4, seed=3)]
    params = [SamplingParams(temperature=0, max_tokens=20)] * 4
    expected = [_alone(engine, p, sp) for p, sp in zip(prompts, params)]
    assert small.generate_batch(prompts, params) == expected
    assert small.stats.preemptions_total > 0
    assert small.cache_manager.num_free_blocks == 20 and small.cache_manager.num_free_slots == 4


def test_abort_frees_cache_and_engine_keeps_going(engine):
    gen = engine.generate(_prompts(1, seed=4)[0], SamplingParams(temperature=0, max_tokens=50))
    next(gen), next(gen)
    assert engine.stats.num_running == 1 and engine.stats.gdn_slot_usage > 0
    gen.close()  # aborts
    assert not engine.has_unfinished_requests()
    assert engine.cache_manager.num_free_slots == 16 and not engine.cache_manager.block_tables
    # the gauges follow at once, with no further step (an idle server's /metrics showed the request running)
    assert engine.stats.num_running == 0 and engine.stats.kv_usage == 0 and engine.stats.gdn_slot_usage == 0
    assert engine.stats.finished[-1].finish_reason == "abort"
    assert len(_alone(engine, [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))) == 2


def test_invalid_requests_are_refused_with_the_limit(engine):
    with pytest.raises(ContextLengthError, match="maximum context length is 4096"):
        engine.add_request("x", [1] * 10, SamplingParams(max_tokens=5000))
    with pytest.raises(ValueError, match="outside"):
        engine.add_request("y", [248320], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("z", [], SamplingParams(max_tokens=1))
    engine.add_request("dup", [1], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("dup", [1], SamplingParams(max_tokens=1))
    engine.abort_request("dup")


def test_stats_track_tokens_and_latency(engine):
    before = engine.stats.generation_tokens_total, engine.stats.prompt_tokens_total
    out = engine.generate_batch([[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=4)])
    assert engine.stats.generation_tokens_total - before[0] == len(out[0]) == 4
    assert engine.stats.prompt_tokens_total - before[1] == 3
    last = engine.stats.finished[-1]
    assert last.finish_reason == "length" and last.ttft is not None and last.tpot is not None and last.e2e > 0


def test_max_model_len_leaves_room_for_the_speculative_lookahead(tiny_checkpoint, engine):
    """With a cache smaller than the model's context, the advertised max_model_len is what fits with the k
    lookahead slots the scheduler reserves when speculating: a request of exactly max_model_len tokens is
    accepted and served (it used to pass validation and then be refused by the scheduler)."""
    from vibeqwen.engine.spec import SpecConfig

    cfg = engine.model.cfg
    block, slot = kv_bytes_per_block(cfg, 4, torch.float32, extra_layers=1), gdn_bytes_per_slot(cfg, torch.float32)
    small = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
        max_num_seqs=2, block_size=4, cache_memory_bytes=2 * slot + 10 * block, spec=SpecConfig("mtp", 3)))
    assert small.max_model_len == small.cache_manager.config.num_blocks * 4 - 3
    prompt = _prompts(1, seed=9)[0][:8]
    out = small.generate_batch([prompt], [SamplingParams(temperature=0, max_tokens=small.max_model_len - len(prompt))])
    assert len(out[0]) == small.max_model_len - len(prompt)


def test_cache_budget_over_the_hosts_memory_is_refused(tiny_checkpoint, monkeypatch):
    """A CPU cache budget above the host's available memory is a ValueError naming --cache-memory-gb (allocating
    it got the process killed by the out-of-memory killer, with no message); within it the engine builds."""
    from vibeqwen.engine import llm_engine

    available = llm_engine.available_host_memory()
    assert available is None or available > 0
    monkeypatch.setattr(llm_engine, "available_host_memory", lambda: 64 << 20)
    with pytest.raises(ValueError, match=r"cache budget of 1\.00 GiB \(--cache-memory-gb\) is more than the 0\.06 GiB"):
        LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=2, cache_memory_bytes=1 << 30))
    small = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=2, cache_memory_bytes=8 << 20))
    assert small.cache_manager.config.num_blocks > 0


def test_gpu_cache_budget_counts_memory_only_this_process_could_free_as_free(monkeypatch):
    """On a GPU the budget is gpu_memory_utilization of the card less what is in use, read after unreachable objects
    are collected and the caching allocator's unused blocks released (in that order): a process that ran other GPU
    work before building the engine (tests, a dropped engine in a reference cycle) had a budget of 0 when the
    allocator's cached blocks counted as used. The CUDA calls are stand-ins here (no GPU on the CPU host)."""
    import types

    from vibeqwen.engine import llm_engine

    calls, gib = [], 1 << 30
    monkeypatch.setattr(llm_engine.gc, "collect", lambda: calls.append("collect") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def mem_get_info(device=None):
        calls.append("mem_get_info")
        released = "empty_cache" in calls  # 40 GiB held by the allocator's cache until it is emptied
        return (70 if released else 30) * gib, 80 * gib

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    fake = types.SimpleNamespace(config=EngineConfig(gpu_memory_utilization=0.5),
                                 model=types.SimpleNamespace(device=torch.device("cuda")),
                                 _activation_reserve=lambda: 4 * gib)
    # 0.5 x 80 GiB less the 10 GiB in use less the 4 GiB reserve (without the release: 40 - 50 - 4 -> 0)
    assert llm_engine.LLMEngine._cache_budget(fake) == 26 * gib
    assert calls == ["collect", "empty_cache", "mem_get_info"]


def test_gpu_weights_load_after_the_allocators_cached_blocks_are_released(tiny_checkpoint, monkeypatch):
    """Building an engine on a GPU collects unreachable objects and empties the caching allocator before the weights
    load, not only before the cache budget is read: a dropped engine's KV cache, once collected, is free allocator
    blocks, and weights placed inside them would keep those segments in use for the budget (the likely reason an
    80 GB H100 gave the engine of the sixteenth test of tests/model/test_gpu_path.py a budget of 0). With a CPU
    engine nothing is released. The CUDA calls are stand-ins here (no GPU on the CPU host); the stand-in loader
    stops the build."""
    from vibeqwen.engine import llm_engine

    calls = []

    class Loaded(Exception):
        pass

    def load_checkpoint(path, device, quantize):
        calls.append(("load", device))
        raise Loaded

    monkeypatch.setattr(llm_engine.gc, "collect", lambda: calls.append("collect") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(llm_engine, "load_checkpoint", load_checkpoint)
    monkeypatch.setattr(llm_engine, "resolve_device", lambda c: dataclasses.replace(c, device="cuda:0",
                                                                                    dtype="bfloat16"))
    with pytest.raises(Loaded):
        LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=2))
    assert calls == ["collect", "empty_cache", ("load", "cuda:0")]
    calls.clear()
    monkeypatch.setattr(llm_engine, "resolve_device", lambda c: dataclasses.replace(c, device="cpu",
                                                                                    dtype="float32"))
    with pytest.raises(Loaded):
        LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(max_num_seqs=2))
    assert calls == [("load", "cpu")]


def test_bf16_gdn_state_halves_the_state_and_serves(tiny_checkpoint, engine, monkeypatch):
    """EngineConfig.gdn_state_dtype "bfloat16": a GDN slot's recurrent state takes half the bytes, so the same
    budget leaves more KV blocks (every running sequence still gets its slot); the cache holds bf16 states; the
    engine serves plain requests, and speculative ones whose drafts are partly rejected (rollbacks to kept bf16
    per-token states; tests/model/test_forward.py checks those bit for bit). A prompt's first token is the float32
    engine's (one prefill pass from a zero state never reads back the stored state); later tokens may differ by
    the state's rounding."""
    from oracle_drafts import oracle_drafter

    import vibeqwen.engine.llm_engine as llm_engine_mod
    from vibeqwen.engine.spec import SpecConfig

    cfg = engine.model.cfg
    ssm = len(cfg.gdn_layers) * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    f32, b16 = gdn_bytes_per_slot(cfg, torch.float32), gdn_bytes_per_slot(cfg, torch.float32, torch.bfloat16)
    assert f32 == gdn_bytes_per_slot(cfg, torch.float32, torch.float32) and f32 - b16 == 2 * ssm
    block = kv_bytes_per_block(cfg, 4, torch.float32)
    budget = 4 * f32 + 20 * block

    def make(dtype, **kw):
        return LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(
            max_num_seqs=4, block_size=4, cache_memory_bytes=budget, gdn_state_dtype=dtype, prefix_cache_slots=0, **kw))

    e32, e16 = make("float32"), make("bfloat16")
    assert e32.runner.cache.ssm_stacked.dtype == torch.float32 and e16.runner.cache.ssm_stacked.dtype == torch.bfloat16
    c32, c16 = e32.cache_manager.config, e16.cache_manager.config
    assert c32.num_slots == c16.num_slots == 4 and c32.num_blocks == 20
    assert c16.num_blocks == (budget - 4 * b16) // block > 20
    prompts = [p + [11] * 15 for p in _prompts(3, seed=3)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 3
    out32, out16 = e32.generate_batch(prompts, params), e16.generate_batch(prompts, params)
    assert [len(o) for o in out16] == [10] * 3 and [o[0] for o in out16] == [o[0] for o in out32]
    assert e16.cache_manager.num_free_slots == 4 and not e16.cache_manager.block_tables
    # speculative verification keeps bf16 per-token states and rolls back to them (reference path)
    monkeypatch.setattr(llm_engine_mod, "ngram_propose", oracle_drafter(prompts, out16))
    spec = make("bfloat16", spec=SpecConfig("ngram", 3))
    out = spec.generate_batch(prompts, params)
    assert [len(o) for o in out] == [10] * 3 and [o[0] for o in out] == [o[0] for o in out16]
    s = spec.stats
    assert 0 < s.spec_accepted_total < s.spec_drafted_total, (s.spec_accepted_total, s.spec_drafted_total)
    assert spec.runner.cache.ssm_stacked.dtype == torch.bfloat16
