"""Gated DeltaNet kernels against their references, on fresh random inputs.

* `causal_conv1d` (varlen conv1d + SiLU with state slots) vs `causal_conv1d_ref`, per sequence;
* `gdn_recurrent` (token-by-token delta rule, state slots, optional per-token states) vs
  `gdn_recurrent_ref`, gates g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) computed in torch;
* `gdn_chunk_prefill` (fla-core's chunked kernel) vs `gdn_chunk_ref` / `gdn_recurrent_ref` (GPU only).

Batches mix q_len 0 (padding: its slot must stay bit-identical), 1, 2, 5 and 17 (17 > W-1 and crosses
tile edges), new and continued sequences, shuffled slots (int32 and int64), strided input views.

Tolerances.
* Interpreter (CPU, fp32 inputs): the kernels do the references' fp32 math, only the summation order
  differs: max abs error <= 1e-4 (observed ~1e-6); new conv states are copies: exact.
* bf16 recurrent states (EngineConfig.gdn_state_dtype): read exactly, fp32 math, every stored state (final,
  per-token) rounded once to bf16. The interpreter converts fp32 -> bf16 by truncation (the GPU rounds to nearest
  even), so under it a stored state is within one bf16 ulp of the fp32 reference (+1e-5 for summation order);
  on the GPU within half an ulp (+1e-4).
* GPU, bf16 activations, references in fp32 on the same bf16 values. conv: one rounding of y to bf16
  (2^-9 relative) -> rtol 8e-3, atol 1e-3 * rms; states exact. recurrent: fp32 state and math, o
  rounded to bf16 -> relative Frobenius error <= 4e-3 for o, <= 1e-4 for the fp32 states.
  fla chunk: fla rounds the normalised q/k, the WY terms (w, u), the per-chunk states h and v_new to
  bf16 (each ~2^-9 relative) before its tensor-core products, so o carries a few such roundings:
  relative Frobenius <= 1.5e-2 (about 5x the expected ~3e-3) for o and <= 1e-2 for the final fp32
  state (updated from bf16 k and v_new).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from vibeqwen_kernels import causal_conv1d_ref, gdn_chunk_ref, gdn_recurrent_ref

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = HAS_TRITON and torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs triton and a CUDA GPU")

# q_len per sequence: padding (0), decode (1), spec-verify sizes (2, 5), a short prefill (17)
LENS = [5, 0, 1, 17, 2, 1]
INIT = [True, True, False, True, False, True]


def _batch(lens, init, num_slots, device, slot_dtype=torch.int32, seed=0):
    """query_start_loc, shuffled distinct slots, has_initial_state for a flattened batch."""
    gen = torch.Generator().manual_seed(seed)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lens).cumsum(0)
    slots = torch.randperm(num_slots, generator=gen)[: len(lens)].to(slot_dtype)
    return qsl.to(device), slots.to(device), torch.tensor(init, device=device)


def _step_batch(nb, verify, device, seed, slot_seed=None):
    """A decode step's batch of nb sequences (q_len 1; verify: q_len 1-9 drawn with ``seed``), sequence nb // 2 a
    padding one (q_len 0) where nb > 1, every third from zero state: (lens, init, _batch's tensors over nb + 5
    slots shuffled with ``slot_seed``, default nb)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [1] * nb if not verify else torch.randint(1, 10, (nb,), generator=gen).tolist()
    if nb > 1:
        lens[nb // 2] = 0
    init = [i % 3 != 1 for i in range(nb)]
    return lens, init, _batch(lens, init, nb + 5, device, seed=nb if slot_seed is None else slot_seed)


def _gates(a, b, A_log, dt_bias):
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def _rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _bf16_ulp(x):
    """Spacing of bf16 values (8 significant bits) at |x|, elementwise: 2^(floor(log2 |x|) - 7)."""
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(2.0**-126))) - 7)


# ----------------------------------------------------------------------------------------------------
# Interpreter (CPU)


def _triton_version() -> tuple[int, int]:
    import triton

    return tuple(int(v) for v in triton.__version__.split(".")[:2])


_INTERP_SCRIPT = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from vibeqwen_kernels import causal_conv1d_ref, gdn_recurrent_ref
    from vibeqwen_kernels.conv1d.causal import causal_conv1d
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    torch.manual_seed(0)
    worst = 0.0
    NS = 9
    def batch(lens, init, sdt, seed):
        g = torch.Generator().manual_seed(seed)
        qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(lens).cumsum(0)
        return qsl, torch.randperm(NS, generator=g)[: len(lens)].to(sdt), torch.tensor(init)

    # ---- conv1d: batches with int32 / int64 slots, strided x, fp32 and fp16 --------------------
    cases = [([5, 0, 1, 17, 2, 1], [True, True, False, True, False, True], torch.int32, torch.float32, 40),
             ([1, 1, 0, 1], [True, False, True, True], torch.int64, torch.float16, 24),
             ([2, 35], [True, False], torch.int64, torch.float32, 8),  # 35: token blocks past the state
             ([2, 0, 7, 1], [True, True, False, True], torch.int32, torch.float32, 24)]  # verification: one block,
    # the conv kernel shifts the state itself (q_len 2 < W - 1: old columns and inputs mixed)
    for ci, (lens, init, sdt, dt, C) in enumerate(cases):
        W = 4
        qsl, slots, hi = batch(lens, init, sdt, ci)
        T = int(qsl[-1]) + 2  # two rows past the last sequence (left alone)
        x = torch.randn(T, C + 8).to(dt)[:, 5 : 5 + C]  # row stride C + 8
        w = torch.randn(C, W)
        cs = torch.randn(NS, C, W - 1).to(dt)
        cs0 = cs.clone()
        y = causal_conv1d(x, w, cs, slots, qsl, hi, max(lens))
        assert y.dtype == dt and y.shape == (T, C)
        touched = set()
        for b in range(len(lens)):
            s, e, sl = int(qsl[b]), int(qsl[b + 1]), int(slots[b])
            if e == s:
                continue
            touched.add(sl)
            st0 = cs0[sl].float() if init[b] else None
            yr, sr = causal_conv1d_ref(x[s:e].float(), w, st0)
            if dt == torch.float32:
                worst = max(worst, (y[s:e] - yr).abs().max().item())
            else:  # one rounding to fp16 (2^-11 relative)
                assert ((y[s:e].float() - yr).abs() <= 1e-3 * yr.abs() + 1e-4).all(), ("fp16 conv", ci, b)
            assert torch.equal(cs[sl], sr.to(dt)), ("conv state", ci, b)
        for sl in range(NS):
            if sl not in touched:
                assert torch.equal(cs[sl], cs0[sl]), ("untouched slot changed", ci, sl)

    # ---- recurrent: q/k/v strided views of one conv output, every block size --------------------
    Hk, Hv, Dk, Dv = 2, 4, 16, 16
    rcases = [([5, 0, 1, 17, 2, 1], [True, True, False, True, False, True], torch.int32, 16, True),
              ([1, 1, 0, 1], [True, False, True, True], torch.int64, 8, True),
              ([3, 2], [False, True], torch.int64, None, False)]
    for ci, (lens, init, sdt, bv, inter_on) in enumerate(rcases):
        qsl, slots, hi = batch(lens, init, sdt, 10 + ci)
        T = int(qsl[-1]) + 1
        mixed = torch.randn(T, 2 * Hk * Dk + Hv * Dv + 3)
        q = mixed[:, : Hk * Dk].view(T, Hk, Dk)
        k = mixed[:, Hk * Dk : 2 * Hk * Dk].view(T, Hk, Dk)
        v = mixed[:, 2 * Hk * Dk : 2 * Hk * Dk + Hv * Dv].view(T, Hv, Dv)
        ab = torch.randn(T, 2 * Hv + 1)
        a, b_ = ab[:, :Hv], ab[:, Hv : 2 * Hv]  # strided rows
        A_log = torch.rand(Hv) * 2.5  # A in [1, 12]
        dtb = torch.randn(Hv)
        ss = torch.randn(NS, Hv, Dk, Dv)
        ss0 = ss.clone()
        inter = torch.full((T, Hv, Dk, Dv), float("nan")) if inter_on else None
        o = gdn_recurrent(q, k, v, a, b_, A_log, dtb, ss, slots, qsl, hi, max(lens), inter, block_v=bv)
        g = -A_log.exp() * F.softplus(a + dtb)
        beta = torch.sigmoid(b_)
        touched = set()
        for b in range(len(lens)):
            s, e, sl = int(qsl[b]), int(qsl[b + 1]), int(slots[b])
            if e == s:
                continue
            touched.add(sl)
            orf, allst = gdn_recurrent_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                           ss0[sl] if init[b] else None, output_all_states=True)
            worst = max(worst, (o[s:e] - orf).abs().max().item(), (ss[sl] - allst[-1]).abs().max().item())
            if inter is not None:
                worst = max(worst, (inter[s:e] - allst).abs().max().item())
        for sl in range(NS):
            if sl not in touched:
                assert torch.equal(ss[sl], ss0[sl]), ("untouched ssm slot changed", ci, sl)
    print(worst)
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_interpreter_conv_and_recurrent():
    """causal_conv1d and gdn_recurrent under Triton's CPU interpreter (fp32/fp16 inputs).

    Runs in a subprocess: TRITON_INTERPRET must be set before the kernels are first compiled.
    """
    if _triton_version() < (3, 9):
        pytest.skip("the interpreter test needs triton >= 3.9 (3.6's fails in range(runtime_bound))")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert float(res.stdout.strip().splitlines()[-1]) < 1e-4


