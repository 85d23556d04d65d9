"""The reference forward pass on its own: prefill + decode equals one long prefill; batching is invisible."""

from __future__ import annotations

import torch

from seqrun import Sequences


def _run(model, chunks: list[list[int]]):
    """Feed `chunks` one after another to one sequence; return logits of every token fed."""
    seqs = Sequences(model, num_seqs=1)
    return torch.cat([seqs.run({0: c}) for c in chunks if c])


def test_prefill_then_decode_equals_one_prefill(tiny_model_fp32):
    _, model, _ = tiny_model_fp32
    ids = torch.randint(0, 248044, (150,)).tolist()  # > 2 GDN chunks of 64, > 18 KV blocks of 8
    whole = _run(model, [ids])
    split = _run(model, [ids[:70], ids[70:71], ids[71:100], *[[t] for t in ids[100:130]], ids[130:]])
    # float32, chunked vs token-by-token GDN and different matmul shapes: op-order noise only (observed
    # up to ~1.2e-4 on logits of unit scale); a wrong state hand-over moves logits by O(0.1)
    torch.testing.assert_close(split, whole, atol=5e-4, rtol=1e-4)


def test_flattened_mixed_batch_matches_single_sequences(tiny_model_fp32):
    _, model, _ = tiny_model_fp32
    prompts = [torch.randint(0, 248044, (n,)).tolist() for n in (5, 1, 33, 70)]
    alone = [_run(model, [p[:-1], p[-1:]]) for p in prompts]
    seqs = Sequences(model, num_seqs=4)
    # step 1: prefill chunks of all four; step 2: a decode for each (mixed lengths in one flattened batch)
    first = seqs.run({i: p[:-1] for i, p in enumerate(prompts) if len(p) > 1})
    second = seqs.run({3: prompts[3][-1:], 1: prompts[1], 0: prompts[0][-1:], 2: prompts[2][-1:]})
    got = [None] * 4
    off = 0
    for i in (0, 2, 3):
        n = len(prompts[i]) - 1
        got[i] = [first[off : off + n]]
        off += n
    for j, i in enumerate((3, 1, 0, 2)):
        got[i] = (got[i] or []) + [second[j : j + 1]]
    for i in range(4):
        torch.testing.assert_close(torch.cat(got[i]), alone[i], atol=1e-4, rtol=1e-4)


def test_reused_gdn_slot_starts_from_zero_state(tiny_model_fp32):
    _, model, _ = tiny_model_fp32
    a, b = torch.randint(0, 248044, (20,)).tolist(), torch.randint(0, 248044, (12,)).tolist()
    seqs = Sequences(model, num_seqs=1)
    seqs.run({0: a})
    seqs.lens[0] = 0  # the slot and blocks now belong to a new sequence
    torch.testing.assert_close(seqs.run({0: b}), _run(model, [b]), atol=1e-5, rtol=1e-5)


def _twin(seqs, state_dtype):
    """A Sequences over the same model whose cache is a copy of `seqs`' (KV, conv states, lengths), its recurrent
    states upcast or rounded to `state_dtype` (float32 <- bfloat16 is exact)."""
    twin = Sequences(seqs.model, num_seqs=len(seqs.lens), state_dtype=state_dtype)
    for layer in seqs.cache.k:
        twin.cache.k[layer].copy_(seqs.cache.k[layer])
        twin.cache.v[layer].copy_(seqs.cache.v[layer])
    twin.cache.conv_stacked.copy_(seqs.cache.conv_stacked)
    twin.cache.ssm_stacked.copy_(seqs.cache.ssm_stacked)
    twin.lens = list(seqs.lens)
    return twin


