"""The one-launch GDN decode (`gdn_decode_gated`, csrc/gdn_decode.cu) against the two launches it replaces
(`gdn_recurrent`, then `gated_rms_norm`) and the fp32 references, on fresh random inputs at the real shapes.

Tolerances (GPU). The kernel does the same operations as the two launches; only the fp32 sums (S^T k and S^T q over
the 128 state rows, |o|^2 over 128 outputs) run in another order. So:
* the stored state: relative Frobenius <= 1e-5 from the chain's (fp32 state; a few ulps of summation order); a bf16
  state within one bf16 ulp of it plus 1e-6 of the slot's largest value (the fp32 error of k u^T is absolute: at
  entries near zero it exceeds their ulp);
* y: within 4 bf16 ulps of the chain's y (the norm's three intermediate roundings can each flip) and >= 99% of
  values equal;
* against the fp32 references (`gdn_recurrent_ref`, `gated_rms_norm_ref`): the chain's own tolerance, relative
  Frobenius <= 1e-2 for y (o rounded to bf16 before the norm, then three bf16 roundings), 1e-4 for the fp32 state.
Sequences without a token (padding) leave their state slot and their output row untouched.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from vibeqwen_kernels import gated_rms_norm_ref, gdn_recurrent_ref

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = HAS_TRITON and torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs triton and a CUDA GPU")

HK, HV, D = 16, 32, 128
C = 2 * HK * D + HV * D
EPS = 1e-6


def _inputs(t, device, seed):
    """q, k, v, z as strided views of one [T, C + Hv D] projection (as the decode projection gives them), b|a as views
    of one [T, 2 Hv] tensor, A_log, dt_bias, the norm weight."""
    gen = torch.Generator(device=device).manual_seed(seed)
    proj = torch.randn(t, C + HV * D, device=device, generator=gen).to(torch.bfloat16)
    q = proj[:, : HK * D].view(t, HK, D)
    k = proj[:, HK * D : 2 * HK * D].view(t, HK, D)
    v = proj[:, 2 * HK * D : C].view(t, HV, D)
    z = proj[:, C:].view(t, HV, D)
    ba = torch.randn(t, 2 * HV, device=device, generator=gen).to(torch.bfloat16)
    A_log = torch.log(torch.rand(HV, device=device, generator=gen) * 15 + 1)
    dt_bias = torch.rand(HV, device=device, generator=gen) - 0.5
    w = (torch.rand(D, device=device, generator=gen) + 0.5).to(torch.bfloat16)
    return q, k, v, z, ba[:, :HV], ba[:, HV:], A_log, dt_bias, w


def _batch(lens, init, num_slots, device, seed):
    gen = torch.Generator().manual_seed(seed)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lens).cumsum(0)
    slots = torch.randperm(num_slots, generator=gen)[: len(lens)]
    return qsl.to(device), slots.to(device), torch.tensor(init, device=device)


def _rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _bf16_ulp(x):
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(2.0**-126))) - 7)


# ----------------------------------------------------------------------------------------------------
# CPU: argument checks


def test_rejects_bad_inputs():
    from vibeqwen_kernels.gdn.decode_cuda import gdn_decode_gated, gdn_decode_supported

    dev = torch.device("cpu")
    q, k, v, z, b, a, A_log, dt_bias, w = _inputs(3, dev, 0)
    qsl, slots, hi = _batch([1, 1, 1], [True] * 3, 4, dev, 0)
    ss = torch.zeros(4, HV, D, D)
    ok = (q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, z, w, EPS)
    assert not gdn_decode_supported(q, k, v, a, b, z, ss)  # CPU
    with pytest.raises(RuntimeError, match="cannot run on this device"):
        gdn_decode_gated(*ok)

    def bad(i, x, match):
        args = list(ok)
        args[i] = x
        with pytest.raises(ValueError, match=match):
            gdn_decode_gated(*args)

    bad(0, q[:, :, :64], "q, k must be")
    bad(0, q.reshape(3, 8, 256), "q, k must be")
    half = torch.zeros(3, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Dk = Dv = 128"):
        gdn_decode_gated(half, half, v[:, :12], a[:, :12], b[:, :12], A_log, dt_bias, ss, slots, qsl, hi,
                         z[:, :12], w, EPS)
    bad(2, v.float(), "must be bf16")
    odd = torch.zeros(4 * HK * D, dtype=torch.bfloat16).as_strided((3, HK, D), (HK * D + 2, D, 1), 2)
    bad(0, odd, "multiples of 4")
    bad(3, a.float(), "a must be bf16")
    bad(7, ss.to(torch.float16), "ssm_states must be fp32 or bf16")
    bad(7, torch.zeros(4, HV, D, 64), "ssm_states must be")
    bad(8, slots.float(), "slots must be")
    bad(9, qsl.long(), "query_start_loc must be contiguous int32")
    bad(10, hi.int(), "has_initial_state must be bool")
    bad(12, w[:64], "norm_weight")
    with pytest.raises(ValueError, match="out must be"):
        gdn_decode_gated(*ok, out=torch.empty(3, HV * D))


def test_cluster_size(monkeypatch):
    from vibeqwen_kernels.gdn.decode_cuda import cluster_size

    monkeypatch.delenv("VIBEQWEN_GDN_DECODE_CLUSTER", raising=False)
    assert cluster_size(1, HV) == 8 and cluster_size(4, HV) == 8 and cluster_size(5, HV) == 4
    monkeypatch.setenv("VIBEQWEN_GDN_DECODE_CLUSTER", "4")
    assert cluster_size(1, HV) == 4
    monkeypatch.setenv("VIBEQWEN_GDN_DECODE_CLUSTER", "2")
    with pytest.raises(ValueError, match="must be 4 or 8"):
        cluster_size(1, HV)


def test_decode_kernel_switch(monkeypatch):
    from vibeqwen_kernels.gdn.decode_cuda import decode_kernel

    monkeypatch.delenv("VIBEQWEN_GDN_DECODE_KERNEL", raising=False)
    assert decode_kernel() == "triton"
    monkeypatch.setenv("VIBEQWEN_GDN_DECODE_KERNEL", "persist")
    assert decode_kernel() == "persist"
    monkeypatch.setenv("VIBEQWEN_GDN_DECODE_KERNEL", "cuda")
    with pytest.raises(ValueError, match="triton, fused or persist"):
        decode_kernel()


def test_model_takes_the_chain_on_cpu():
    """The model's choice: never the CUDA kernel for CPU tensors (the reference path serves them)."""
    from vibeqwen.model import gdn

    q, k, v, z, b, a, *_ = _inputs(2, torch.device("cpu"), 1)
    assert gdn._cuda_decode(False, 1, q, k, v, a, b, z, torch.zeros(2, HV, D, D)) is None