_BF16_STATE_SCRIPT = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from vibeqwen_kernels import gdn_recurrent_ref
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    def ulp(x):  # bf16 spacing at |x|
        return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126))) - 7)

    torch.manual_seed(1)
    NS, Hk, Hv, Dk, Dv = 9, 2, 4, 16, 16
    worst = 0.0
    cases = [([5, 0, 1, 17, 2, 1], [True, True, False, True, False, True], torch.int32, 16),  # verify + prefill
             ([1, 1, 0, 1], [True, False, True, True], torch.int64, 8)]  # decode
    for ci, (lens, init, sdt, bv) in enumerate(cases):
        g = torch.Generator().manual_seed(20 + ci)
        qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(lens).cumsum(0)
        slots, hi = torch.randperm(NS, generator=g)[: len(lens)].to(sdt), torch.tensor(init)
        T = int(qsl[-1]) + 1  # one row past the last sequence: its per-token state stays unwritten
        mixed = torch.randn(T, 2 * Hk * Dk + Hv * Dv + 3)
        q = mixed[:, : Hk * Dk].view(T, Hk, Dk)
        k = mixed[:, Hk * Dk : 2 * Hk * Dk].view(T, Hk, Dk)
        v = mixed[:, 2 * Hk * Dk : 2 * Hk * Dk + Hv * Dv].view(T, Hv, Dv)
        a, b_ = torch.randn(T, Hv), torch.randn(T, Hv)
        A_log, dtb = torch.rand(Hv) * 2.5, torch.randn(Hv)
        ss = torch.randn(NS, Hv, Dk, Dv).to(torch.bfloat16)
        ss0 = ss.clone()
        inter = torch.full((T, Hv, Dk, Dv), float("nan"), dtype=torch.bfloat16)
        o = gdn_recurrent(q, k, v, a, b_, A_log, dtb, ss, slots, qsl, hi, max(lens), inter, block_v=bv)
        assert ss.dtype == inter.dtype == torch.bfloat16 and o.dtype == torch.float32
        gg = -A_log.exp() * F.softplus(a + dtb)
        beta = torch.sigmoid(b_)
        touched = set()
        for i in range(len(lens)):
            s, e, sl = int(qsl[i]), int(qsl[i + 1]), int(slots[i])
            if e == s:
                continue
            touched.add(sl)
            # fp32 math from the stored (bf16) initial state; the running state never rounded
            orf, allst = gdn_recurrent_ref(q[s:e], k[s:e], v[s:e], gg[s:e], beta[s:e], ss0[sl] if init[i] else None,
                                           output_all_states=True)
            worst = max(worst, (o[s:e] - orf).abs().max().item())
            for got, ref in ((ss[sl], allst[-1]), (inter[s:e], allst)):
                assert got.dtype == torch.bfloat16
                worst = max(worst, ((got.float() - ref).abs() - ulp(ref)).max().item())
        assert inter[-1].isnan().all(), "a row of no sequence was written"
        for sl in range(NS):
            if sl not in touched:
                assert torch.equal(ss[sl], ss0[sl]), ("untouched ssm slot changed", ci, sl)
    print(worst)
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_interpreter_recurrent_bf16_states():
    """gdn_recurrent with bf16 state slots and bf16 per-token states (EngineConfig.gdn_state_dtype "bfloat16")
    under the interpreter, on fresh random inputs: outputs equal the fp32 reference from the stored bf16 state
    (1e-4), and every stored state (final and per-token) is that reference's fp32 state rounded once to bf16 (one
    ulp: the interpreter truncates; +1e-5 summation order). Padding sequences and untouched slots stay as they
    were."""
    assert _run_interpreted(_BF16_STATE_SCRIPT) < 1e-5


