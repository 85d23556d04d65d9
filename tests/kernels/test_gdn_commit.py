"""gdn_commit_states (speculative rollback of every GDN layer in one launch) against indexing in PyTorch,
on fresh random inputs: under Triton's interpreter on the CPU, and on a GPU; float32 and bfloat16 states
(EngineConfig.gdn_state_dtype). And ForwardBatch.commit_gdn_states' two GPU-path rollbacks (the stacked one through
this kernel, the per-layer one in torch) with bfloat16 states."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU")

_CHECK = textwrap.dedent("""
    def check(device, seed):
        from vibeqwen_kernels.gdn.commit import gdn_commit_states

        g = torch.Generator().manual_seed(seed)
        f32, bf16 = torch.float32, torch.bfloat16
        for n_layers, n_slots, n_rows, state, n_seqs, dt in [
                (3, 9, 12, (2, 4, 4), 4, f32), (1, 5, 3, (3, 5), 3, f32), (4, 17, 40, (2, 8, 8), 16, f32),
                (2, 4, 4, (2050,), 2, f32), (3, 9, 12, (2, 4, 4), 4, bf16), (2, 4, 4, (2050,), 2, bf16)]:
            ssm = torch.randn(n_layers, n_slots, *state, generator=g).to(device, dt)
            states = torch.randn(n_layers, n_rows, *state, generator=g).to(device, dt)
            slots = torch.randperm(n_slots, generator=g)[:n_seqs].to(device)
            rows = torch.randint(0, n_rows, (n_seqs,), generator=g).to(device)
            expect = ssm.clone()
            expect[:, slots] = states[:, rows]
            gdn_commit_states(ssm, states, slots, rows)
            assert ssm.dtype == dt and torch.equal(ssm, expect), (n_layers, n_slots, state, dt)
        print("ok")
""")


def _run_interpreted(script: str) -> None:
    """Run `script` in a subprocess under Triton's interpreter on the CPU; it must exit 0 and print "ok" last."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


def _run_on_gpu(check_src: str, name: str) -> None:
    """Define the check function `name` from `check_src` here and run it on the GPU (seed 1)."""
    scope: dict = {"torch": torch}
    exec(check_src, scope)
    scope[name]("cuda", 1)