# ----------------------------------------------------------------------------------------------------
# GPU, real shapes


def _chain(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, z, w):
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent
    from vibeqwen_kernels.norm_fused import gated_rms_norm

    o = gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, 1)
    return gated_rms_norm(o, z, w, EPS).reshape(o.shape[0], HV * D)


def _compare(y, y_c, ss, ss_c, ss0, touched, state_dtype):
    """y / ss from the kernel against the chain's y_c / ss_c (module docstring's tolerances); slots outside touched
    (padding sequences' and unused ones) equal to ss0."""
    yk, yc = y.float(), y_c.float()
    assert torch.isfinite(yk).all()
    ulps = ((yk - yc).abs() / _bf16_ulp(yc)).max().item()
    assert ulps <= 4, ulps
    assert (yk == yc).float().mean().item() >= 0.99, (yk == yc).float().mean().item()
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
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
@pytest.mark.parametrize("nb", [1, 7, 64], ids=lambda n: f"B{n}")
@pytest.mark.parametrize("cluster", ["4", "8"], ids=lambda c: f"cluster{c}")
def test_equals_the_chain_and_the_reference(nb, state_dtype, cluster, monkeypatch):
    from vibeqwen_kernels.gdn.decode_cuda import gdn_decode_gated, gdn_decode_supported

    monkeypatch.setenv("VIBEQWEN_GDN_DECODE_CLUSTER", cluster)
    dev = torch.device("cuda")
    lens = [1] * nb
    if nb > 1:
        lens[nb // 2] = 0  # a padding sequence: no token
    init = [i % 3 != 1 for i in range(nb)]
    qsl, slots, hi = _batch(lens, init, nb + 5, dev, seed=nb)
    t = sum(lens)
    q, k, v, z, b, a, A_log, dt_bias, w = _inputs(t, dev, seed=100 + nb)
    ss0 = (torch.randn(nb + 5, HV, D, D, device=dev) * 0.5).to(state_dtype)
    assert gdn_decode_supported(q, k, v, a, b, z, ss0)
    ss, ss_c = ss0.clone(), ss0.clone()
    y_c = _chain(q, k, v, a, b, A_log, dt_bias, ss_c, slots, qsl, hi, z, w)
    y = torch.full((t, HV * D), float("nan"), device=dev, dtype=torch.bfloat16)
    assert gdn_decode_gated(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, z, w, EPS, out=y) is y
    real = [i for i in range(nb) if lens[i]]
    _compare(y, y_c, ss, ss_c, ss0, {int(slots[i]) for i in real}, state_dtype)
    # the fp32 references (token row qsl[i] for sequence i)
    g = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    beta = torch.sigmoid(b.float())
    for i in real:
        r, sl = int(qsl[i]), int(slots[i])
        o_r, s_r = gdn_recurrent_ref(q[r : r + 1], k[r : r + 1], v[r : r + 1], g[r : r + 1], beta[r : r + 1],
                                     ss0[sl].float() if init[i] else None)
        y_r = gated_rms_norm_ref(o_r.to(torch.bfloat16), z[r : r + 1], w, EPS).reshape(1, HV * D)
        assert _rel(y[r : r + 1], y_r) <= 1e-2, (i, _rel(y[r : r + 1], y_r))
        assert _rel(ss[sl], s_r) <= (1e-4 if state_dtype == torch.float32 else 4e-3), i


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("early", [False, True], ids=["pdl", "early-launch"])
@pytest.mark.parametrize("cluster", ["4", "8"], ids=lambda c: f"cluster{c}")
def test_graph_replay_equals_eager(early, cluster, monkeypatch):
    """Captured in a CUDA graph behind a PDL kernel that writes its q, k and v (as the decode projection does), replayed
    on new inputs, slots, lengths and initial-state flags: equal to an eager launch without PDL, bit for bit (with
    early launch the state and metadata are read before the PDL wait)."""
    from vibeqwen_kernels.conv1d.causal import causal_conv1d
    from vibeqwen_kernels.gdn.decode_cuda import gdn_decode_gated
    from vibeqwen_kernels.pdl import early_launch, pdl_mode, without_pdl

    monkeypatch.setenv("VIBEQWEN_GDN_DECODE_CLUSTER", cluster)
    dev = torch.device("cuda")
    with early_launch(early):
        if early and pdl_mode(dev) != 2:
            pytest.skip("early launch is off here (VIBEQWEN_PDL=0 or VIBEQWEN_PDL_EARLY=0)")

    nb, ns, width = 8, 12, 4
    _, _, _, z, b, a, A_log, dt_bias, w = _inputs(nb, dev, seed=7)
    mixed = torch.zeros(nb, C, device=dev, dtype=torch.bfloat16)
    taps = (torch.randn(C, width, device=dev) * 0.5).to(torch.bfloat16)
    conv_states = torch.zeros(ns, C, width - 1, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(nb + 1, device=dev, dtype=torch.int32)
    slots = torch.arange(nb, device=dev)
    hi = torch.ones(nb, device=dev, dtype=torch.bool)
    ss = torch.zeros(ns, HV, D, D, device=dev)
    y = torch.zeros(nb, HV * D, device=dev, dtype=torch.bfloat16)

    def step():
        # a PDL kernel ahead that writes q, k and v (the decode projection's conv epilogue in the model)
        x = causal_conv1d(mixed, taps, conv_states, slots, qsl, hi, 1)
        q = x[:, : HK * D].view(nb, HK, D)
        k = x[:, HK * D : 2 * HK * D].view(nb, HK, D)
        v = x[:, 2 * HK * D :].view(nb, HV, D)
        gdn_decode_gated(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, z, w, EPS, out=y)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with early_launch(early), torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with early_launch(early), torch.cuda.graph(graph):
        step()
    for rep in range(2):
        mixed.copy_(torch.randn_like(mixed, dtype=torch.float32))
        z.copy_(torch.randn_like(z, dtype=torch.float32))
        a.copy_(torch.randn_like(a, dtype=torch.float32))
        b.copy_(torch.randn_like(b, dtype=torch.float32))
        slots.copy_(torch.randperm(ns, device=dev)[:nb])
        hi.copy_(torch.rand(nb, device=dev) > 0.3)
        qsl.copy_(torch.tensor([0, 1, 2, 2, 3, 4, 5, 6, 7], device=dev, dtype=torch.int32))  # seq 2 empty
        conv_states.copy_(torch.randn_like(conv_states, dtype=torch.float32))
        ss.copy_(torch.randn_like(ss) * 0.5)
        cs0, ss0 = conv_states.clone(), ss.clone()
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        y_g, ss_g = y.clone(), ss.clone()
        conv_states.copy_(cs0)
        ss.copy_(ss0)
        y.fill_(float("nan"))
        with without_pdl():
            step()
        torch.cuda.synchronize()
        assert torch.equal(y_g[:7], y[:7]) and torch.equal(ss_g, ss), rep
        assert torch.isnan(y_g[7].float()).all()  # row 7 belongs to no sequence
        assert not torch.equal(ss, ss0)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
@pytest.mark.parametrize("nb", [1, 7, 64, 200], ids=lambda n: f"B{n}")
def test_persistent_equals_the_triton_kernel(nb, state_dtype):
    """`gdn_recurrent_decode` (a persistent grid: at 200 sequences each CTA runs several units) against
    `gdn_recurrent`: o within 2 bf16 ulps and >= 99% equal, the states as in `_compare`."""
    from vibeqwen_kernels.gdn.decode_cuda import gdn_recurrent_decode
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    dev = torch.device("cuda")
    lens = [1] * nb
    if nb > 1:
        lens[nb // 2] = 0
    init = [i % 3 != 1 for i in range(nb)]
    qsl, slots, hi = _batch(lens, init, nb + 5, dev, seed=nb)
    t = sum(lens)
    q, k, v, _, b, a, A_log, dt_bias, _ = _inputs(t, dev, seed=200 + nb)
    ss0 = (torch.randn(nb + 5, HV, D, D, device=dev) * 0.5).to(state_dtype)
    ss, ss_c = ss0.clone(), ss0.clone()
    o_c = gdn_recurrent(q, k, v, a, b, A_log, dt_bias, ss_c, slots, qsl, hi, 1)
    o = torch.full((t, HV, D), float("nan"), device=dev, dtype=torch.bfloat16)
    assert gdn_recurrent_decode(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, out=o) is o
    ok, oc = o.float(), o_c.float()
    assert torch.isfinite(ok).all()
    assert ((ok - oc).abs() / _bf16_ulp(oc)).max().item() <= 2
    assert (ok == oc).float().mean().item() >= 0.99
    real = {int(slots[i]) for i in range(nb) if lens[i]}
    for sl in range(ss.shape[0]):
        if sl not in real:
            assert torch.equal(ss[sl], ss0[sl]), sl
        elif state_dtype == torch.float32:
            assert _rel(ss[sl], ss_c[sl]) <= 1e-5, sl
        else:
            ref = ss_c[sl].float()
            assert ((ss[sl].float() - ref).abs() - _bf16_ulp(ref) - 1e-6 * ref.abs().max()).max().item() <= 0, sl


@pytest.mark.gpu
@requires_gpu
def test_persistent_graph_replay_early_launch():
    """The persistent kernel in a graph captured with early launch behind the conv kernel, replayed on new slots and
    lengths: equal to an eager launch without PDL, bit for bit."""
    from vibeqwen_kernels.conv1d.causal import causal_conv1d
    from vibeqwen_kernels.gdn.decode_cuda import gdn_recurrent_decode
    from vibeqwen_kernels.pdl import early_launch, pdl_mode, without_pdl

    dev = torch.device("cuda")
    with early_launch():
        if pdl_mode(dev) != 2:
            pytest.skip("early launch is off here (VIBEQWEN_PDL=0 or VIBEQWEN_PDL_EARLY=0)")
    nb, ns, width = 24, 30, 4
    _, _, _, _, b, a, A_log, dt_bias, _ = _inputs(nb, dev, seed=8)
    mixed = torch.zeros(nb, C, device=dev, dtype=torch.bfloat16)
    taps = (torch.randn(C, width, device=dev) * 0.5).to(torch.bfloat16)
    conv_states = torch.zeros(ns, C, width - 1, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(nb + 1, device=dev, dtype=torch.int32)
    slots = torch.arange(nb, device=dev)
    hi = torch.ones(nb, device=dev, dtype=torch.bool)
    ss = torch.zeros(ns, HV, D, D, device=dev)
    o = torch.zeros(nb, HV, D, device=dev, dtype=torch.bfloat16)

    def step():
        x = causal_conv1d(mixed, taps, conv_states, slots, qsl, hi, 1)
        q = x[:, : HK * D].view(nb, HK, D)
        k = x[:, HK * D : 2 * HK * D].view(nb, HK, D)
        v = x[:, 2 * HK * D :].view(nb, HV, D)
        gdn_recurrent_decode(q, k, v, a, b, A_log, dt_bias, ss, slots, qsl, hi, out=o)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with early_launch(), torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with early_launch(), torch.cuda.graph(graph):
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
        ss.copy_(torch.randn_like(ss) * 0.5)
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
        assert not torch.equal(ss, ss0)