_NORM_TAIL_SCRIPT = textwrap.dedent(
    """
    import torch
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent, norm_tail_counter
    from vibeqwen_kernels.norm_fused import gated_rms_norm

    NS, Hk, Hv, Dk, Dv = 9, 2, 4, 16, 16
    worst = 0.0
    counter = norm_tail_counter(Hv, "cpu")
    # decode (a padding sequence among them), then verification / prefill lengths with per-token states; block_v 4
    # and 8: 4 and 2 programs a head, so the tail runs in different programs; each case twice on one counter
    cases = [([1, 1, 0, 1], [True, False, True, True], 4, False), ([5, 0, 1, 17, 2, 1], [True] * 6, 8, True)]
    for ci, (lens, init, bv, keep) in enumerate(cases):
        for rep in range(2):
            g = torch.Generator().manual_seed(40 + 2 * ci + rep)
            qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
            qsl[1:] = torch.tensor(lens).cumsum(0)
            slots, hi = torch.randperm(NS, generator=g)[: len(lens)].to(torch.int32), torch.tensor(init)
            T = int(qsl[-1])
            mixed = torch.randn(T, 2 * Hk * Dk + 2 * Hv * Dv, generator=g)
            q = mixed[:, : Hk * Dk].view(T, Hk, Dk)
            k = mixed[:, Hk * Dk : 2 * Hk * Dk].view(T, Hk, Dk)
            v = mixed[:, 2 * Hk * Dk : 2 * Hk * Dk + Hv * Dv].view(T, Hv, Dv)
            z = mixed[:, 2 * Hk * Dk + Hv * Dv :].view(T, Hv, Dv)  # strided, as the projection's column view
            a, b_ = torch.randn(T, Hv, generator=g), torch.randn(T, Hv, generator=g)
            A_log, dtb = torch.rand(Hv, generator=g) * 2.5, torch.randn(Hv, generator=g)
            nw = torch.randn(Dv, generator=g)
            ss = torch.randn(NS, Hv, Dk, Dv, generator=g)
            ss_tail = ss.clone()
            inter = torch.empty(T, Hv, Dk, Dv) if keep else None
            inter_tail = torch.empty(T, Hv, Dk, Dv) if keep else None
            o = gdn_recurrent(q, k, v, a, b_, A_log, dtb, ss, slots, qsl, hi, max(lens), inter, block_v=bv)
            want = gated_rms_norm(o, z, nw, 1e-6)
            o_tail = torch.full_like(o, float("nan"))
            y = gdn_recurrent(q, k, v, a, b_, A_log, dtb, ss_tail, slots, qsl, hi, max(lens), inter_tail, block_v=bv,
                              out=o_tail, gated_norm=(z, nw, 1e-6, counter))
            assert torch.equal(counter, torch.zeros_like(counter)), ("counter not zero again", ci, rep)
            assert torch.equal(o_tail, o) and torch.equal(ss_tail, ss), ("o or the states changed", ci, rep)
            assert not keep or torch.equal(inter_tail, inter)
            assert y.shape == o.shape and y.dtype == o.dtype and y.is_contiguous()
            worst = max(worst, (y - want).abs().max().item())
            assert (y - want).abs().max().item() < 1e-6, (ci, rep)
    print(worst)
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_interpreter_recurrent_norm_tail():
    """gdn_recurrent's gated-norm tail (``gated_norm``) under the interpreter, on fresh random inputs: y equals
    gated_rms_norm of the kernel's own o (the same rounding steps, fp32 here), o, the final and per-token states are
    those of the launch without the tail, for decode and multi-token sequences (a padding one among them) with 2 and
    4 programs a head; the counter is zero after every launch, so the second launch on it norms too."""
    assert _run_interpreted(_NORM_TAIL_SCRIPT) < 1e-6


def test_norm_tail_rejects_bad_inputs():
    """gated_norm's checks name what is wrong, before anything launches."""
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent, norm_tail_counter

    t, hk, hv, dk, dv = 2, 1, 2, 8, 8
    q = torch.randn(t, hk, dk)
    v = torch.randn(t, hv, dv)
    args = (q, q.clone(), v, torch.randn(t, hv), torch.randn(t, hv), torch.rand(hv), torch.randn(hv),
            torch.randn(4, hv, dk, dv), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([True, True]), 1)
    z, w, cnt = torch.randn(t, hv, dv), torch.randn(dv), norm_tail_counter(hv, "cpu")
    for bad, what in [((z[:1], w, 1e-6, cnt), "z must be"), ((z, w[:4], 1e-6, cnt), "weight must be"),
                      ((z, w, 1e-6, cnt.float()), "counter must be"), ((z, w, 1e-6, cnt[:3]), "counter must be"),
                      ((z, w), "tuple"), ((z.transpose(1, 2), w, 1e-6, cnt), "z must be")]:
        with pytest.raises(ValueError, match=what):
            gdn_recurrent(*args, gated_norm=bad)


def test_norm_tail_switch(monkeypatch):
    """VIBEQWEN_GDN_NORM_TAIL: on by default, 0 off, anything else an error naming the variable."""
    from vibeqwen_kernels.gdn.recurrent import norm_tail

    monkeypatch.delenv("VIBEQWEN_GDN_NORM_TAIL", raising=False)
    assert norm_tail()
    monkeypatch.setenv("VIBEQWEN_GDN_NORM_TAIL", "0")
    assert not norm_tail()
    monkeypatch.setenv("VIBEQWEN_GDN_NORM_TAIL", "yes")
    with pytest.raises(ValueError, match="VIBEQWEN_GDN_NORM_TAIL"):
        norm_tail()


_GRAPH_PATH_SCRIPT = textwrap.dedent(
    """
    import torch
    from vibeqwen_kernels import gdn_recurrent_ref
    from vibeqwen_kernels.gdn import chunk_fla

    calls = []

    def fake_fla(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 cu_seqlens=None, cu_seqlens_cpu=None):
        # the reference on the whole padded bucket: the padding tokens themselves go through the math. q and k
        # come L2-normalised (gdn_padded_inputs did it; the reference normalises again: a no-op within 1e-6)
        assert cu_seqlens is None and q.shape[0] == 1 and output_final_state and not use_qk_l2norm_in_kernel
        assert torch.allclose(k.float().norm(dim=-1)[k.float().norm(dim=-1) > 0], torch.tensor(1.0), atol=1e-5)
        assert initial_state.dtype == torch.float32  # a bf16 slot is upcast into the graph's fp32 h0
        calls.append(q.shape[1])
        o, ht = gdn_recurrent_ref(q[0], k[0], v[0], g[0], beta[0], initial_state[0])
        return o[None].to(v.dtype), ht[None]

    chunk_fla._fla_chunk = lambda: fake_fla
    SDT = torch.float32  # the state slots' dtype (EngineConfig.gdn_state_dtype); the test also runs it with bf16
    def ulp(x):  # bf16 spacing at |x|: a bf16 slot holds the fp32 state rounded once (truncated by the interpreter)
        return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -126))) - 7)
    HK, HV, DK, DV, NS = 2, 4, 16, 16, 12
    graphs = chunk_fla.ChunkPrefillGraphs(HK, HV, DK, DV, torch.float32, "cpu", max_tokens=64, min_tokens=32)
    worst = 0.0
    # decode tokens and prompt chunks mixed: runs of short sequences (recurrent kernel) around long ones
    # (one padded bucket each), an empty sequence, a sequence of exactly GRAPH_MIN_TOKENS, one of a full bucket
    for case, (lens, init) in enumerate([
            ([1, 3, 0, 40, 2, 17, 1, 20, 16], [True, True, True, False, True, True, False, True, True]),
            ([33, 5, 64], [True, False, True]),
            ([1, 1, 2], [True, True, False])]):
        g = torch.Generator().manual_seed(case)
        qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(lens).cumsum(0)
        slots = torch.randperm(NS, generator=g)[: len(lens)]
        hi = torch.tensor(init)
        t = int(qsl[-1])
        mixed = torch.randn(t, 2 * HK * DK + HV * DV + 8, generator=g)
        q = mixed[:, : HK * DK].view(t, HK, DK)
        k = mixed[:, HK * DK : 2 * HK * DK].view(t, HK, DK)
        v = mixed[:, 2 * HK * DK : 2 * HK * DK + HV * DV].view(t, HV, DV)
        a, b = torch.randn(t, HV, generator=g), torch.randn(t, HV, generator=g)
        A_log, dt_bias = torch.rand(HV, generator=g) + 0.5, torch.randn(HV, generator=g)
        ss = torch.randn(NS, HV, DK, DV, generator=g).to(SDT)
        ss0 = ss.clone()
        n_calls = len(calls)
        o = chunk_fla.gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, max(lens),
                                        query_start_loc_cpu=qsl.clone(), graphs=graphs)
        assert calls[n_calls:] == [graphs.bucket(n) for n in lens if n > chunk_fla.GRAPH_MIN_TOKENS], calls
        gg = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
        beta = torch.sigmoid(b)
        touched = set()
        for i, n in enumerate(lens):
            s, e, sl = int(qsl[i]), int(qsl[i + 1]), int(slots[i])
            if n == 0:
                continue
            touched.add(sl)
            orf, sref = gdn_recurrent_ref(q[s:e], k[s:e], v[s:e], gg[s:e], beta[s:e], ss0[sl] if init[i] else None)
            assert ss.dtype == SDT
            rounding = ulp(sref) if SDT == torch.bfloat16 else 0.0
            worst = max(worst, (o[s:e] - orf).abs().max().item(),
                        ((ss[sl].float() - sref).abs() - rounding).max().item())
        for sl in range(NS):
            if sl not in touched:
                assert torch.equal(ss[sl], ss0[sl]), ("untouched slot changed", case, sl)
    assert sorted(graphs.graphs) == [32, 64], sorted(graphs.graphs)
    print(worst)
    """
)


def _run_interpreted(script: str) -> float:
    """Run a script in a subprocess under Triton's interpreter (TRITON_INTERPRET must be set before the kernels
    are first compiled; no CUDA device); return the number its last output line prints. Skips before triton 3.9
    (3.6's interpreter fails in range(runtime_bound))."""
    if _triton_version() < (3, 9):
        pytest.skip("the interpreter test needs triton >= 3.9 (3.6's fails in range(runtime_bound))")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return float(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_interpreter_chunk_prefill_graph_path(state_dtype):
    """gdn_chunk_prefill with ChunkPrefillGraphs (no capture on the CPU: the same padded buffers run eagerly)
    on batches mixing decode tokens with prompt chunks: every sequence longer than GRAPH_MIN_TOKENS runs
    padded to its bucket (fla replaced by the fp32 reference, which sees the padding tokens), runs of
    shorter ones run the recurrent kernel (interpreted); outputs and final states equal the reference per
    sequence, untouched slots stay as they were. With bf16 state slots the graphs get the slot upcast (fp32 h0)
    and each final state is the reference's rounded once (within a bf16 ulp: the interpreter truncates)."""
    script = _GRAPH_PATH_SCRIPT.replace("SDT = torch.float32", f"SDT = torch.{state_dtype}")
    assert script != _GRAPH_PATH_SCRIPT or state_dtype == "float32"
    assert _run_interpreted(script) < 1e-4

_PADDED_INPUTS_SCRIPT = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from vibeqwen_kernels.gdn.chunk_fla import gdn_padded_inputs

    torch.manual_seed(0)
    B, hk, hv, dk, dv = 37, 2, 4, 16, 8
    worst = 0.0
    for n in (37, 20, 0):
        conv = torch.randn(B, 2 * hk * dk + hv * dv)
        conv[n:] = float("nan")  # padding rows hold garbage: it must not survive
        q = conv[:, : hk * dk].view(B, hk, dk)  # strided rows, as the conv output's views
        k = conv[:, hk * dk : 2 * hk * dk].view(B, hk, dk)
        v = conv[:, 2 * hk * dk :].view(B, hv, dv)
        ab = torch.randn(B, 2 * hv) * 8
        ab[n:] = float("nan")
        a, b = ab[:, :hv], ab[:, hv:]
        A_log, dt_bias = torch.randn(hv), torch.randn(hv)
        states = torch.randn(5, hv, dk, dv)
        for init in (True, False):
            nt = torch.tensor([n])
            qo, ko, vo, g, beta, h0 = gdn_padded_inputs(q, k, v, a, b, A_log, dt_bias, nt, states, torch.tensor([3]),
                                                        torch.tensor([init]))
            keep = (torch.arange(B) < n)
            for got, x in ((qo, q), (ko, k), (vo, v)):
                assert got.is_contiguous() and torch.equal(got, torch.where(keep[:, None, None], x, 0.0))
            g_ref = torch.where(keep[:, None], -A_log.exp() * F.softplus(a + dt_bias), 0.0)
            beta_ref = torch.where(keep[:, None], torch.sigmoid(b), 0.0)
            worst = max(worst, (g - g_ref).abs().max().item(), (beta - beta_ref).abs().max().item())
            assert torch.equal(h0, states[3] if init else torch.zeros_like(states[3]))
            # a bf16 state slot (EngineConfig.gdn_state_dtype): h0 is its fp32 upcast (exact)
            sb = states.to(torch.bfloat16)
            *_, h0b = gdn_padded_inputs(q, k, v, a, b, A_log, dt_bias, nt, sb, torch.tensor([3]), torch.tensor([init]))
            assert h0b.dtype == torch.float32 and torch.equal(h0b, sb[3].float() if init else torch.zeros_like(h0))
            _, _, _, g2, _, none = gdn_padded_inputs(q, k, v, a, b, A_log, dt_bias, nt)
            assert none is None and torch.equal(g2, g)
            # q, k L2-normalised per head on the way (fla's l2norm: x / sqrt(sum x^2 + 1e-6)), padding still zero
            qn, kn, vn, _, _, _ = gdn_padded_inputs(q, k, v, a, b, A_log, dt_bias, nt, l2norm_qk=True)
            for got, x in ((qn, q), (kn, k)):
                ref = torch.where(keep[:, None, None], x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6), 0.0)
                assert got.is_contiguous() and not got.isnan().any()
                worst = max(worst, (got - ref).abs().max().item())
            assert torch.equal(vn, vo)
    print(worst)
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.slow
def test_interpreter_padded_inputs():
    """gdn_padded_inputs' kernel under Triton's interpreter: strided q, k, v rows copied contiguous, padding rows
    (NaN here) zeroed in q, k, v, g and beta, the gates against torch's formulas, h0 from the slot (fp32 or bf16,
    upcast to fp32) or zeros, and q, k L2-normalised per head when asked."""
    assert _run_interpreted(_PADDED_INPUTS_SCRIPT) < 1e-5


def test_padded_inputs_rejects_bad_inputs():
    """Mismatched shapes get a ValueError naming the argument (the kernel would read out of bounds)."""
    from vibeqwen_kernels.gdn.chunk_fla import gdn_padded_inputs

    q, k, v = torch.randn(6, 1, 4), torch.randn(6, 1, 4), torch.randn(6, 2, 4)
    a, b, p2, n = torch.randn(6, 2), torch.randn(6, 2), torch.zeros(2), torch.tensor([4])
    st, slot, init = torch.randn(2, 2, 4, 4), torch.tensor([1]), torch.tensor([True])
    with pytest.raises(ValueError, match="q, k must be"):
        gdn_padded_inputs(q, torch.randn(6, 2, 4), v, a, b, p2, p2, n)
    with pytest.raises(ValueError, match="q, k must be"):
        gdn_padded_inputs(q, k, v[:5], a, b, p2, p2, n)
    with pytest.raises(ValueError, match="a and b must be"):
        gdn_padded_inputs(q, k, v, a[:, :1], b, p2, p2, n)
    with pytest.raises(ValueError, match="A_log and dt_bias"):
        gdn_padded_inputs(q, k, v, a, b, torch.zeros(3), p2, n)
    with pytest.raises(ValueError, match="n must be"):
        gdn_padded_inputs(q, k, v, a, b, p2, p2, 4)
    with pytest.raises(ValueError, match="together"):
        gdn_padded_inputs(q, k, v, a, b, p2, p2, n, st)
    with pytest.raises(ValueError, match="ssm_states must be"):
        gdn_padded_inputs(q, k, v, a, b, p2, p2, n, torch.randn(2, 2, 4, 3), slot, init)
    with pytest.raises(ValueError, match="ssm_states must be fp32 or bf16"):
        gdn_padded_inputs(q, k, v, a, b, p2, p2, n, st.half(), slot, init)
    with pytest.raises(ValueError, match="has_initial_state bool"):
        gdn_padded_inputs(q, k, v, a, b, p2, p2, n, st, slot, init.int())


def test_padded_inputs_torch_path(monkeypatch):
    """Outside CUDA and the interpreter, gdn_padded_inputs runs torch ops with the same results (NaN padding)."""
    from vibeqwen_kernels.gdn.chunk_fla import gdn_padded_inputs

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = torch.randn(6, 1, 4), torch.randn(6, 1, 4), torch.randn(6, 2, 4)
    a, b = torch.randn(6, 2), torch.randn(6, 2)
    for x in (q, k, v, a, b):
        x[4:] = float("nan")
    qo, ko, vo, g, beta, h0 = gdn_padded_inputs(q, k, v, a, b, torch.zeros(2), torch.zeros(2), torch.tensor([4]),
                                                torch.randn(2, 2, 4, 4), torch.tensor([1]), torch.tensor([False]))
    assert torch.equal(qo[4:], torch.zeros(2, 1, 4)) and torch.equal(qo[:4], q[:4])
    assert torch.equal(g[4:], torch.zeros(2, 2)) and torch.equal(beta[4:], torch.zeros(2, 2))
    assert torch.allclose(beta[:4], torch.sigmoid(b[:4])) and torch.equal(h0, torch.zeros(2, 4, 4))
    states = torch.randn(2, 2, 4, 4).to(torch.bfloat16)  # a bf16 slot (EngineConfig.gdn_state_dtype): upcast
    *_, h0 = gdn_padded_inputs(q, k, v, a, b, torch.zeros(2), torch.zeros(2), torch.tensor([4]), states,
                               torch.tensor([1]), torch.tensor([True]))
    assert h0.dtype == torch.float32 and torch.equal(h0, states[1].float())


def test_rejects_bad_inputs(monkeypatch):
    from vibeqwen_kernels.conv1d.causal import causal_conv1d
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qsl, slots, hi = _batch([1, 2], [True, False], 4, "cpu")
    x, w, cs = torch.randn(3, 8), torch.randn(8, 4), torch.randn(4, 8, 3)
    with pytest.raises(ValueError, match="needs CUDA"):
        causal_conv1d(x, w, cs, slots, qsl, hi, 2)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.randn(7, 4), cs, slots, qsl, hi, 2)
    with pytest.raises(ValueError, match="conv_states"):
        causal_conv1d(x, w, torch.randn(4, 8, 4), slots, qsl, hi, 2)
    with pytest.raises(ValueError, match="has_initial_state"):
        causal_conv1d(x, w, cs, slots, qsl, hi.int(), 2)
    q = torch.randn(3, 1, 16)
    v = torch.randn(3, 2, 16)
    ab = torch.randn(3, 2)
    p = torch.zeros(2)
    ss = torch.zeros(4, 2, 16, 16)
    with pytest.raises(ValueError, match="needs CUDA"):
        gdn_recurrent(q, q, v, ab, ab, p, p, ss, slots, qsl, hi, 2)
    with pytest.raises(ValueError, match="ssm_states"):
        gdn_recurrent(q, q, v, ab, ab, p, p, ss.half(), slots, qsl, hi, 2)
    with pytest.raises(ValueError, match="intermediate_states"):
        gdn_recurrent(q, q, v, ab, ab, p, p, ss, slots, qsl, hi, 2, torch.zeros(3, 2, 16, 8))
    # bf16 states pass the checks (EngineConfig.gdn_state_dtype); both state tensors must share the dtype
    with pytest.raises(ValueError, match="needs CUDA"):
        gdn_recurrent(q, q, v, ab, ab, p, p, ss.bfloat16(), slots, qsl, hi, 2, torch.zeros(3, 2, 16, 16).bfloat16())
    with pytest.raises(ValueError, match="one dtype"):
        gdn_recurrent(q, q, v, ab, ab, p, p, ss.bfloat16(), slots, qsl, hi, 2, torch.zeros(3, 2, 16, 16))
    with pytest.raises(ValueError, match="one dtype"):
        gdn_recurrent(q, q, v, ab, ab, p, p, ss, slots, qsl, hi, 2, torch.zeros(3, 2, 16, 16).bfloat16())
    q2 = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        gdn_recurrent(
            q2,
            q2,
            torch.randn(3, 3, 16),
            torch.randn(3, 3),
            torch.randn(3, 3),
            torch.zeros(3),
            torch.zeros(3),
            torch.zeros(4, 3, 16, 16),
            slots,
            qsl,
            hi,
            2,
        )