_CHECK_CONV = textwrap.dedent("""
    def check_conv(device, seed):
        from vibeqwen_kernels.gdn.commit import gdn_commit_conv

        g = torch.Generator().manual_seed(seed)
        for n_layers, n_slots, c, w1, n_tok, seqs, dt in [
                (3, 9, 40, 3, 12, [(0, 5, 2), (5, 1, 0), (6, 6, 7)], torch.float32),
                (2, 5, 2050, 3, 9, [(0, 4, 3), (4, 2, 1), (6, 3, 4)], torch.bfloat16),
                (1, 4, 16, 1, 4, [(0, 4, 0)], torch.float32), (2, 6, 24, 4, 10, [(2, 8, 5)], torch.float32)]:
            # seqs: (first token, tokens in the pass, slot); kept = a random count in [1, tokens]
            conv = torch.randn(n_layers, n_slots, c, w1, generator=g).to(device, dt)
            inputs = torch.randn(n_layers, n_tok, c, generator=g).to(device, dt)
            conv0 = torch.randn(n_layers, len(seqs), c, w1, generator=g).to(device, dt)
            kept = [int(torch.randint(1, q + 1, (1,), generator=g)) for _, q, _ in seqs]
            kept[0] = 1  # a window mostly from the state before the pass
            expect = conv.clone()
            for r, ((start, q, slot), n) in enumerate(zip(seqs, kept)):
                for j in range(w1):
                    pos = n - w1 + j
                    expect[:, slot, :, j] = inputs[:, start + pos] if pos >= 0 else conv0[:, r, :, n + j]
            idx = torch.tensor([kept, [s[0] for s in seqs], list(range(len(seqs))), [s[2] for s in seqs]]).to(device)
            gdn_commit_conv(conv, inputs, conv0, idx)
            assert torch.equal(conv, expect), (n_layers, c, w1, kept, dt)
        print("ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_commit_conv_interpreted():
    """gdn_commit_conv (the conv half of the rollback, every layer in one launch) against a loop in PyTorch: windows
    wholly inside the pass, reaching into the state before it (kept < W-1), W-1 of 1 and 4, ragged channel counts,
    float32 and bfloat16."""
    _run_interpreted("import torch\n" + _CHECK_CONV + "\ncheck_conv('cpu', 0)\n")


def test_commit_conv_rejects_bad_inputs(monkeypatch):
    from vibeqwen_kernels.gdn.commit import gdn_commit_conv

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    conv, inputs, conv0 = torch.zeros(2, 4, 8, 3), torch.zeros(2, 6, 8), torch.zeros(2, 2, 8, 3)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="CUDA"):
        gdn_commit_conv(conv, inputs, conv0, idx)
    with pytest.raises(ValueError, match="must be"):
        gdn_commit_conv(conv, torch.zeros(2, 6, 9), conv0, idx)
    with pytest.raises(ValueError, match="int64"):
        gdn_commit_conv(conv, inputs, conv0, idx.int())
    with pytest.raises(ValueError, match="contiguous"):
        gdn_commit_conv(conv.transpose(2, 3).contiguous().transpose(2, 3), inputs, conv0, idx)
    with pytest.raises(ValueError, match="one dtype"):
        gdn_commit_conv(conv, inputs.half(), conv0, idx)


@pytest.mark.gpu
@requires_gpu
def test_commit_conv_gpu():
    _run_on_gpu(_CHECK_CONV, "check_conv")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_commit_interpreted():
    _run_interpreted("import torch\n" + _CHECK + "\ncheck('cpu', 0)\n")


def test_commit_rejects_bad_inputs(monkeypatch):
    from vibeqwen_kernels.gdn.commit import gdn_commit_states

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ssm, states = torch.zeros(2, 4, 8), torch.zeros(2, 6, 8)
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="CUDA"):
        gdn_commit_states(ssm, states, idx, idx)
    with pytest.raises(ValueError, match="must be"):
        gdn_commit_states(ssm, torch.zeros(3, 6, 8), idx, idx)
    with pytest.raises(ValueError, match="one dtype"):
        gdn_commit_states(ssm, states.double(), idx, idx)
    with pytest.raises(ValueError, match=r"\[S\]"):
        gdn_commit_states(ssm, states, idx, torch.tensor([0]))


@pytest.mark.gpu
@requires_gpu
def test_commit_gpu():
    _run_on_gpu(_CHECK, "check")


_BATCH_COMMIT = textwrap.dedent("""
    import torch
    from vibeqwen.config import ModelConfig
    from vibeqwen.model.cache import ModelCache
    from vibeqwen.model.state import ForwardBatch, GDNHistoryBuffers

    cfg = ModelConfig.named("tiny")
    g = torch.Generator().manual_seed(5)
    bf16 = torch.bfloat16
    query_lens, slots, kept = [3, 1, 4], [4, 0, 2], {0: 2, 2: 4}  # sequence 1 verified nothing: left alone
    starts = [0, 3, 4]
    for stacked in (True, False):
        cache = ModelCache(cfg, 8, 4, 6, torch.float32, state_dtype=bf16)
        assert cache.state_dtype == bf16 and cache.ssm_stacked.dtype == bf16
        cache.ssm_stacked.copy_(torch.randn(cache.ssm_stacked.shape, generator=g))
        cache.conv_stacked.copy_(torch.randn(cache.conv_stacked.shape, generator=g))
        ssm0 = cache.ssm_stacked.clone()
        hb = GDNHistoryBuffers(cfg, cache.gdn_layers, 16, torch.float32, "cpu", state_dtype=bf16)
        assert hb.states.dtype == bf16
        for x in (hb.states, hb.inputs, hb.conv0):
            x.copy_(torch.randn(x.shape, generator=g))
        batch = ForwardBatch(cache, query_lens, [5, 5, 5], [[0, 1], [2, 3], [4, 5]], slots, [True] * 3)
        batch.history_buffers = hb if stacked else None
        for layer in cache.gdn_layers:  # as GatedDeltaNet.forward_gpu leaves them: views of the buffers
            st, inp, c0 = hb.get(layer)
            batch.gdn_history_batched[layer] = (c0[:3], inp[:8], st[:8])
        assert hb.holds(batch.gdn_history_batched)  # stacked: one gdn_commit_states launch for every layer
        batch.commit_gdn_states(kept)
        w1 = cfg.linear_conv_kernel_dim - 1
        for j, layer in enumerate(cache.gdn_layers):
            assert cache.ssm[layer].dtype == bf16
            for i, n in kept.items():
                last = starts[i] + n - 1
                assert torch.equal(cache.ssm[layer][slots[i]], hb.states[j, last]), (stacked, layer, i)
            assert torch.equal(cache.ssm[layer][slots[1]], ssm0[j, slots[1]])
            # sequence 2 kept 4 >= W-1 tokens: its conv window is its last W-1 inputs
            assert torch.equal(cache.conv[layer][slots[2]], hb.inputs[j, starts[2] + 4 - w1 : starts[2] + 4].t())
            # sequence 0 kept 2 < W-1 tokens: the window starts in its conv state before the pass (conv0 row 0)
            for jj in range(w1):
                pos = kept[0] - w1 + jj
                want = hb.inputs[j, starts[0] + pos] if pos >= 0 else hb.conv0[j, 0, :, kept[0] + jj]
                assert torch.equal(cache.conv[layer][slots[0]][:, jj], want), (stacked, layer, jj)
    print("ok")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_forward_batch_rollback_bf16_states_interpreted():
    """ForwardBatch.commit_gdn_states with bfloat16 recurrent states (EngineConfig.gdn_state_dtype): the cache's
    slots and the verification history buffers are bf16, and both GPU-path rollbacks (stacked: gdn_commit_states
    over every layer, interpreted; per-layer: index_copy_) copy the kept per-token state into the slot bit for bit,
    leave a sequence outside `kept` alone, and restore the conv window."""
    _run_interpreted(_BATCH_COMMIT)
