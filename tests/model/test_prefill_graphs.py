"""Whole-chunk prefill graphs (`vibeqwen.model.prefill_graphs.PrefillGraphs`) on the CPU.

* `can_run`'s rules and the bucket choice (no model run).
* The padded pass itself, through Triton's interpreter: on a CPU device PrefillGraphs captures nothing and
  `run` runs exactly the pass a graph would replay (two rows, B tokens, the GDN layers in their padded
  one-sequence mode, max_query_len = B). fla-core is replaced by the fp32 recurrent reference run over the
  whole padded sequence (so the padding tokens go through the math), the eager pass it is compared with
  runs the interpreted recurrent kernel per sequence. Float32 throughout: hidden states agree to summation
  order (1e-4 relative asserted; a wiring error is O(1)); the KV blocks and GDN state slots of other
  sequences, and every block but the chunk's own and the scratch block, stay bit-identical.

The same checks at the real shapes, with capture and replay, are in tests/model/test_gpu_path.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch


class _Cache:
    """What PrefillGraphs reads of a ModelCache before any pass (CPU: nothing is captured)."""

    block_size, scratch_block, scratch_slot, device = 16, 99, 9, torch.device("cpu")


def _graphs(max_tokens=2048, width=8):
    from vibeqwen.model.prefill_graphs import PrefillGraphs

    return PrefillGraphs(None, _Cache(), width, max_tokens)


def _batch(query_lens, keep=None, table_len=1):
    from vibeqwen.model.state import ForwardBatch

    n = len(query_lens)
    return ForwardBatch(None, query_lens, [0] * n, [list(range(table_len))] * n, list(range(n)),
                        keep or [False] * n)


def test_can_run_and_buckets(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_PREFILL_MIN_BUCKET", raising=False)
    g = _graphs()
    assert g.sizes == [16, 32, 64, 128, 256, 512, 1024, 2048] and g.max_tokens == 2048
    assert g.width == 2048 // 16  # raised to what the largest bucket's padding row reads
    assert [g.bucket(t) for t in (1, 16, 17, 64, 65, 128, 129, 1000, 2048)] == [16, 16, 32, 64, 128, 128, 256, 1024,
                                                                               2048]
    assert g.can_run(_batch([17])) and g.can_run(_batch([2048])) and g.can_run(_batch([1000], table_len=128))
    # short chunks (a short prompt, a prefix-cache hit's tail) replay the smallest bucket instead of ~1000 eager
    # launches
    assert g.can_run(_batch([16])) and g.can_run(_batch([1]))
    assert not g.can_run(_batch([0]))
    assert not g.can_run(_batch([2049]))  # beyond the largest bucket
    assert not g.can_run(_batch([100, 100]))  # one sequence only
    assert not g.can_run(_batch([100, 1]))  # no decode token batched with the chunk either
    assert not g.can_run(_batch([100], keep=[True]))  # speculative verification keeps per-token states
    assert not g.can_run(_batch([100], table_len=129))  # wider than the static table
    odd = _graphs(max_tokens=3000)
    assert odd.sizes[-1] == 3000 and odd.bucket(2049) == 3000
    with pytest.raises(ValueError, match="max_tokens > 16"):
        _graphs(max_tokens=16)


def test_min_bucket_switch(monkeypatch):
    from vibeqwen.model.prefill_graphs import MIN_BUCKET, min_bucket

    monkeypatch.delenv("VIBEQWEN_PREFILL_MIN_BUCKET", raising=False)
    assert min_bucket() == MIN_BUCKET == 16 and _graphs().sizes[0] == 16
    monkeypatch.setenv("VIBEQWEN_PREFILL_MIN_BUCKET", "32")
    assert min_bucket() == 32 and _graphs().sizes == [32, 64, 128, 256, 512, 1024, 2048]
    assert _graphs().bucket(5) == 32
    monkeypatch.setenv("VIBEQWEN_PREFILL_MIN_BUCKET", "4096")  # never above the largest chunk
    assert _graphs(max_tokens=2048).sizes == [2048] and _graphs(max_tokens=3000).sizes == [3000]
    for bad in ("48", "8", "8192", "x", "-32"):
        monkeypatch.setenv("VIBEQWEN_PREFILL_MIN_BUCKET", bad)
        with pytest.raises(ValueError, match="VIBEQWEN_PREFILL_MIN_BUCKET"):
            min_bucket()


def test_engine_captures_nothing_on_the_cpu_and_reserves_for_the_gpu(tiny_checkpoint):
    """EngineConfig.prefill_graphs is a GPU option: the CPU engine builds no graphs (and starts). The GPU
    activation reserve grows by the graphs' pool estimate for the largest bucket, only when they are on."""
    import dataclasses

    from vibeqwen.engine.llm_engine import EngineConfig, LLMEngine
    from vibeqwen.model.prefill_graphs import PREFILL_GRAPH_BYTES_PER_TOKEN

    engine = LLMEngine.from_checkpoint(tiny_checkpoint, config=EngineConfig(prefill_graphs=True))
    assert engine.runner.prefill_graphs is None
    on = engine._activation_reserve()
    for change in ({"prefill_graphs": False}, {"cuda_graphs": False}):
        engine.config = dataclasses.replace(engine.config, **change)
        assert on - engine._activation_reserve() >= PREFILL_GRAPH_BYTES_PER_TOKEN * 2048
        engine.config = dataclasses.replace(engine.config, prefill_graphs=True, cuda_graphs=True)
    engine.config = dataclasses.replace(engine.config, prefill_graphs=False)
    assert on - engine._activation_reserve() == PREFILL_GRAPH_BYTES_PER_TOKEN * 2048