def test_fla_import_error_message(monkeypatch):
    from vibeqwen_kernels.gdn import chunk_fla

    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setitem(sys.modules, "fla.ops", None)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    assert not chunk_fla.fla_available()
    with pytest.raises(ImportError, match="fla-core"):
        chunk_fla._fla_chunk()


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
@pytest.mark.parametrize("host_offsets", [False, True])
def test_fla_wrapper_bookkeeping(monkeypatch, host_offsets, state_dtype):
    """gdn_chunk_prefill's gather / scatter / varlen bookkeeping on the CPU, with fla replaced by a fake
    that checks fla's calling convention and runs the reference per sequence; with host_offsets the
    offsets come from the caller's host copy (no device read), which must give the same result. With bf16
    state slots (EngineConfig.gdn_state_dtype) fla still gets an fp32 initial state (the slot upcast, exact) and
    the final state is rounded once to the slot's dtype."""
    from vibeqwen_kernels.gdn import chunk_fla

    calls = []

    def fake_fla(
        q,
        k,
        v,
        g,
        beta,
        *,
        scale,
        initial_state,
        output_final_state,
        use_qk_l2norm_in_kernel,
        cu_seqlens,
        cu_seqlens_cpu,
    ):
        assert q.dim() == 4 and q.shape[0] == 1 and q.is_contiguous() and v.is_contiguous()
        assert (
            g.dtype == torch.float32 and beta.dtype == torch.float32 and g.shape == beta.shape == v.shape[:3]
        )
        assert output_final_state and use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5
        assert cu_seqlens.dtype == torch.int64 and cu_seqlens_cpu.device.type == "cpu"
        assert torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu) and int(cu_seqlens_cpu[0]) == 0
        assert int(cu_seqlens_cpu[-1]) == q.shape[1] and initial_state.shape[0] == len(cu_seqlens) - 1
        assert initial_state.dtype == torch.float32
        calls.append(cu_seqlens_cpu.tolist())
        o = torch.empty_like(v)
        hts = []
        for n in range(len(cu_seqlens_cpu) - 1):
            s, e = int(cu_seqlens_cpu[n]), int(cu_seqlens_cpu[n + 1])
            assert e > s, "empty sequences must not reach fla"
            o[0, s:e], ht = gdn_recurrent_ref(
                q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e], initial_state[n]
            )
            hts.append(ht)
        return o, torch.stack(hts)

    monkeypatch.setattr(chunk_fla, "_fla_chunk", lambda: fake_fla)
    hk, hv, dk, dv = 2, 4, 8, 8
    lens, init = [0, 3, 0, 5, 1], [True, True, False, False, True]
    qsl, slots, hi = _batch(lens, init, 7, "cpu", torch.int64, seed=4)
    qsl = qsl + 2  # the batch starts at token 2 (rows 0-1 belong to nobody)
    t = int(qsl[-1]) + 1
    mixed = torch.randn(t, 2 * hk * dk + hv * dv)
    q = mixed[:, : hk * dk].view(t, hk, dk)
    k = mixed[:, hk * dk : 2 * hk * dk].view(t, hk, dk)
    v = mixed[:, 2 * hk * dk :].view(t, hv, dv)
    a, b = torch.randn(t, hv), torch.randn(t, hv)
    A_log, dt_bias = torch.rand(hv), torch.randn(hv)
    ss = torch.randn(7, hv, dk, dv).to(state_dtype)
    ss[int(slots[3])] = float("nan")  # a new sequence's slot may hold garbage
    ss0 = ss.clone()
    if host_offsets:
        # a device copy that disagrees with the host copy shows which one the wrapper read
        o = chunk_fla.gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, ss, slots, torch.zeros_like(qsl), hi,
                                        max(lens), query_start_loc_cpu=qsl.clone())
    else:
        o = chunk_fla.gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, max(lens))
    assert calls == [[0, 3, 8, 9]]
    g, beta = _gates(a, b, A_log, dt_bias)
    touched = set()
    for i, (s, e, sl) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), slots.tolist())):
        if e == s:
            continue
        touched.add(sl)
        orf, sref = gdn_recurrent_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], ss0[sl] if init[i] else None)
        torch.testing.assert_close(o[s:e], orf)
        assert ss.dtype == state_dtype
        if state_dtype == torch.float32:
            torch.testing.assert_close(ss[sl], sref)
        else:  # the state the fake fla computed (fp32), rounded once to nearest: within half a bf16 ulp (+ op order)
            assert ((ss[sl].float() - sref).abs() - 0.5 * _bf16_ulp(sref)).max() <= 1e-5
    for sl in range(7):
        if sl not in touched:
            assert torch.equal(ss[sl], ss0[sl])


