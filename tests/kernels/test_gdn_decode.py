"""The persistent GDN decode kernel (`gdn_recurrent_decode`, csrc/gdn_decode.cu) against the Triton recurrent kernel
(`gdn_recurrent`) and the fp32 reference, on fresh random inputs at the real shapes.

Tolerances (GPU). The kernel does the Triton kernel's operations; only the fp32 sums over the 128 state rows (S^T k,
S^T q) run in another order. Their error is absolute (~1e-7 of the sums' terms), so elementwise it is bounded by
the largest value, not by each value's own ulp (at entries near zero it exceeds their ulp):
* the stored state: relative Frobenius <= 1e-5 from the Triton kernel's in fp32; in bf16 within one bf16 ulp of it
  plus 1e-6 of the slot's largest value;
* o: within one bf16 ulp plus 1e-5 of the largest |o| of the Triton kernel's o, and >= 99% of values equal;
* against the fp32 reference (`gdn_recurrent_ref`): the Triton kernel's own tolerances (tests/kernels/
  test_gdn_kernels.py): relative Frobenius <= 4e-3 for o, 1e-4 for an fp32 state (4e-3 in bf16).
Sequences without a token (padding) leave their state slot and their output row untouched.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_gdn_kernels import _batch, _bf16_ulp, _rel  # tests/kernels is on the path (no package)
from vibeqwen_kernels import gdn_recurrent_ref

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = HAS_TRITON and torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs triton and a CUDA GPU")

HK, HV, D = 16, 32, 128
C = 2 * HK * D + HV * D


def _inputs(t, device, seed):
    """q, k, v as strided views of one [T, C + Hv D] projection (as the decode projection gives them: q|k|v|z), b|a
    as views of one [T, 2 Hv] tensor, A_log, dt_bias."""
    gen = torch.Generator(device=device).manual_seed(seed)
    proj = torch.randn(t, C + HV * D, device=device, generator=gen).to(torch.bfloat16)
    q = proj[:, : HK * D].view(t, HK, D)
    k = proj[:, HK * D : 2 * HK * D].view(t, HK, D)
    v = proj[:, 2 * HK * D : C].view(t, HV, D)
    ba = torch.randn(t, 2 * HV, device=device, generator=gen).to(torch.bfloat16)
    A_log = torch.log(torch.rand(HV, device=device, generator=gen) * 15 + 1)
    dt_bias = torch.rand(HV, device=device, generator=gen) - 0.5
    return q, k, v, ba[:, :HV], ba[:, HV:], A_log, dt_bias


# ----------------------------------------------------------------------------------------------------
# CPU: argument checks and the model's choice


def test_rejects_bad_inputs():
    from vibeqwen_kernels.gdn.decode_cuda import decode_supported, gdn_recurrent_decode

    dev = torch.device("cpu")
    q, k, v, b, a, A_log, dt_bias = _inputs(3, dev, 0)
    qsl, slots, hi = _batch([1, 1, 1], [True] * 3, 4, dev, torch.int64, seed=0)
    ss = torch.zeros(4, HV, D, D)
    counter = torch.zeros(2, dtype=torch.int32)
    ok = (q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, counter)
    assert not decode_supported(q, k, v, a, b, ss)  # CPU
    with pytest.raises(RuntimeError, match="cannot run on this device"):
        gdn_recurrent_decode(*ok)

    def bad(i, x, match):
        args = list(ok)
        args[i] = x
        with pytest.raises(ValueError, match=match):
            gdn_recurrent_decode(*args)

    bad(0, q[:, :, :64], "q, k must be")
    bad(0, q.reshape(3, 8, 256), "q, k must be")
    half = torch.zeros(3, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Dk = Dv = 128"):
        gdn_recurrent_decode(half, half, v[:, :12], a[:, :12], b[:, :12], A_log, dt_bias, ss, slots, qsl, hi, counter)
    bad(2, v.float(), "must be bf16")
    odd = torch.zeros(4 * HK * D, dtype=torch.bfloat16).as_strided((3, HK, D), (HK * D + 2, D, 1), 2)
    bad(0, odd, "multiples of 4")
    bad(3, a.float(), "a must be bf16")
    bad(5, A_log.double(), "A_log and dt_bias must be fp32")
    bad(7, ss.to(torch.float16), "ssm_states must be fp32 or bf16")
    bad(7, torch.zeros(4, HV, D, 64), "ssm_states must be")
    bad(8, slots.float(), "slots must be")
    bad(9, qsl.long(), "query_start_loc must be contiguous int32")
    bad(10, hi.int(), "has_initial_state must be contiguous bool")
    bad(10, torch.ones(6, dtype=torch.bool)[::2], "has_initial_state must be contiguous bool")
    bad(11, torch.zeros(3, dtype=torch.int32), "counter must be")
    with pytest.raises(ValueError, match="out must be"):
        gdn_recurrent_decode(*ok, out=torch.empty(3, HV, D))


def test_model_keeps_the_triton_kernel_on_cpu():
    from vibeqwen.model import gdn

    q, k, v, b, a, *_ = _inputs(2, torch.device("cpu"), 1)
    assert not gdn._cuda_decode(False, 1, q, k, v, a, b, torch.zeros(2, HV, D, D), torch.zeros(2, dtype=torch.int32))


def test_model_min_seqs(monkeypatch):
    from vibeqwen_kernels.gdn.decode_cuda import model_min_seqs

    monkeypatch.delenv("VIBEQWEN_GDN_PERSIST_MIN_SEQS", raising=False)
    assert model_min_seqs() == 32
    monkeypatch.setenv("VIBEQWEN_GDN_PERSIST_MIN_SEQS", "1")
    assert model_min_seqs() == 1
    for bad in ("0", "x", "-2"):
        monkeypatch.setenv("VIBEQWEN_GDN_PERSIST_MIN_SEQS", bad)
        with pytest.raises(ValueError, match="positive integer"):
            model_min_seqs()


# ----------------------------------------------------------------------------------------------------
# GPU, real shapes


def _check(o, o_c, ss, ss_c, ss0, touched, state_dtype):
    """o / ss from the kernel against the Triton kernel's o_c / ss_c (module docstring's tolerances); slots outside
    touched (padding sequences' and unused ones) equal to ss0."""
    ok, oc = o.float(), o_c.float()
    assert torch.isfinite(ok).all()
    excess = ((ok - oc).abs() - _bf16_ulp(oc) - 1e-5 * oc.abs().max()).max().item()
    assert excess <= 0, excess
    assert (ok == oc).float().mean().item() >= 0.99, (ok == oc).float().mean().item()
    for sl in range(ss.shape[0]):
        if sl not in touched:
            assert torch.equal(ss[sl], ss0[sl]), f"slot {sl} was written"
        elif state_dtype == torch.float32:
            assert _rel(ss[sl], ss_c[sl]) <= 1e-5, (sl, _rel(ss[sl], ss_c[sl]))
        else:
            ref = ss_c[sl].float()
            excess = ((ss[sl].float() - ref).abs() - _bf16_ulp(ref) - 1e-6 * ref.abs().max()).max().item()
            assert excess <= 0, (sl, excess)


@pytest.mark.gpu
@requires_gpu
def test_model_choice_gpu(monkeypatch):
    """The model's choice on a GPU: the CUDA kernel for one-token steps of at least VIBEQWEN_GDN_PERSIST_MIN_SEQS
    sequences without kept states, with a counter, unless VIBEQWEN_GDN_PERSIST=0."""
    from vibeqwen.model import gdn

    dev = torch.device("cuda")
    q, k, v, b, a, *_ = _inputs(8, dev, 2)
    ss, counter = torch.zeros(4, HV, D, D, device=dev), torch.zeros(2, dtype=torch.int32, device=dev)
    monkeypatch.setenv("VIBEQWEN_GDN_PERSIST_MIN_SEQS", "8")
    assert gdn._cuda_decode(False, 1, q, k, v, a, b, ss, counter)
    assert not gdn._cuda_decode(True, 1, q, k, v, a, b, ss, counter)  # kept states (verification)
    assert not gdn._cuda_decode(False, 2, q, k, v, a, b, ss, counter)  # two tokens a sequence
    assert not gdn._cuda_decode(False, 1, q, k, v, a, b, ss, None)
    assert not gdn._cuda_decode(False, 1, q[:7], k[:7], v[:7], a[:7], b[:7], ss, counter)  # below the bound
    assert not gdn._cuda_decode(False, 1, q, k, v, a, b, ss.to(torch.float16), counter)  # a state it does not take
    monkeypatch.setenv("VIBEQWEN_GDN_PERSIST", "0")
    assert not gdn._cuda_decode(False, 1, q, k, v, a, b, ss, counter)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
@pytest.mark.parametrize("nb", [1, 7, 64, 200], ids=lambda n: f"B{n}")
def test_equals_the_triton_kernel_and_the_reference(nb, state_dtype):
    """At 200 sequences (25600 units) every CTA takes several units from the counter; a second launch on the same
    counter checks that the first left it at zero. int32 slots at 7 sequences, int64 elsewhere."""
    from vibeqwen_kernels.gdn.decode_cuda import decode_supported, gdn_recurrent_decode, make_counter
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    dev = torch.device("cuda")
    lens = [1] * nb
    if nb > 1:
        lens[nb // 2] = 0  # a padding sequence: no token
    init = [i % 3 != 1 for i in range(nb)]
    qsl, slots, hi = _batch(lens, init, nb + 5, dev, torch.int64, seed=nb)
    if nb == 7:
        slots = slots.int()
    t = sum(lens)
    q, k, v, b, a, A_log, dt_bias = _inputs(t, dev, seed=100 + nb)
    ss0 = (torch.randn(nb + 5, HV, D, D, device=dev) * 0.5).to(state_dtype)
    assert decode_supported(q, k, v, a, b, ss0)
    counter = make_counter(dev)
    real = [i for i in range(nb) if lens[i]]
    for launch in range(2):
        ss, ss_c = ss0.clone(), ss0.clone()
        o_c = gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ss_c, slots, qsl, hi, 1)
        o = torch.full((t, HV, D), float("nan"), device=dev, dtype=torch.bfloat16)
        assert gdn_recurrent_decode(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, counter, out=o) is o
        _check(o, o_c, ss, ss_c, ss0, {int(slots[i]) for i in real}, state_dtype)
        assert counter.tolist() == [0, 0], launch
    # the fp32 reference (token row qsl[i] for sequence i)
    g = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    beta = torch.sigmoid(b.float())
    for i in real[:8]:
        r, sl = int(qsl[i]), int(slots[i])
        o_r, s_r = gdn_recurrent_ref(q[r : r + 1], k[r : r + 1], v[r : r + 1], g[r : r + 1], beta[r : r + 1],
                                     ss0[sl].float() if init[i] else None)
        assert _rel(o[r : r + 1], o_r) <= 4e-3, (i, _rel(o[r : r + 1], o_r))
        assert _rel(ss[sl], s_r) <= (1e-4 if state_dtype == torch.float32 else 4e-3), i


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("early", [False, True], ids=["pdl", "early-launch"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
def test_graph_replay_equals_eager(early, state_dtype):
    """Captured in a CUDA graph behind a PDL kernel that writes its q, k and v (the conv kernel here; the decode
    projection's conv epilogue in the model), replayed on new inputs, slots, lengths and initial-state flags: equal to
    an eager launch without PDL, bit for bit (with early launch the first state slices and the metadata are read before
    the PDL wait; the units a CTA takes from the counter do not change any value)."""
    from vibeqwen_kernels.conv1d.causal import causal_conv1d
    from vibeqwen_kernels.gdn.decode_cuda import gdn_recurrent_decode, make_counter
    from vibeqwen_kernels.pdl import early_launch, pdl_mode, without_pdl

    dev = torch.device("cuda")
    with early_launch(early):
        if early and pdl_mode(dev) != 2:
            pytest.skip("early launch is off here (VIBEQWEN_PDL=0 or VIBEQWEN_PDL_EARLY=0)")
    nb, ns, width = 24, 30, 4
    _, _, _, b, a, A_log, dt_bias = _inputs(nb, dev, seed=8)
    mixed = torch.zeros(nb, C, device=dev, dtype=torch.bfloat16)
    taps = (torch.randn(C, width, device=dev) * 0.5).to(torch.bfloat16)
    conv_states = torch.zeros(ns, C, width - 1, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(nb + 1, device=dev, dtype=torch.int32)
    slots = torch.arange(nb, device=dev)
    hi = torch.ones(nb, device=dev, dtype=torch.bool)
    ss = torch.zeros(ns, HV, D, D, device=dev, dtype=state_dtype)
    o = torch.zeros(nb, HV, D, device=dev, dtype=torch.bfloat16)
    counter = make_counter(dev)

    def step():
        x = causal_conv1d(mixed, taps, conv_states, slots, qsl, hi, 1)
        q = x[:, : HK * D].view(nb, HK, D)
        k = x[:, HK * D : 2 * HK * D].view(nb, HK, D)
        v = x[:, 2 * HK * D :].view(nb, HV, D)
        gdn_recurrent_decode(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, counter, out=o)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with early_launch(early), torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with early_launch(early), torch.cuda.graph(graph):
        step()
    lens = torch.ones(nb, dtype=torch.int32)
    lens[5] = 0
    for rep in range(2):
        mixed.copy_(torch.randn_like(mixed, dtype=torch.float32))
        a.copy_(torch.randn_like(a, dtype=torch.float32))
        b.copy_(torch.randn_like(b, dtype=torch.float32))
        slots.copy_(torch.randperm(ns, device=dev)[:nb])
        hi.copy_(torch.rand(nb, device=dev) > 0.3)
        qsl[1:].copy_(lens.cumsum(0).to(dev))
        conv_states.copy_(torch.randn_like(conv_states, dtype=torch.float32))
        ss.copy_(torch.randn_like(ss, dtype=torch.float32) * 0.5)
        cs0, ss0 = conv_states.clone(), ss.clone()
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_g, ss_g = o.clone(), ss.clone()
        conv_states.copy_(cs0)
        ss.copy_(ss0)
        o.fill_(float("nan"))
        with without_pdl():
            step()
        torch.cuda.synchronize()
        assert torch.equal(o_g[: nb - 1], o[: nb - 1]) and torch.equal(ss_g, ss), rep
        assert torch.isnan(o_g[nb - 1].float()).all()  # the last row belongs to no sequence
        assert not torch.equal(ss, ss0)
        assert counter.tolist() == [0, 0]
