"""Paged attention and the fused q/k norm + RoPE + cache store, against the references on fresh random inputs.

References: per sequence, `attention_ref` (fp32 softmax) over the K/V gathered from the paged cache through
its block table (as vibeqwen/model/attention.py does); `qk_norm_rope_store_ref` (rms_norm_ref,
rotary_cos_sin, apply_rotary).

Tolerances.
* Interpreter (fp32 / fp16 inputs, CPU): the kernels do the same fp32 math as the fp32 reference except
  that P is rounded to the input dtype before P @ V (FlashAttention practice) and the output is rounded
  once. fp32: summation order only -> max |err| <= 1e-5 * max|ref|. fp16: P rounding (2^-11 relative)
  and output rounding (2^-11) -> 2e-3 * max|ref|.
* GPU, bf16 (D=256, 16/2 heads): the reference is computed in fp32 from the same bf16 q/K/V. QK^T is
  exact products with fp32 accumulation; P is rounded to bf16 (relative 2^-9 per weight, errors of
  random sign average down) and the output to bf16 (2^-9). So the relative error is ~3e-3; we assert
  ||out - ref|| / ||ref|| <= 8e-3 and |out - ref| <= 2e-2 |ref| + 3e-2 rms(ref) elementwise.
  Outputs are NaN-poisoned first, so an unwritten row fails, and rows of padding must stay NaN.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from vibeqwen_kernels import attention_ref
from vibeqwen_kernels.attention.paged import default_num_splits, paged_attention
from vibeqwen_kernels.attention.rope_norm import qk_norm_rope_store, qk_norm_rope_store_ref

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU"
)


def _triton_version() -> tuple[int, int]:
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2])


# Shared by the interpreter subprocess (which imports this module) and the GPU tests.


def make_batch(hq, hkv, d, page, ctxs, qlens, dtype, device, pad_rows=0, q_scale=1.0, gen=None):
    """Random q and a paged cache whose blocks are shuffled; block-table entries past each sequence
    are -1 or huge (never to be read). Returns a dict of kernel arguments + bookkeeping."""
    b = len(ctxs)
    seqs = [c + n for c, n in zip(ctxs, qlens)]
    nblk = [-(-s // page) for s in seqs]
    maxb = max(nblk + [1]) + 2
    total = sum(nblk) + 3
    perm = torch.randperm(total, generator=gen)
    bt = torch.full((b, maxb), -1, dtype=torch.int32)
    bt[:, -1] = 2**30  # garbage past the end
    i = 0
    for j in range(b):
        bt[j, : nblk[j]] = perm[i : i + nblk[j]].int()
        i += nblk[j]
    kc = torch.randn(total, page, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(total, page, hkv, d, generator=gen).to(dtype)
    t = sum(qlens) + pad_rows
    qbig = (torch.randn(t, hq, 2 * d, generator=gen) * q_scale).to(dtype)
    q = qbig[:, :, :d]  # strided view (row stride 2D per head), like q_proj's [query | gate]
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(seqs, dtype=torch.int32)
    dev = torch.device(device)
    return {
        "q": q.to(dev),
        "k_cache": kc.to(dev),
        "v_cache": vc.to(dev),
        "block_tables": bt.to(dev),
        "seq_lens": sl.to(dev),
        "query_start_loc": qsl.to(dev),
        "scale": d**-0.5,
        "max_query_len": max(qlens + [1]),
    }


def references(a):
    """Per-sequence fp32 attention_ref over the gathered K/V: list of (row slice, ref [n, Hq, D])."""
    page = a["k_cache"].shape[1]
    qsl = a["query_start_loc"].tolist()
    sl = a["seq_lens"].tolist()
    refs = []
    for j in range(len(sl)):
        if qsl[j + 1] == qsl[j]:
            continue
        pos = torch.arange(sl[j], device=a["q"].device)
        blocks = a["block_tables"][j, pos // page].long()
        k = a["k_cache"][blocks, pos % page].float()
        v = a["v_cache"][blocks, pos % page].float()
        ref = attention_ref(a["q"][qsl[j] : qsl[j + 1]].float(), k, v, a["scale"])
        refs.append((slice(qsl[j], qsl[j + 1]), ref))
    return refs


def max_rel_err(out, refs, end_row):
    """max |out - ref| / max |ref| over all sequences; padding rows past end_row must still be NaN."""
    assert torch.isnan(out[end_row:]).all(), "padding rows were written"
    worst = 0.0
    for sl, ref in refs:
        o = out[sl].float()
        assert torch.isfinite(o).all(), "unwritten (NaN-poisoned) or non-finite outputs"
        worst = max(worst, ((o - ref).abs().max() / ref.abs().max()).item())
    return worst


PRELUDE = f"""
import sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from test_paged_attention import make_batch, max_rel_err, references
"""


def _run_interpreter(script: str) -> str:
    if not HAS_TRITON:
        pytest.skip("needs triton")
    if _triton_version() < (3, 9):
        pytest.skip(
            "the interpreter tests need triton >= 3.9 (3.6's fails on runtime-bound ranges under NumPy 2)"
        )
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_interpreter_paged_attention():
    """Both kernels on mixed batches: 0-context prefill, 1-token decode, q_len 3 extend, q_len 0 padding
    (seq_len 0 and > 0), shuffled blocks with garbage entries, strided q, empty splits, fp32 and fp16; each
    again with the fused output gate (out * sigmoid(gate))."""
    out = _run_interpreter(
        """
        import torch
        from vibeqwen_kernels.attention.paged import paged_attention
        g = torch.Generator().manual_seed(0)
        res = []
        cases = [  # hq, hkv, d, page, ctxs, qlens, dtype, kernel, num_splits
            (4, 2, 64, 16, [0, 37, 5, 0, 50], [20, 3, 1, 0, 17], torch.float32, "prefill", None),
            (4, 2, 64, 16, [0, 37, 5, 0, 50], [20, 3, 1, 0, 17], torch.float32, "split", 2),
            (16, 2, 32, 16, [41, 0, 70, 9], [1, 1, 1, 0], torch.float32, "auto", 3),  # decode, empty splits
            (16, 2, 32, 32, [40, 3, 70, 0], [3, 2, 9, 0], torch.float16, "auto", 2),  # verify / extend
            (16, 2, 32, 16, [0, 30, 0], [40, 33, 0], torch.float16, "auto", None),  # prefill
            (16, 2, 32, 16, [30, 0], [3, 5], torch.float16, "prefill", None),
        ]
        for hq, hkv, d, page, ctxs, qlens, dt, kernel, ns in cases:
            a = make_batch(hq, hkv, d, page, ctxs, qlens, dt, "cpu", pad_rows=2, gen=g)
            out = torch.full(a["q"].shape, float("nan"), dtype=dt)
            y = paged_attention(**a, out=out, num_splits=ns, kernel=kernel)
            assert y is out
            refs = references(a)
            res.append((dt, max_rel_err(out, refs, sum(qlens))))
            # the output gate: sigmoid of a strided gate (the second half of a wider row, as the model's q_proj)
            t, h, dd = a["q"].shape
            gate = (torch.randn(t, h, 2 * dd, generator=g) * 3).to(dt)[..., dd:]
            out2 = torch.full(a["q"].shape, float("nan"), dtype=dt)
            paged_attention(**a, out=out2, num_splits=ns, kernel=kernel, gate=gate)
            gated = [(sl, ref * torch.sigmoid(gate[sl].float())) for sl, ref in refs]
            res.append((dt, max_rel_err(out2, gated, sum(qlens))))
        worst32 = max(e for dt, e in res if dt == torch.float32)
        worst16 = max(e for dt, e in res if dt == torch.float16)
        print(worst32, worst16)
        """
    )
    worst32, worst16 = (float(x) for x in out.split())
    assert worst32 <= 1e-5, worst32
    assert worst16 <= 2e-3, worst16


def test_interpreter_qk_norm_rope_store():
    """fp32: equals the reference up to fp32 rounding; fp16: vs the fp32 reference, one fp16 rounding.
    Strided k/v, a skipped (-1) slot, partial and full rotary dims, non-power-of-two heads/D, heads split over
    programs (decode-sized T) or not, and cache slots not addressed stay untouched."""
    out = _run_interpreter(
        """
        import torch
        from vibeqwen_kernels.attention.rope_norm import qk_norm_rope_store, qk_norm_rope_store_ref
        g = torch.Generator().manual_seed(1)
        worst = {torch.float32: 0.0, torch.float16: 0.0}
        # 16 heads at 7 tokens: 4 q programs and a K/V one a token; at 70 tokens (prefill-sized): one program
        for dt, hq, hkv, d, rot, t in [(torch.float32, 4, 2, 64, 16, 7), (torch.float16, 16, 2, 32, 32, 7),
                                       (torch.float32, 3, 1, 48, 16, 7), (torch.float16, 4, 2, 64, 64, 7),
                                       (torch.float32, 16, 2, 32, 16, 70)]:
            page, nb = 16, 5
            qg = torch.randn(t, hq, 2 * d, generator=g).to(dt)
            kv = torch.randn(t, 2 * hkv, d, generator=g).to(dt)
            k, v = kv[:, :hkv], kv[:, hkv:]
            qw, kw = torch.randn(d, generator=g) * 0.1, torch.randn(d, generator=g) * 0.1
            pos = torch.randint(0, 20000, (t,), generator=g)
            slots = torch.randperm(nb * page, generator=g)[:t]
            slots[2] = -1
            kc = torch.full((nb, page, hkv, d), 7.0, dtype=dt)
            vc = torch.full((nb, page, hkv, d), 7.0, dtype=dt)
            kr, vr = kc.float(), vc.float()
            qg0 = qg.clone()
            q = qk_norm_rope_store(qg, k, v, qw, kw, 1e-6, pos, rot, 1e7, kc, vc, slots)
            qr = qk_norm_rope_store_ref(qg.float(), k.float(), v.float(), qw, kw, 1e-6, pos, rot, 1e7,
                                        kr, vr, slots)
            assert q.shape == (t, hq, d) and q.is_contiguous() and q.dtype == dt
            assert torch.equal(qg, qg0), "qg was modified"
            for x, r in ((q, qr), (kc, kr), (vc, vr)):
                err = ((x.float() - r).abs().max() / r.abs().max()).item()
                worst[dt] = max(worst[dt], err)
        print(worst[torch.float32], worst[torch.float16])
        """
    )
    w32, w16 = (float(x) for x in out.split())
    assert w32 <= 2e-6, w32
    assert w16 <= 1e-3, w16


def test_rejects_bad_inputs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(3, 4, 32)
    kc = torch.randn(4, 16, 2, 32)
    bt = torch.zeros(2, 4, dtype=torch.int32)
    sl = torch.tensor([2, 1], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs CUDA"):
        paged_attention(q, kc, kc, bt, sl, qsl, 0.1, 2)
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q, kc, kc, bt.long(), sl, qsl, 0.1, 2)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention(torch.randn(3, 3, 32), kc, kc, bt, sl, qsl, 0.1, 2)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(
            torch.randn(3, 4, 24), torch.randn(4, 16, 2, 24), torch.randn(4, 16, 2, 24), bt, sl, qsl, 0.1, 2
        )
    with pytest.raises(ValueError, match="block_size"):
        paged_attention(q, torch.randn(4, 12, 2, 32), torch.randn(4, 12, 2, 32), bt, sl, qsl, 0.1, 2)
    with pytest.raises(ValueError, match=r"query_start_loc \[B\+1\]"):
        paged_attention(q, kc, kc, bt, sl, qsl[:2], 0.1, 2)
    with pytest.raises(ValueError, match="gate must be"):
        paged_attention(q, kc, kc, bt, sl, qsl, 0.1, 2, gate=torch.randn(3, 4, 16))
    with pytest.raises(ValueError, match="needs CUDA"):
        qk_norm_rope_store(
            torch.randn(3, 4, 64),
            torch.randn(3, 2, 32),
            torch.randn(3, 2, 32),
            torch.zeros(32),
            torch.zeros(32),
            1e-6,
            torch.arange(3),
            16,
            1e7,
            kc,
            kc,
            torch.arange(3),
        )
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_norm_rope_store(
            torch.randn(3, 4, 64),
            torch.randn(3, 2, 32),
            torch.randn(3, 2, 32),
            torch.zeros(32),
            torch.zeros(32),
            1e-6,
            torch.arange(3),
            15,
            1e7,
            kc,
            kc,
            torch.arange(3),
        )
    assert default_num_splits(1, 2) == 64 and default_num_splits(64, 2) == 3
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # programs run one by one: few splits, still more than one
    assert default_num_splits(1, 2) == 4 and default_num_splits(64, 2) == 1


# ----------------------------------------------------------------------------------------------- GPU tests

REL_FRO = 8e-3
RTOL = 2e-2
ATOL_RMS = 3e-2


def _check_gpu(out, refs, end_row):
    assert torch.isnan(out[end_row:]).all(), "padding rows were written"
    for sl, ref in refs:
        o = out[sl].float()
        assert torch.isfinite(o).all(), "unwritten (NaN-poisoned) or non-finite outputs"
        rel = ((o - ref).norm() / ref.norm()).item()
        assert rel <= REL_FRO, f"relative error {rel:.2e} > {REL_FRO} (rows {sl})"
        rms = ref.pow(2).mean().sqrt().item()
        torch.testing.assert_close(o, ref, rtol=RTOL, atol=ATOL_RMS * rms)


def _gpu_case(ctxs, qlens, page=16, kernel="auto", num_splits=None, q_scale=1.0, seed=0):
    """The model's shapes (16 q / 2 kv heads of 256), bf16, against the fp32 reference; then again with the
    output gate (a strided bf16 gate, as the second half of the model's q projection)."""
    g = torch.Generator().manual_seed(seed)
    a = make_batch(16, 2, 256, page, ctxs, qlens, torch.bfloat16, "cuda", pad_rows=3, q_scale=q_scale, gen=g)
    out = torch.full(a["q"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    paged_attention(**a, out=out, num_splits=num_splits, kernel=kernel)
    refs = references(a)
    _check_gpu(out, refs, sum(qlens))
    t, h, d = a["q"].shape
    gate = (torch.randn(t, h, 2 * d, generator=g) * 3).to(torch.bfloat16).cuda()[..., d:]
    out = torch.full(a["q"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    paged_attention(**a, out=out, num_splits=num_splits, kernel=kernel, gate=gate)
    _check_gpu(out, [(sl, ref * torch.sigmoid(gate[sl].float())) for sl, ref in refs], sum(qlens))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize(
    "batch,max_ctx,num_splits", [(1, 8192, None), (8, 8192, 7), (64, 8192, None), (33, 2000, 1)]
)
def test_gpu_decode(batch, max_ctx, num_splits, page):
    g = torch.Generator().manual_seed(batch + page)
    ctxs = torch.randint(0, max_ctx, (batch,), generator=g).tolist()
    qlens = [1] * batch
    if batch > 2:  # padding entries: seq_len 0 and q_len 0
        ctxs[1], qlens[1] = 0, 0
    _gpu_case(ctxs, qlens, page=page, num_splits=num_splits, q_scale=3.0 if page == 64 else 1.0)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kernel", ["auto", "prefill"])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_gpu_verify(batch, kernel):
    """Speculative verification: q_len 2..9 on contexts up to 8k, both kernels."""
    g = torch.Generator().manual_seed(batch)
    ctxs = torch.randint(0, 8192, (batch,), generator=g).tolist()
    qlens = torch.randint(2, 10, (batch,), generator=g).tolist()
    if batch > 1:
        ctxs[0], qlens[0] = 0, 0
    _gpu_case(ctxs, qlens, kernel=kernel)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize(
    "ctxs,qlens,page",
    [
        ([0], [8192], 16),
        ([0], [1000], 128),
        ([0, 3000, 17, 0, 5000], [2000, 500, 1, 0, 77], 16),  # prefill, chunked extend, decode, padding
        ([100, 0, 4096], [3000, 33, 1024], 64),
    ],
)
def test_gpu_prefill(ctxs, qlens, page):
    _gpu_case(ctxs, qlens, page=page, q_scale=2.0)


@pytest.mark.gpu
@requires_gpu
def test_gpu_decode_cuda_graph():
    """Capture decode once, change seq_lens / block tables / q in place, replay: matches the reference."""
    g = torch.Generator().manual_seed(5)
    batch, max_blocks = 8, 4096 // 16 + 2
    a = make_batch(16, 2, 256, 16, [4000] * batch, [1] * batch, torch.bfloat16, "cuda", gen=g)
    bt = torch.zeros(batch, max_blocks, dtype=torch.int32, device="cuda")
    bt[:, : a["block_tables"].shape[1]] = a["block_tables"]
    a["block_tables"] = bt
    out = torch.empty(a["q"].shape, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        paged_attention(**a, out=out)  # warm up / compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(**a, out=out)
    for seed in range(3):
        gg = torch.Generator().manual_seed(100 + seed)
        lens = torch.randint(1, 4001, (batch,), generator=gg)
        lens[0] = 0 if seed == 1 else lens[0]
        a["seq_lens"].copy_(lens.int())
        a["query_start_loc"].copy_(torch.tensor([0] + (lens > 0).int().cumsum(0).tolist(), dtype=torch.int32))
        perm = torch.randperm(a["k_cache"].shape[0], generator=gg)[: 4000 // 16 + 1].int()
        a["block_tables"][:, : perm.numel()] = perm.cuda()
        a["q"].copy_(torch.randn(a["q"].shape, generator=gg).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_gpu(out, references(a), int((lens > 0).sum()))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [1, 37, 8192])
def test_gpu_qk_norm_rope_store(t):
    """Real shapes, bf16, rotary_dim 64, theta 1e7: vs the fp32 reference on the same bf16 inputs, within
    one bf16 rounding (2^-8 relative, plus fp32 cos/sin differences); cache slots match likewise."""
    dev = torch.device("cuda")
    hq, hkv, d, page, nb = 16, 2, 256, 16, t // 16 + 8
    qg = torch.randn(t, hq, 2 * d, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(t, 2 * hkv, d, device=dev, dtype=torch.bfloat16)
    k, v = kv[:, :hkv], kv[:, hkv:]
    qw, kw = torch.randn(d, device=dev) * 0.1, torch.randn(d, device=dev) * 0.1
    pos = torch.randint(0, 262144, (t,), device=dev)
    slots = torch.randperm(nb * page, device=dev)[:t]
    slots[0] = -1
    kc = torch.zeros(nb, page, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kr, vr = kc.float(), vc.float()
    q = qk_norm_rope_store(qg, k, v, qw.bfloat16(), kw.bfloat16(), 1e-6, pos, 64, 1e7, kc, vc, slots)
    qr = qk_norm_rope_store_ref(
        qg.float(),
        k.float(),
        v.float(),
        qw.bfloat16().float(),
        kw.bfloat16().float(),
        1e-6,
        pos,
        64,
        1e7,
        kr,
        vr,
        slots,
    )
    for x, r in ((q, qr), (kc, kr), (vc, vr)):
        torch.testing.assert_close(x.float(), r, rtol=8e-3, atol=8e-3 * r.abs().max().item())