# ----------------------------------------------------------------------------------------------------
# GPU, real shapes (Hk 16, Hv 32, Dk = Dv = 128, C 8192, W 4), bf16 activations

HK, HV, DK, DV, W = 16, 32, 128, 128, 4
C = 2 * HK * DK + HV * DV


def _gdn_inputs(t, device, seed):
    """mixed [T, C + pad] bf16 (q|k|v are strided views of it, as in the model), a, b, A_log, dt_bias."""
    gen = torch.Generator(device=device).manual_seed(seed)
    mixed = torch.randn(t, C + 64, device=device, generator=gen).to(torch.bfloat16)
    q = mixed[:, : HK * DK].view(t, HK, DK)
    k = mixed[:, HK * DK : 2 * HK * DK].view(t, HK, DK)
    v = mixed[:, 2 * HK * DK : C].view(t, HV, DV)
    a = torch.randn(t, HV, device=device, generator=gen).to(torch.bfloat16)
    b = torch.randn(t, HV, device=device, generator=gen).to(torch.bfloat16)
    A_log = torch.log(torch.rand(HV, device=device, generator=gen) * 15 + 1)  # A in [1, 16], HF init
    dt_bias = torch.rand(HV, device=device, generator=gen) - 0.5
    return q, k, v, a, b, A_log, dt_bias


def _check_recurrent(o, ss, ss0, inter, q, k, v, a, b, A_log, dt_bias, qsl, slots, init, o_tol, s_tol):
    g, beta = _gates(a, b, A_log, dt_bias)
    qsl_l, slots_l = qsl.tolist(), slots.tolist()
    touched = set()
    for i in range(len(slots_l)):
        s, e, sl = qsl_l[i], qsl_l[i + 1], slots_l[i]
        if e == s:
            continue
        touched.add(sl)
        orf, allst = gdn_recurrent_ref(
            q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], ss0[sl] if init[i] else None, output_all_states=True
        )
        assert torch.isfinite(o[s:e].float()).all()
        assert _rel(o[s:e], orf) <= o_tol, (i, _rel(o[s:e], orf))
        assert _rel(ss[sl], allst[-1]) <= s_tol, (i, _rel(ss[sl], allst[-1]))
        if inter is not None:
            assert _rel(inter[s:e], allst) <= s_tol
    for sl in range(ss.shape[0]):
        if sl not in touched:
            assert torch.equal(ss[sl], ss0[sl]), sl


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_conv1d_gpu(slot_dtype):
    from vibeqwen_kernels.conv1d.causal import causal_conv1d

    dev = torch.device("cuda")
    for lens, init in [
        (LENS, INIT),
        ([1] * 64, [True] * 63 + [False]),
        ([300, 0, 1000], [True, True, False]),
    ]:
        qsl, slots, hi = _batch(lens, init, 80, dev, slot_dtype, seed=len(lens))
        t = int(qsl[-1])
        x = torch.randn(t, C + 2048, device=dev).to(torch.bfloat16)[:, 1024 : 1024 + C]  # strided rows
        w = (torch.randn(C, W, device=dev) * 0.5).to(torch.bfloat16)
        cs = torch.randn(80, C, W - 1, device=dev).to(torch.bfloat16)
        cs0 = cs.clone()
        y = causal_conv1d(x, w, cs, slots, qsl, hi, max(lens))
        touched = set()
        for i, (s, e, sl) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), slots.tolist())):
            if e == s:
                continue
            touched.add(sl)
            yr, sr = causal_conv1d_ref(x[s:e].float(), w.float(), cs0[sl].float() if init[i] else None)
            rms = yr.pow(2).mean().sqrt().item()
            torch.testing.assert_close(y[s:e].float(), yr, rtol=8e-3, atol=1e-3 * rms)
            assert torch.equal(cs[sl], sr.to(torch.bfloat16))
        for sl in range(80):
            if sl not in touched:
                assert torch.equal(cs[sl], cs0[sl])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("nb", [1, 7, 64], ids=lambda n: f"B{n}")