def test_bf16_gdn_state_rounds_only_what_it_stores(tiny_model_fp32):
    """EngineConfig.gdn_state_dtype "bfloat16" on the reference path: the cache holds bf16 recurrent states; a pass
    upcasts the stored state, computes in float32 and rounds (to nearest even) only what it stores. So (exactly):
    a first prefill pass gives the float32 cache's logits and stores its states rounded; a decode step, or a
    verification pass keeping every token's state, from a bf16 state equals the float32 path started from that
    state upcast, with the stored (final and per-token) states rounded; a rollback restores a rounded per-token
    state. Over many decode steps the rounding (once per token) moves logits a little: close, not equal."""
    _, model, _ = tiny_model_fp32
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 248044, (90,), generator=g).tolist()  # > 1 GDN chunk of 64
    f32, b16 = Sequences(model, num_seqs=2), Sequences(model, num_seqs=2, state_dtype=torch.bfloat16)
    assert b16.cache.ssm_stacked.dtype == torch.bfloat16 and all(
        s.dtype == torch.bfloat16 for s in b16.cache.ssm.values())
    assert f32.cache.ssm_stacked.dtype == torch.float32
    # one prefill pass from a zero state: the stored state is never read back within it
    assert torch.equal(b16.run({1: ids[:70]}), f32.run({1: ids[:70]}))
    assert torch.equal(b16.cache.ssm_stacked, f32.cache.ssm_stacked.to(torch.bfloat16))
    assert not torch.equal(b16.cache.ssm_stacked.float(), f32.cache.ssm_stacked)  # it did round
    # a decode step from the bf16 state: the float32 path from the same state upcast, the new state rounded
    up = _twin(b16, torch.float32)
    assert torch.equal(up.cache.ssm_stacked, b16.cache.ssm_stacked.float())
    assert torch.equal(b16.run({1: ids[70:71]}), up.run({1: ids[70:71]}))
    assert torch.equal(b16.cache.ssm_stacked, up.cache.ssm_stacked.to(torch.bfloat16))
    # a verification pass (keep_states) of 5 tokens: running state float32 throughout, each kept state rounded
    up = _twin(b16, torch.float32)
    assert torch.equal(b16.run({1: ids[71:76]}, keep={1}), up.run({1: ids[71:76]}, keep={1}))
    for key, (conv, ssm) in b16.last_batch.gdn_history.items():
        conv32, ssm32 = up.last_batch.gdn_history[key]
        assert ssm.dtype == torch.bfloat16 and ssm.shape[0] == 5
        assert torch.equal(ssm, ssm32.to(torch.bfloat16)) and torch.equal(conv, conv32)
    assert torch.equal(b16.cache.ssm_stacked, up.cache.ssm_stacked.to(torch.bfloat16))
    # roll back to the state after 2 of the 5 tokens: the rounded per-token state
    b16.last_batch.commit_gdn_states({0: 2})
    up.last_batch.commit_gdn_states({0: 2})
    b16.lens[1] = up.lens[1] = 73
    assert torch.equal(b16.cache.ssm_stacked, up.cache.ssm_stacked.to(torch.bfloat16))
    for layer, (_, ssm) in ((k[0], v) for k, v in b16.last_batch.gdn_history.items()):
        assert torch.equal(b16.cache.ssm[layer][1], ssm[1])
    # the rest decoded token by token in both caches: one rounding per token, logits close (observed 6e-4
    # relative at most on this tiny model), states within a few bf16 ulps (observed 2.6e-3 at |state| <= 1.03)
    f32.run({1: ids[70:73]})
    rel = []
    for t in ids[73:]:
        a, b = f32.run({1: [t]}), b16.run({1: [t]})
        rel.append(((b - a).norm() / a.norm()).item())
    assert 0 < max(rel) < 5e-3, rel
    torch.testing.assert_close(b16.cache.ssm_stacked.float(), f32.cache.ssm_stacked, atol=1e-2, rtol=1e-2)


def test_model_cache_state_dtypes(tiny_config):
    """The recurrent state is float32 (default) or bfloat16 (EngineConfig.gdn_state_dtype); KV and conv states keep
    the compute dtype; anything else is a ValueError naming both."""
    import pytest

    from vibeqwen.model.cache import ModelCache

    for sdt in (torch.float32, torch.bfloat16):
        c = ModelCache(tiny_config, 2, 4, 3, torch.float32, state_dtype=sdt)
        assert c.state_dtype == c.ssm_stacked.dtype == sdt and c.conv_stacked.dtype == torch.float32
        assert all(s.dtype == sdt and s.data_ptr() == c.ssm_stacked[j].data_ptr()
                   for j, s in enumerate(c.ssm.values()))
    assert ModelCache(tiny_config, 2, 4, 3).ssm_stacked.dtype == torch.float32
    with pytest.raises(ValueError, match="float32 or torch.bfloat16"):
        ModelCache(tiny_config, 2, 4, 3, torch.float32, state_dtype=torch.float16)