def _fake_fla(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    """fla-core's chunk_gated_delta_rule (one sequence, [1, B, ...]) by the fp32 reference, padding included. q and
    k come L2-normalised (gdn_padded_inputs does it, so fla is asked not to); the reference normalises again, a
    no-op within 1e-6."""
    from vibeqwen_kernels import gdn_recurrent_ref

    assert output_final_state and not use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5
    norms = k[0].float().norm(dim=-1)
    assert torch.allclose(norms[norms > 0], torch.ones(()), atol=1e-5), "k not L2-normalised"
    o, ht = gdn_recurrent_ref(q[0], k[0], v[0], g[0], beta[0], initial_state[0])
    return o[None].to(v.dtype), ht[None]


@pytest.mark.parametrize("n", [0, 1, 17, 32])
def test_padded_chunk_is_exact(monkeypatch, n):
    """gdn_chunk_padded / gdn_chunk_padded_slot (the GDN body of every prefill graph, shared with
    ChunkPrefillGraphs) on a bucket of 32 rows whose rows >= n hold garbage (NaN and huge values): rows < n
    and the final state equal the reference on the n real rows alone; the slot version reads its slot only
    when has_initial_state says so and writes that slot only."""
    from vibeqwen_kernels import gdn_recurrent_ref
    from vibeqwen_kernels.gdn import chunk_fla

    monkeypatch.setattr(chunk_fla, "_fla_chunk", lambda: _fake_fla)
    hk, hv, d, big = 2, 4, 16, 32
    g = torch.Generator().manual_seed(n)
    q, k = (torch.randn(big, hk, d, generator=g) for _ in range(2))
    v = torch.randn(big, hv, d, generator=g)
    a, b = torch.randn(big, hv, generator=g), torch.randn(big, hv, generator=g)
    A_log, dt_bias = torch.rand(hv, generator=g) + 0.5, torch.randn(hv, generator=g)
    for x in (q, k, v, a, b):
        x[n:] = float("nan")
        x[n::3] = 1e30
    h0 = torch.randn(hv, d, d, generator=g)
    gates = -A_log.exp() * torch.nn.functional.softplus(a[:n] + dt_bias), torch.sigmoid(b[:n])
    ref_o, ref_h = gdn_recurrent_ref(q[:n], k[:n], v[:n], *gates, h0)
    o, ht = chunk_fla.gdn_chunk_padded(q, k, v, a, b, A_log, dt_bias, h0, torch.tensor([n]))
    assert o.shape == (big, hv, d) and torch.isfinite(o).all() and torch.isfinite(ht).all()
    torch.testing.assert_close(o[:n], ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, ref_h, rtol=1e-5, atol=1e-5)
    for init in (True, False):
        ss = torch.randn(5, hv, d, d, generator=g)
        ss[3] = h0
        ss0 = ss.clone()
        o2 = chunk_fla.gdn_chunk_padded_slot(q, k, v, a, b, A_log, dt_bias, ss, torch.tensor([3]),
                                             torch.tensor([init]), torch.tensor([n], dtype=torch.int32))
        want_o, want_h = (ref_o, ref_h) if init else gdn_recurrent_ref(q[:n], k[:n], v[:n], *gates, None)
        torch.testing.assert_close(o2[:n], want_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ss[3], want_h, rtol=1e-5, atol=1e-5)
        assert torch.equal(ss[[0, 1, 2, 4]], ss0[[0, 1, 2, 4]])


def test_failed_capture_leaves_prefill_eager(tiny_checkpoint, monkeypatch, caplog):
    """A capture that raises (out of memory, an uncapturable kernel) logs a warning and leaves prefill eager."""
    from vibeqwen.engine.llm_engine import LLMEngine
    from vibeqwen.model import prefill_graphs

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    engine = LLMEngine.from_checkpoint(tiny_checkpoint)
    monkeypatch.setattr(prefill_graphs, "PrefillGraphs", broken)
    assert engine.runner.capture_prefill_graphs(2048, 4096) is False
    assert engine.runner.prefill_graphs is None and "prompt chunks run eagerly" in caplog.text
    assert engine.runner.capture_prefill_graphs(16, 4096) is False  # nothing to graph: no capture, no warning


SCRIPT = textwrap.dedent('''
    import os, sys, torch
    from vibeqwen.checkpoint.loader import load_checkpoint
    from vibeqwen.model.cache import ModelCache
    from vibeqwen.model.prefill_graphs import PrefillGraphs
    from vibeqwen.model.qwen import Qwen3_5MoeForCausalLM
    from vibeqwen.model.state import ForwardBatch
    from vibeqwen.model.weights import Weights
    from vibeqwen_kernels import gdn_recurrent_ref
    from vibeqwen_kernels.gdn import chunk_fla

    calls = []

    def fake_fla(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        calls.append(q.shape[1])
        o, ht = gdn_recurrent_ref(q[0], k[0], v[0], g[0], beta[0], initial_state[0])
        return o[None].to(v.dtype), ht[None]

    chunk_fla._fla_chunk = lambda: fake_fla
    os.environ["VIBEQWEN_FAST"] = "1"
    ckpt = load_checkpoint(sys.argv[1])
    model = Qwen3_5MoeForCausalLM.from_weights(ckpt.config, Weights(ckpt.tensors, ckpt.precisions, torch.float32))
    assert model.fast
    BS, NB, NS = 8, 40, 4
    caches = [ModelCache(model.cfg, NB, BS, NS, torch.float32) for _ in range(2)]  # eager, graphs
    for c in caches:  # garbage everywhere (a stale state must not leak in): identical in both caches
        g = torch.Generator().manual_seed(1)
        for t in [*c.k.values(), *c.v.values(), c.conv_stacked, c.ssm_stacked]:
            t.copy_(torch.randn(t.shape, generator=g))
    graphs = PrefillGraphs(model, caches[1], width=16, max_tokens=48, min_tokens=24)  # small: interpreted
    assert graphs.sizes == [24, 48]
    gen = torch.Generator().manual_seed(3)
    # sequence A (slot 2, blocks 20..33 scrambled), sequence B (slot 1, blocks 0..9): B is prefilled eagerly in
    # both caches first; A then runs chunks through the graphs in one cache and eagerly in the other
    tables = {"A": [27, 21, 25, 20, 33, 23, 26, 22, 28, 24, 31, 29, 32, 30], "B": list(range(10))}
    slots = {"A": 2, "B": 1}
    lens = {"A": 0, "B": 0}

    def batch(cache, name, n):
        return ForwardBatch(cache, [n], [lens[name]], [tables[name]], [slots[name]])

    def eager(cache, name, ids):
        b = batch(cache, name, len(ids))
        return model.forward(torch.tensor(ids), b.device_batch().positions, b)

    b_ids = torch.randint(0, 500, (30,), generator=gen).tolist()
    for c in caches:
        eager(c, "B", b_ids)
    lens["B"] = 30
    snap_b = [(c.k[3][:10].clone(), c.conv_stacked[:, 1].clone(), c.ssm_stacked[:, 1].clone()) for c in caches]
    worst = 0.0
    # a first chunk in the small bucket, a second chunk (with context) in the large one, an exact bucket (no
    # padding), then short chunks (a prefix-cache hit's tail; replays of the small bucket after a different T)
    for n, bucket in [(17, 24), (30, 48), (24, 24), (3, 24), (1, 24)]:
        ids = torch.randint(0, 500, (n,), generator=gen).tolist()
        ref = eager(caches[0], "A", ids)
        k_before = {i: caches[1].k[i].clone() for i in caches[1].k}
        b = batch(caches[1], "A", n)
        assert graphs.can_run(b)
        n_calls = len(calls)
        out = graphs.run(torch.tensor(ids), b)
        assert calls[n_calls:] == [bucket] * 3, calls[n_calls:]  # every GDN layer: one padded sequence
        assert b.meta.max_query_len == bucket and b.meta.positions[:n].tolist() == list(range(lens["A"], lens["A"] + n))
        rel = ((out - ref).norm() / ref.norm()).item()
        worst = max(worst, rel)
        assert out.shape == ref.shape and rel < 1e-4, (n, rel)
        lens["A"] += n
        # A's KV and GDN state as the eager pass left them; other blocks untouched but the scratch block
        own = sorted({tables["A"][p // BS] for p in range(lens["A"] - n, lens["A"])})
        for i in caches[1].k:
            for blk in range(NB):
                if blk in own:
                    for kv in (caches[1].k, caches[1].v):
                        ref_kv = caches[0].k if kv is caches[1].k else caches[0].v
                        r = ((kv[i][blk] - ref_kv[i][blk]).norm() / ref_kv[i][blk].norm()).item()
                        assert r < 1e-4, (n, i, blk, r)
                else:
                    assert torch.equal(caches[1].k[i][blk], k_before[i][blk]), (n, i, blk)
        for st in (caches[1].conv_stacked, caches[1].ssm_stacked):
            ref_st = caches[0].conv_stacked if st is caches[1].conv_stacked else caches[0].ssm_stacked
            r = ((st[:, 2] - ref_st[:, 2]).norm() / ref_st[:, 2].norm()).item()
            assert r < 1e-4, (n, r)
            assert torch.equal(st[:, [0, 1, 3]], ref_st[:, [0, 1, 3]]), n  # other slots: as the eager run's
    for j, c in enumerate(caches):  # sequence B: bit-identical to before A's chunks, in both caches
        assert torch.equal(c.k[3][:10], snap_b[j][0]) and torch.equal(c.conv_stacked[:, 1], snap_b[j][1])
        assert torch.equal(c.ssm_stacked[:, 1], snap_b[j][2])
    # and B continues from its state exactly as before: one more eager chunk of B in both caches
    more = torch.randint(0, 500, (5,), generator=gen).tolist()
    h = [eager(c, "B", more) for c in caches]
    assert torch.equal(h[0], h[1])
    print("worst rel hidden %.2e" % worst)
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton's interpreter")
@pytest.mark.slow
def test_padded_pass_matches_eager_under_interpreter(tiny_checkpoint):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_checkpoint)], env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout.strip().splitlines()[-1])