@pytest.mark.parametrize("with_inter", [False, True], ids=["final", "all-states"])
def test_recurrent_gpu_decode(nb, with_inter):
    """Decode (q_len 1) and speculative verification (q_len 1..9, one padding sequence), real shapes."""
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    dev = torch.device("cuda")
    lens, init, (qsl, slots, hi) = _step_batch(nb, with_inter, dev, seed=nb)
    t = int(qsl[-1])
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(t, dev, seed=nb)
    ss = torch.randn(nb + 5, HV, DK, DV, device=dev) * 0.5
    ss0 = ss.clone()
    inter = torch.full((t, HV, DK, DV), float("nan"), device=dev) if with_inter else None
    o = gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, max(lens), inter)
    assert o.dtype == torch.bfloat16
    _check_recurrent(o, ss, ss0, inter, q, k, v, a, b, A_log, dt_bias, qsl, slots, init, 4e-3, 1e-4)


def _assert_norm_close(y, want):
    """The norm tail's y against the norm kernel's: equal but for the sum of squares' order, which can flip the
    rounded norm by one bf16 ulp now and then; w * n and the product with silu(z) (up to ~4 here) carry such a flip
    into y as up to a few of y's ulps (4 allowed; a stale or misplaced o is off by O(1)). 99% must be equal."""
    d = (y.float() - want.float()).abs()
    assert (d <= 4 * _bf16_ulp(want)).all(), d.max().item()
    assert (d == 0).float().mean().item() > 0.99, (d == 0).float().mean().item()


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("nb", [1, 8, 31], ids=lambda n: f"B{n}")
@pytest.mark.parametrize("with_inter", [False, True], ids=["decode", "verify"])
def test_recurrent_gpu_norm_tail(nb, with_inter):
    """The gated-norm tail at real shapes: o, the final and per-token states bit for bit those of the launch
    without it; y the norm kernel's on that o up to summation order; the counter zero after every launch; in a
    CUDA graph under early launch, three replays on new inputs equal eager launches bit for bit."""
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent, norm_tail_counter
    from vibeqwen_kernels.norm_fused import gated_rms_norm
    from vibeqwen_kernels.pdl import early_launch

    dev = torch.device("cuda")
    lens, init, (qsl, slots, hi) = _step_batch(nb, with_inter, dev, seed=100 + nb, slot_seed=nb)
    t = int(qsl[-1])
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(t, dev, seed=nb)
    zbuf = torch.randn(t, 2 * HV * DV, device=dev).to(torch.bfloat16)
    z = zbuf[:, HV * DV :].view(t, HV, DV)  # a column view, as the model's
    nw = torch.randn(DV, device=dev).to(torch.bfloat16)
    counter = norm_tail_counter(HV, dev)
    ss = torch.randn(nb + 5, HV, DK, DV, device=dev) * 0.5
    ss_tail = ss.clone()
    inter = torch.empty((t, HV, DK, DV), device=dev) if with_inter else None
    inter_tail = torch.empty((t, HV, DK, DV), device=dev) if with_inter else None
    o = gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, max(lens), inter)
    o_tail = torch.empty_like(o)
    y = gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ss_tail, slots, qsl, hi, max(lens), inter_tail, out=o_tail,
                      gated_norm=(z, nw, 1e-6, counter))
    torch.cuda.synchronize()
    assert torch.equal(o_tail, o) and torch.equal(ss_tail, ss)
    assert not with_inter or torch.equal(inter_tail, inter)
    assert torch.equal(counter, torch.zeros_like(counter))
    _assert_norm_close(y, gated_rms_norm(o, z, nw, 1e-6))

    # graph: every input refilled in place before each replay
    def launch():
        return gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ss_tail, slots, qsl, hi, max(lens), inter_tail,
                             out=o_tail, gated_norm=(z, nw, 1e-6, counter))

    graph = torch.cuda.CUDAGraph()
    with early_launch(True):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            launch()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            y_g = launch()
    for rep in range(3):
        fresh = _gdn_inputs(t, dev, seed=1000 + rep)
        for dst, src in zip((q, k, v, a, b), fresh[:5]):
            dst.copy_(src)
        zbuf.copy_(torch.randn_like(zbuf, dtype=torch.float32))
        ss_tail.copy_(torch.randn_like(ss_tail) * 0.5)
        ss0 = ss_tail.clone()
        graph.replay()
        torch.cuda.synchronize()
        got_y, got_o, got_s = y_g.clone(), o_tail.clone(), ss_tail.clone()
        assert torch.equal(counter, torch.zeros_like(counter)), rep
        ss_tail.copy_(ss0)
        want_y = launch()
        torch.cuda.synchronize()
        assert torch.equal(got_y, want_y) and torch.equal(got_o, o_tail) and torch.equal(got_s, ss_tail), rep
        _assert_norm_close(got_y, gated_rms_norm(got_o, z, nw, 1e-6))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("bv,warps", [(8, 1), (16, 2), (32, 4), (64, 4)])
def test_recurrent_gpu_block_sizes(bv, warps):
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    dev = torch.device("cuda")
    qsl, slots, hi = _batch(LENS, INIT, 8, dev, torch.int64, seed=3)
    t = int(qsl[-1])
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(t, dev, seed=bv)
    ss = torch.randn(8, HV, DK, DV, device=dev) * 0.5
    ss0 = ss.clone()
    inter = torch.full((t, HV, DK, DV), float("nan"), device=dev)
    o = gdn_recurrent(
        q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, max(LENS), inter, block_v=bv, num_warps=warps
    )
    _check_recurrent(o, ss, ss0, inter, q, k, v, a, b, A_log, dt_bias, qsl, slots, INIT, 4e-3, 1e-4)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("with_inter", [False, True], ids=["decode", "verify"])
def test_recurrent_gpu_bf16_states(with_inter):
    """bf16 state slots and per-token states (EngineConfig.gdn_state_dtype "bfloat16"), real shapes: o against the
    fp32 reference from the stored bf16 state as for fp32 states; every stored state is the fp32 state rounded to
    nearest even, so within half a bf16 ulp of the reference (+1e-4 for the fp32 math's summation order; a
    truncating or twice-rounding store misses it by up to half an ulp)."""
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    dev = torch.device("cuda")
    nb = 16
    gen = torch.Generator().manual_seed(11)
    lens = torch.randint(1, 10, (nb,), generator=gen).tolist() if with_inter else [1] * nb
    lens[3] = 0
    init = [i % 4 != 1 for i in range(nb)]
    qsl, slots, hi = _batch(lens, init, nb + 4, dev, seed=11)
    t = int(qsl[-1])
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(t, dev, seed=11)
    ss = (torch.randn(nb + 4, HV, DK, DV, device=dev) * 0.5).to(torch.bfloat16)
    ss0 = ss.clone()
    inter = torch.full((t, HV, DK, DV), float("nan"), device=dev, dtype=torch.bfloat16) if with_inter else None
    o = gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, max(lens), inter)
    assert ss.dtype == torch.bfloat16
    # o from the fp32 state in registers (4e-3 as for fp32 states); the states: bf16 rounding, 2^-9 relative
    _check_recurrent(o, ss, ss0, inter, q, k, v, a, b, A_log, dt_bias, qsl, slots, init, 4e-3, 4e-3)
    g, beta = _gates(a, b, A_log, dt_bias)
    for i, (s, e, sl) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), slots.tolist())):
        if e == s:
            continue
        _, allst = gdn_recurrent_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], ss0[sl] if init[i] else None,
                                     output_all_states=True)
        for got, ref in [(ss[sl], allst[-1])] + ([(inter[s:e], allst)] if with_inter else []):
            excess = ((got.float() - ref).abs() - 0.5 * _bf16_ulp(ref)).max().item()
            assert excess <= 1e-4, (i, excess)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("early", [False, True], ids=["pdl", "early-launch"])
def test_decode_cuda_graph(early):
    """conv1d + recurrent captured in a CUDA graph, replayed on new inputs, slots and lengths; with early launch (the
    decode graphs' mode: the recurrent kernel loads its state slices before its PDL wait) the replay also equals an
    eager run without PDL from the same inputs bit for bit."""
    from vibeqwen_kernels.conv1d.causal import causal_conv1d
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent
    from vibeqwen_kernels.pdl import early_launch, pdl_mode, without_pdl

    dev = torch.device("cuda")
    with early_launch(early):
        if early and pdl_mode(dev) != 2:
            pytest.skip("early launch is off here (VIBEQWEN_PDL=0 or VIBEQWEN_PDL_EARLY=0)")
    nb, ns = 8, 12
    mixed = torch.zeros(nb, C, device=dev, dtype=torch.bfloat16)
    ab = torch.zeros(nb, 2 * HV, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(nb + 1, device=dev, dtype=torch.int32)
    slots = torch.arange(nb, device=dev, dtype=torch.int32)
    hi = torch.ones(nb, device=dev, dtype=torch.bool)
    w = (torch.randn(C, W, device=dev) * 0.5).to(torch.bfloat16)
    _, _, _, _, _, A_log, dt_bias = _gdn_inputs(1, dev, seed=5)
    cs = torch.zeros(ns, C, W - 1, device=dev, dtype=torch.bfloat16)
    ss = torch.zeros(ns, HV, DK, DV, device=dev)

    def step():
        y = causal_conv1d(mixed, w, cs, slots, qsl, hi, 1)
        q = y[:, : HK * DK].view(nb, HK, DK)
        k = y[:, HK * DK : 2 * HK * DK].view(nb, HK, DK)
        v = y[:, 2 * HK * DK :].view(nb, HV, DV)
        return y, gdn_recurrent(q, k, v, ab[:, :HV], ab[:, HV:], A_log, dt_bias, ss, slots, qsl, hi, 1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with early_launch(early), torch.cuda.stream(side):
        step()  # compile outside the capture (the early-launch variants too)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with early_launch(early), torch.cuda.graph(graph):
        y_g, o_g = step()

    for rep in range(2):
        mixed.copy_(torch.randn(nb, C, device=dev))
        ab.copy_(torch.randn(nb, 2 * HV, device=dev))
        slots.copy_(torch.randperm(ns, device=dev)[:nb].int())
        hi.copy_(torch.rand(nb, device=dev) > 0.3)
        qsl.copy_(torch.tensor([0, 1, 2, 2, 3, 4, 5, 6, 7], device=dev, dtype=torch.int32))  # seq 2 empty
        cs.copy_(torch.randn_like(cs, dtype=torch.float32))
        ss.copy_(torch.randn_like(ss) * 0.5)
        cs0, ss0 = cs.clone(), ss.clone()
        graph.replay()
        torch.cuda.synchronize()
        if early:
            y_e, o_e, cs_e, ss_e = y_g.clone(), o_g.clone(), cs.clone(), ss.clone()
            cs.copy_(cs0)
            ss.copy_(ss0)
            with without_pdl():
                y_p, o_p = step()
            torch.cuda.synchronize()
            for got, want, what in ((y_e[:7], y_p[:7], "conv"), (o_e[:7], o_p[:7], "o"), (cs_e, cs, "conv states"),
                                    (ss_e, ss, "ssm states")):
                assert torch.equal(got, want), what
        init = hi.tolist()
        ref_y = torch.zeros(nb, C, device=dev)
        for i, (s, e, sl) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), slots.tolist())):
            if e == s:
                continue
            yr, sr = causal_conv1d_ref(mixed[s:e].float(), w.float(), cs0[sl].float() if init[i] else None)
            ref_y[s:e] = yr
            torch.testing.assert_close(y_g[s:e].float(), yr, rtol=8e-3, atol=1e-3)
            assert torch.equal(cs[sl], sr.to(torch.bfloat16))
        yv = y_g[:7]
        q = yv[:, : HK * DK].view(7, HK, DK)
        k = yv[:, HK * DK : 2 * HK * DK].view(7, HK, DK)
        v = yv[:, 2 * HK * DK :].view(7, HV, DV)
        _check_recurrent(
            o_g,
            ss,
            ss0,
            None,
            q,
            k,
            v,
            ab[:7, :HV],
            ab[:7, HV:],
            A_log,
            dt_bias,
            qsl,
            slots,
            init,
            4e-3,
            1e-4,
        )


@pytest.mark.gpu
@requires_gpu
def test_decode_graph_steps_back_to_back_early_launch():
    """Several decode steps in one graph captured with early launch, on the same slots: each step's recurrent kernel
    loads its state before its PDL wait, the state the previous step's recurrent kernel wrote two launches back (the
    case the transitive wait covers). The replay equals the same steps run eagerly without PDL, bit for bit."""
    from vibeqwen_kernels.conv1d.causal import causal_conv1d
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent
    from vibeqwen_kernels.pdl import early_launch, pdl_mode, without_pdl

    dev = torch.device("cuda")
    with early_launch():
        if pdl_mode(dev) != 2:
            pytest.skip("early launch is off here (VIBEQWEN_PDL=0 or VIBEQWEN_PDL_EARLY=0)")
    nb, ns, steps = 6, 9, 3
    mixed = torch.randn(steps, nb, C, device=dev).to(torch.bfloat16)
    ab = torch.randn(steps, nb, 2 * HV, device=dev).to(torch.bfloat16)
    qsl = torch.arange(nb + 1, device=dev, dtype=torch.int32)
    slots = torch.randperm(ns, device=dev)[:nb].int()
    hi = torch.ones(nb, device=dev, dtype=torch.bool)
    hi[2] = False  # a new sequence: its first step starts from zero state, the next ones from what it wrote
    w = (torch.randn(C, W, device=dev) * 0.5).to(torch.bfloat16)
    _, _, _, _, _, A_log, dt_bias = _gdn_inputs(1, dev, seed=9)
    cs = torch.randn(ns, C, W - 1, device=dev).to(torch.bfloat16)
    ss = torch.randn(ns, HV, DK, DV, device=dev) * 0.5
    cs0, ss0 = cs.clone(), ss.clone()
    ones = torch.ones_like(hi)

    def run():
        outs = []
        for i in range(steps):
            y = causal_conv1d(mixed[i], w, cs, slots, qsl, hi if i == 0 else ones, 1)
            q = y[:, : HK * DK].view(nb, HK, DK)
            k = y[:, HK * DK : 2 * HK * DK].view(nb, HK, DK)
            v = y[:, 2 * HK * DK :].view(nb, HV, DV)
            o = gdn_recurrent(q, k, v, ab[i, :, :HV], ab[i, :, HV:], A_log, dt_bias, ss, slots, qsl,
                              hi if i == 0 else ones, 1)
            outs += [y, o]
        return outs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with early_launch(), torch.cuda.stream(side):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with early_launch(), torch.cuda.graph(graph):
        got = run()
    cs.copy_(cs0)
    ss.copy_(ss0)
    graph.replay()
    torch.cuda.synchronize()
    got = [t.clone() for t in got] + [cs.clone(), ss.clone()]
    cs.copy_(cs0)
    ss.copy_(ss0)
    with without_pdl():
        want = run()
    torch.cuda.synchronize()
    want += [cs, ss]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} (y, o per step, then conv and ssm states)"
    assert not torch.equal(ss, ss0)


def _fla_or_skip():
    from vibeqwen_kernels.gdn import chunk_fla

    if not chunk_fla.fla_available():
        pytest.skip("fla-core is not installed")
    return chunk_fla.gdn_chunk_prefill


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize(
    "lens,init",
    [([1024], [False]), ([700, 0, 64, 333], [True, True, False, True]), ([1, 130, 65], [True, True, True])],
    ids=["prefill1k", "mixed-initial", "short"],
)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
def test_fla_chunk_prefill_gpu(lens, init, state_dtype):
    """fla's chunked prefill against the references; with bf16 state slots (EngineConfig.gdn_state_dtype) fla gets
    the slot upcast and the final state is rounded once to bf16 (2^-9 relative, inside the 1e-2 below)."""
    gdn_chunk_prefill = _fla_or_skip()
    dev = torch.device("cuda")
    ns = len(lens) + 3
    qsl, slots, hi = _batch(lens, init, ns, dev, torch.int32, seed=sum(lens))
    t = int(qsl[-1])
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(t, dev, seed=len(lens))
    ss = (torch.randn(ns, HV, DK, DV, device=dev) * 0.5).to(state_dtype)
    ss0 = ss.clone()
    o = gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, max(lens))
    assert o.shape == (t, HV, DV) and o.dtype == torch.bfloat16 and ss.dtype == state_dtype
    g, beta = _gates(a, b, A_log, dt_bias)
    touched = set()
    for i, (s, e, sl) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), slots.tolist())):
        if e == s:
            continue
        touched.add(sl)
        s0 = ss0[sl] if init[i] else None
        ref = gdn_chunk_ref if e - s > 16 else gdn_recurrent_ref
        orf, sref = ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], s0)
        assert torch.isfinite(o[s:e].float()).all()
        assert _rel(o[s:e], orf) <= 1.5e-2, (i, _rel(o[s:e], orf))
        assert _rel(ss[sl], sref) <= 1e-2, (i, _rel(ss[sl], sref))
    for sl in range(ns):
        if sl not in touched:
            assert torch.equal(ss[sl], ss0[sl])


@pytest.mark.gpu
@requires_gpu
def test_fla_matches_recurrent_kernel_gpu():
    """The two GPU paths agree with each other (prefill then decode continuing from the same state)."""
    gdn_chunk_prefill = _fla_or_skip()
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    dev = torch.device("cuda")
    lens, init = [200, 37], [False, True]
    qsl, slots, hi = _batch(lens, init, 4, dev, seed=1)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(int(qsl[-1]), dev, seed=9)
    ss = torch.randn(4, HV, DK, DV, device=dev) * 0.5
    ss2 = ss.clone()
    o1 = gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, 200)
    o2 = gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ss2, slots, qsl, hi, 200)
    assert _rel(o1, o2) <= 1.5e-2
    assert _rel(ss, ss2) <= 1e-2


@pytest.mark.gpu
@requires_gpu
def test_chunk_prefill_graphs_equal_eager_gpu():
    """ChunkPrefillGraphs (one sequence, padded to a bucket with g = 0, beta = 0 tokens) against the fp32
    reference with the eager fla call's tolerances, and against the eager call itself: outputs and final
    states, across buckets, with and without an initial state, several layers' gate parameters through one
    graph, and a replay after a longer sequence left its rows."""
    gdn_chunk_prefill = _fla_or_skip()
    from vibeqwen_kernels.gdn.chunk_fla import ChunkPrefillGraphs

    dev = torch.device("cuda")
    graphs = ChunkPrefillGraphs(HK, HV, DK, DV, torch.bfloat16, dev, max_tokens=1024)
    assert [graphs.bucket(n) for n in (1, 128, 129, 1000, 1024)] == [128, 128, 256, 1024, 1024]
    rows = []
    for case, (n, init) in enumerate([(1000, False), (128, True), (77, True), (300, False), (77, False)]):
        qsl = torch.tensor([0, 0, n], dtype=torch.int32, device=dev)  # an empty sequence first
        hi = torch.tensor([True, init], device=dev)
        slots = torch.tensor([1, 3], device=dev)
        q, k, v, a, b, A_log, dt_bias = _gdn_inputs(n, dev, seed=100 + case)
        ss = torch.randn(5, HV, DK, DV, device=dev) * 0.5
        ss0, ss_graph = ss.clone(), ss.clone()
        o = gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, n, query_start_loc_cpu=qsl.cpu())
        og = gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, ss_graph, slots, qsl, hi, n,
                               query_start_loc_cpu=qsl.cpu(), graphs=graphs)
        assert graphs.bucket(n) in graphs.graphs
        g, beta = _gates(a, b, A_log, dt_bias)
        orf, sref = gdn_chunk_ref(q, k, v, g, beta, ss0[3] if init else None)
        rows.append({"n": n, "init": init, "o_eager_ref": _rel(o, orf), "o_graph_ref": _rel(og, orf),
                     "o_graph_eager": _rel(og, o), "s_eager_ref": _rel(ss[3], sref),
                     "s_graph_ref": _rel(ss_graph[3], sref), "s_graph_eager": _rel(ss_graph[3], ss[3])})
        print(rows[-1])
        for sl in (0, 1, 2, 4):
            assert torch.equal(ss_graph[sl], ss0[sl])
    for r in rows:
        assert r["o_graph_ref"] <= max(1.5e-2, 1.2 * r["o_eager_ref"]), r
        assert r["s_graph_ref"] <= max(1e-2, 1.2 * r["s_eager_ref"]), r
        assert r["o_graph_eager"] <= 1e-2 and r["s_graph_eager"] <= 1e-2, r
    assert sorted(graphs.graphs) == [128, 512, 1024]


def test_chunk_prefill_graph_buckets():
    """Buckets: powers of two from min_tokens, capped by max_tokens (which need not be a power of two); every
    length up to max_tokens maps to the smallest bucket that holds it, and capture_all covers them all."""
    from vibeqwen_kernels.gdn.chunk_fla import ChunkPrefillGraphs

    g = ChunkPrefillGraphs(2, 4, 16, 16, torch.float32, "cpu", max_tokens=3000, min_tokens=128)
    assert g.sizes() == [128, 256, 512, 1024, 2048, 3000]
    for n in (1, 128, 129, 2048, 2049, 3000):
        b = g.bucket(n)
        assert b in g.sizes() and b >= n and all(s < n for s in g.sizes() if s < b)
    assert ChunkPrefillGraphs(2, 4, 16, 16, torch.float32, "cpu", max_tokens=64).sizes() == [128]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
def test_chunk_padded_slot_state_dtypes(monkeypatch, state_dtype):
    """gdn_chunk_padded_slot (the whole-chunk prefill graphs' GDN step) on the CPU, fla replaced by the fp32
    reference: it gets the slot upcast to fp32 (zeros without an initial state), and the final state (after token
    n) replaces the slot in its dtype, rounded once (bf16: within half an ulp); other slots stay as they were."""
    from vibeqwen_kernels.gdn import chunk_fla

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # gdn_padded_inputs' torch path

    def fake_fla(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        assert initial_state.dtype == torch.float32 and output_final_state and not use_qk_l2norm_in_kernel
        o, ht = gdn_recurrent_ref(q[0], k[0], v[0], g[0], beta[0], initial_state[0])
        return o[None], ht[None]

    monkeypatch.setattr(chunk_fla, "_fla_chunk", lambda: fake_fla)
    gen = torch.Generator().manual_seed(8)
    bsz, n, hk, hv, dk, dv = 12, 9, 2, 4, 8, 8
    q, k = torch.randn(bsz, hk, dk, generator=gen), torch.randn(bsz, hk, dk, generator=gen)
    v = torch.randn(bsz, hv, dv, generator=gen)
    a, b = torch.randn(bsz, hv, generator=gen), torch.randn(bsz, hv, generator=gen)
    A_log, dt_bias = torch.rand(hv, generator=gen), torch.randn(hv, generator=gen)
    g, beta = _gates(a, b, A_log, dt_bias)
    for init in (True, False):
        ss = torch.randn(3, hv, dk, dv, generator=gen).to(state_dtype)
        ss0 = ss.clone()
        chunk_fla.gdn_chunk_padded_slot(q, k, v, a, b, A_log, dt_bias, ss, torch.tensor([1]), torch.tensor([init]),
                                        torch.tensor([n]))
        _, sref = gdn_recurrent_ref(q[:n], k[:n], v[:n], g[:n], beta[:n], ss0[1] if init else None)
        assert ss.dtype == state_dtype and torch.equal(ss[0], ss0[0]) and torch.equal(ss[2], ss0[2])
        half_ulp = 0.5 * _bf16_ulp(sref) if state_dtype == torch.bfloat16 else 0.0
        assert ((ss[1].float() - sref).abs() - half_ulp).max() <= 1e-5, init


def test_chunk_prefill_state_dtypes(monkeypatch):
    """State slots in fp32 or bf16 (EngineConfig.gdn_state_dtype) only: fp16 is a ValueError naming both, before
    any work."""
    from vibeqwen_kernels.gdn import chunk_fla

    monkeypatch.setattr(chunk_fla, "_fla_chunk", lambda: None)
    qsl, slots, hi = _batch([3, 2], [True, False], 4, "cpu", torch.int64)
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 4, 8)
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="ssm_states must be fp32 or bf16"):
        chunk_fla.gdn_chunk_prefill(q, k, v, a, b, torch.rand(4), torch.randn(4), torch.randn(4, 4, 8, 8).half(),
                                    slots, qsl, hi, 3)


def test_chunk_prefill_rejects_a_bad_host_offsets_copy(monkeypatch):
    """query_start_loc_cpu must be a CPU tensor [B+1]: anything else is a ValueError before any work (the
    states stay as they were)."""
    from vibeqwen_kernels.gdn import chunk_fla

    monkeypatch.setattr(chunk_fla, "_fla_chunk", lambda: None)
    qsl, slots, hi = _batch([3, 2], [True, False], 4, "cpu", torch.int64)
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 4, 8)
    a, b = torch.randn(5, 4), torch.randn(5, 4)
    ss = torch.randn(4, 4, 8, 8)
    ss0 = ss.clone()
    for bad in (qsl[:-1].clone(), qsl.view(1, -1).clone()):
        with pytest.raises(ValueError, match="query_start_loc_cpu"):
            chunk_fla.gdn_chunk_prefill(q, k, v, a, b, torch.rand(4), torch.randn(4), ss, slots, qsl, hi, 3,
                                        query_start_loc_cpu=bad)
    assert torch.equal(ss, ss0)
