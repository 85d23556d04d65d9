"""FP8 W8A16 decode GEMMs on the CUDA MMA kernel (`vibeqwen_kernels.fp8.mma`, `csrc/fp8_mma.cu`).

CPU: the fragment layout (every code of a 16 x 64 tile-chunk lands in exactly one lane byte, where the PTX ISA's
mma.m16n8k16 A fragment wants it), the shuffle read back against the dense codes, the dequantizer's bit
arithmetic emulated for all 256 codes (exact E4M3 values), the launch plan and the argument checks.
GPU: the kernel against the fp32 reference on fresh random weights for 1-64 rows, every n8-tile count, 4 and 8
warps, K splits, per-tensor and per-row scales, bf16 and fp32 outputs, CUDA-graph replay, and FP8Linear's
decode path. Both sides compute exact products in fp32 (the scale after the sum): bf16 outputs differ by their
rounding (relative Frobenius error <= 4e-3), fp32 ones by the summation order (<= 1e-5).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from vibeqwen_kernels.fp8 import fp8_linear_ref, prepack_fp8
from vibeqwen_kernels.fp8 import mma as FM

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU")


def test_fragment_layout_is_a_permutation_matching_the_ptx_a_fragment():
    src = FM.step_byte_sources()
    seen = {pos for lane in src for pos in lane}
    assert len(seen) == 1024 and seen == {(r, k) for r in range(16) for k in range(64)}
    # spot checks against the PTX ISA's A fragment (lane 4g + t; a0 = (g, 2t..2t+1), a1 = (g + 8, ..),
    # a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..)) for step j at k offset 16 j
    assert src[0][0] == (0, 0) and src[0][1] == (0, 1) and src[0][2] == (8, 0) and src[0][4] == (0, 8)
    assert src[5][6] == (9, 10) and src[5][7] == (9, 11)  # g = 1, t = 1: a3 = row 9, k 2t + 8 + q
    assert src[31][31] == (15, 48 + 6 + 1 + 8)  # g = 7, t = 3, step 3, a3 high half


@pytest.mark.parametrize("n,k", [(16, 64), (48, 256), (64, 512)])
def test_shuffle_reads_back(n, k):
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    out = FM.shuffle_fp8_mma(codes, row_chunk=32)
    assert out.shape == (n // 16, k // 64, 2, 32, 16) and out.dtype == torch.uint8
    src = FM.step_byte_sources()
    rows = torch.tensor([[r for r, _ in lane] for lane in src])
    ks = torch.tensor([[kk for _, kk in lane] for lane in src])
    for t in range(n // 16):
        for c in range(k // 64):
            want = codes[16 * t + rows, 64 * c + ks]  # [lane, its 32 bytes]
            assert torch.equal(out[t, c].permute(1, 0, 2).reshape(32, 32), want)  # half h = bytes 16 h ..
    # float8 input: the same bytes
    assert torch.equal(FM.shuffle_fp8_mma(codes.view(torch.float8_e4m3fn)), out)


def test_shuffle_rejects_bad_shapes():
    with pytest.raises(ValueError, match="N % 16"):
        FM.shuffle_fp8_mma(torch.zeros(24, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K % 64"):
        FM.shuffle_fp8_mma(torch.zeros(16, 96, dtype=torch.uint8))


def _bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32)


def test_dequantizer_bit_arithmetic_is_exact_for_every_code():
    """fp8_pair in csrc/fp8_mma.cu: byte b in the high byte of a 16-bit half, ((h >> 4) & 0x07F0) | (h & 0x8000)
    read as bf16, times 2^120 = the E4M3 value (subnormals and signed zero included; NaN codes excluded: the
    checkpoint loader rejects them)."""
    b = torch.arange(256, dtype=torch.int32)
    h = b << 8
    v = ((h >> 4) & 0x07F0) | (h & 0x8000)
    got = _bf16_bits_to_float(v) * 2.0**120
    want = b.to(torch.uint8).view(torch.float8_e4m3fn).float()
    ok = ~torch.isnan(want)
    assert int(ok.sum()) == 254
    assert torch.equal(got[ok], want[ok])
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))


def test_launch_plan():
    assert FM.launch_plan(1, 12288, 2048) == (8, 4, 1)
    assert FM.launch_plan(8, 9216, 2048) == (12, 2, 1)
    assert FM.launch_plan(32, 12288, 2048) == (12, 2, 1)
    assert FM.launch_plan(4, 12288, 2048) == (8, 4, 1) and FM.launch_plan(33, 12288, 2048) == (8, 1, 1)
    assert FM.launch_plan(1, 2048, 4096) == (8, 4, 4)  # 64 CTAs x 4
    assert FM.launch_plan(64, 2048, 4096) == (8, 1, 8)  # 16 x 8: the split's cap
    assert FM.launch_plan(1, 2048, 256) == (8, 4, 1)  # no split of a single piece


def test_launch_plan_wide_switch(monkeypatch):
    monkeypatch.setenv("VIBEQWEN_FP8_WIDE", "0")
    assert FM.launch_plan(8, 9216, 2048) == (8, 2, 1) and FM.launch_plan(32, 12288, 2048) == (8, 1, 1)


def test_launch_plan_override(monkeypatch):
    """VIBEQWEN_FP8_PLAN="WxKS" (warps x k slices; measuring) replaces the rule's warps and k slices; the split
    follows."""
    monkeypatch.setenv("VIBEQWEN_FP8_PLAN", "16x2")
    assert FM.launch_plan(32, 12288, 2048) == (16, 2, 1)
    assert FM.launch_plan(32, 2048, 4096) == (16, 2, 8)  # 16 CTAs: split until 256 CTAs, capped at 8
    for bad in ("6x2", "12x2x1", "12,2", "x2"):
        monkeypatch.setenv("VIBEQWEN_FP8_PLAN", bad)
        with pytest.raises(ValueError, match="VIBEQWEN_FP8_PLAN"):
            FM.launch_plan(32, 12288, 2048)


def test_linear_mma_rejects_bad_inputs():
    codes = torch.zeros(32, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = FM.prepack_fp8_mma(prepack_fp8(codes, 0.5))
    x = torch.randn(2, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="x must be bf16"):
        FM.fp8_linear_mma(x.float(), w)
    with pytest.raises(ValueError, match="x must be bf16"):
        FM.fp8_linear_mma(torch.randn(65, 256).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="x must be bf16"):
        FM.fp8_linear_mma(torch.randn(2, 128).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="out must be"):
        FM.fp8_linear_mma(x, w, out=torch.empty(2, 31))
    with pytest.raises(ValueError, match="bad plan"):
        FM.fp8_linear_mma(x, w, plan=(4, 1, 2))  # K = 256: one piece
    with pytest.raises(ValueError, match="bad plan"):
        FM.fp8_linear_mma(x, w, plan=(6, 1, 1))
    with pytest.raises(ValueError, match="bad plan"):
        FM.fp8_linear_mma(x, w, plan=(4, 3, 1))
    with pytest.raises(RuntimeError, match="not available"):
        FM.fp8_linear_mma(x, w)
    with pytest.raises(ValueError, match="multiple of 256"):
        FM.prepack_fp8_mma(prepack_fp8(torch.zeros(32, 192, dtype=torch.uint8).view(torch.float8_e4m3fn), 1.0))
    assert not FM.fp8_mma_supported(32, 256, torch.device("cpu"))


def _fp8_weight(n: int, k: int, per_row: bool, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.5
    q = w.clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (torch.rand(n, generator=gen) + 0.5) / 64 if per_row else 0.02
    return prepack_fp8(q.to(device), scale, device)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def _skip_without_library():
    if FM.fp8_mma_library(torch.device("cuda")) is None:
        pytest.skip("the CUDA FP8 kernel could not be built here")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 24, 32, 33, 64])
@pytest.mark.parametrize("n,k", [(12288, 2048), (2048, 4096), (48, 512)])
def test_gpu_matches_reference(m, n, k):
    _skip_without_library()
    w = _fp8_weight(n, k, per_row=(m % 2 == 1), device="cuda", seed=m + n)
    wm = FM.prepack_fp8_mma(w)
    x = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)
    ref = fp8_linear_ref(x, w)
    y = FM.fp8_linear_mma(x, wm)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert _rel(y, ref) < 4e-3
    y32 = FM.fp8_linear_mma(x, wm, out_dtype=torch.float32)
    assert _rel(y32, ref) < 1e-5


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("plan", [(4, 1, 1), (8, 1, 1), (4, 2, 2), (8, 4, 4), (4, 4, 8), (8, 2, 1), (12, 1, 1),
                                  (12, 2, 1), (16, 2, 1), (16, 4, 2)])
@pytest.mark.parametrize("m", [5, 40])
def test_gpu_plans(plan, m):
    """Every warps / k slices / split choice gives the reference: N = 2064 (129 tiles: the last CTA's warps past the
    matrix),
    K = 2048, per-row scales, a strided x (rows of a wider tensor) and an out buffer."""
    _skip_without_library()
    n, k = 2064, 2048
    w = _fp8_weight(n, k, per_row=True, device="cuda", seed=7)
    wm = FM.prepack_fp8_mma(w)
    big = torch.randn(m, k + 256, device="cuda").to(torch.bfloat16)
    x = big[:, 128 : 128 + k]
    out = torch.full((m, n), float("nan"), device="cuda")
    FM.fp8_linear_mma(x, wm, out=out, plan=plan)
    assert _rel(out, fp8_linear_ref(x, w)) < 1e-5


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("n,k", [(9216, 2048), (2048, 4096)])  # the second splits K: partials + the reduce launch
def test_gpu_cuda_graph_replay(n, k):
    _skip_without_library()
    w = _fp8_weight(n, k, per_row=False, device="cuda", seed=3)
    wm = FM.prepack_fp8_mma(w)
    assert (FM.launch_plan(8, n, k)[2] > 1) == (n < 8192)
    x = torch.randn(8, k, device="cuda").to(torch.bfloat16)
    out = torch.empty(8, n, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        FM.fp8_linear_mma(x, wm, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        FM.fp8_linear_mma(x, wm, out=out)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(out, FM.fp8_linear_mma(x, wm), rtol=0, atol=0)


@pytest.mark.gpu
@requires_gpu
def test_gpu_fp8_linear_layer_uses_the_kernel(monkeypatch):
    """FP8Linear keeps the shuffled copy on the GPU and runs bf16 inputs of 1..64 rows on it, float32 inputs on the
    Triton kernel; both agree with the reference; VIBEQWEN_FP8_MMA=0 makes no copy."""
    _skip_without_library()
    from vibeqwen.model.quant_linear import FP8Linear

    gen = torch.Generator().manual_seed(9)
    q = (torch.randn(4096, 2048, generator=gen) * 0.5).to(torch.float8_e4m3fn).cuda()
    scale = torch.full((4096,), 0.03, device="cuda")
    layer = FP8Linear(q, scale, torch.bfloat16)
    assert layer.mma is not None
    calls = []
    real = FM.fp8_linear_mma
    monkeypatch.setattr(FM, "fp8_linear_mma", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    x = torch.randn(12, 2048, device="cuda").to(torch.bfloat16)
    y = layer(x)
    assert calls == [12]
    assert _rel(y, fp8_linear_ref(x, layer.packed)) < 4e-3
    # not bf16: the Triton kernel, the same result
    y32 = layer(x.float())
    assert calls == [12] and y32.dtype == torch.float32
    assert _rel(y32, fp8_linear_ref(x, layer.packed)) < 1e-3
    # VIBEQWEN_FP8_MMA=0 (or VIBEQWEN_MOE_MMA=0): no copy, the Triton kernel
    monkeypatch.setenv("VIBEQWEN_FP8_MMA", "0")
    assert FP8Linear(q, scale, torch.bfloat16).mma is None


# ---- the conv epilogue (fp8_linear_mma_conv): GDN's qkv|z projection of a decode step


def test_conv_supported_rule(monkeypatch):
    codes = torch.zeros(12288, 2048, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = FM.FP8MMAWeight(codes=codes, scale=torch.ones(1), n=12288, k=2048)  # the rule reads shapes only
    assert FM.fp8_conv_supported(1, w, 8192, 4) and FM.fp8_conv_supported(32, w, 8192, 4)
    assert not FM.fp8_conv_supported(33, w, 8192, 4)  # past CONV_MAX_M
    assert not FM.fp8_conv_supported(1, w, 8192, 3)  # another conv width
    assert not FM.fp8_conv_supported(1, w, 8200, 4) and not FM.fp8_conv_supported(1, w, 12304, 4)
    small = FM.FP8MMAWeight(codes=codes[:2048], scale=torch.ones(1), n=2048, k=4096)
    assert not FM.fp8_conv_supported(1, small, 1024, 4)  # its plan splits K
    monkeypatch.setenv("VIBEQWEN_FP8_CONV", "0")
    assert not FM.fp8_conv_supported(1, w, 8192, 4)


def test_conv_epilogue_rejects_bad_inputs():
    codes = torch.zeros(64, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = FM.prepack_fp8_mma(prepack_fp8(codes, 0.5))
    x = torch.randn(2, 256).to(torch.bfloat16)
    cw = torch.randn(32, 4).to(torch.bfloat16)
    st = torch.zeros(4, 32, 3, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1])
    init = torch.tensor([True, False])
    with pytest.raises(ValueError, match="x must be bf16"):
        FM.fp8_linear_mma_conv(torch.randn(33, 256).to(torch.bfloat16), w, cw, st, slots, init)
    with pytest.raises(ValueError, match="conv_weight must be"):
        FM.fp8_linear_mma_conv(x, w, cw[:24], st, slots, init)  # C not a multiple of 16
    with pytest.raises(ValueError, match="conv_weight must be"):
        FM.fp8_linear_mma_conv(x, w, torch.randn(32, 3).to(torch.bfloat16), st, slots, init)
    with pytest.raises(ValueError, match="conv_weight must be"):
        FM.fp8_linear_mma_conv(x, w, torch.randn(80, 4).to(torch.bfloat16), st, slots, init)  # C > N
    with pytest.raises(ValueError, match="conv_states must be"):
        FM.fp8_linear_mma_conv(x, w, cw, st.float(), slots, init)
    with pytest.raises(ValueError, match="conv_states must be"):
        FM.fp8_linear_mma_conv(x, w, cw, torch.zeros(4, 3, 32, dtype=torch.bfloat16).transpose(1, 2), slots, init)
    with pytest.raises(ValueError, match="slots must be"):
        FM.fp8_linear_mma_conv(x, w, cw, st, slots.int(), init)
    with pytest.raises(ValueError, match="slots must be"):
        FM.fp8_linear_mma_conv(x, w, cw, st, slots, init[:1])
    with pytest.raises(ValueError, match="warps 8, 12 or 16"):
        FM.fp8_linear_mma_conv(x, w, cw, st, slots, init, warps=4)
    with pytest.raises(RuntimeError, match="not available"):
        FM.fp8_linear_mma_conv(x, w, cw, st, slots, init)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 3, 8, 16, 32])
def test_gpu_conv_epilogue_equals_gemm_then_conv(m):
    """The fused launch against fp8_linear_mma + causal_conv1d on the model's shape (12288 x 2048, 8192 conv
    channels), bit for bit: the conv channels' output, the z channels, and every state slot afterwards (rows
    without initial state read zeros; slots out of order; a slot nobody uses stays as it was)."""
    _skip_without_library()
    from vibeqwen_kernels.conv1d.causal import causal_conv1d

    n, k, c = 12288, 2048, 8192
    w = _fp8_weight(n, k, per_row=True, device="cuda", seed=40 + m)
    wm = FM.prepack_fp8_mma(w)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    taps = (torch.randn(c, 4, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    states = torch.randn(m + 3, c, 3, device="cuda", generator=gen).to(torch.bfloat16)
    slots = torch.randperm(m + 3, device="cuda", generator=gen)[:m].to(torch.int64)
    init = torch.rand(m, device="cuda", generator=gen) < 0.7
    init[0] = True
    if m > 1:
        init[1] = False
    qsl = torch.arange(m + 1, device="cuda", dtype=torch.int32)
    before = states.clone()
    ref_states = states.clone()
    y = FM.fp8_linear_mma(x, wm)
    ref = y.clone()
    ref[:, :c] = causal_conv1d(y[:, :c], taps, ref_states, slots, qsl, init, 1)
    out = FM.fp8_linear_mma_conv(x, wm, taps, states, slots, init)
    torch.testing.assert_close(out[:, c:], ref[:, c:], rtol=0, atol=0)
    torch.testing.assert_close(out[:, :c], ref[:, :c], rtol=0, atol=0)
    torch.testing.assert_close(states, ref_states, rtol=0, atol=0)
    # 8, 12 and 16 warps a CTA at the same k slices (the sums depend on the slices only): the same bits
    for ks in (1, 2):
        outs = []
        for warps in (8, 12, 16):
            st = before.clone()
            outs.append((FM.fp8_linear_mma_conv(x, wm, taps, st, slots, init, kslices=ks, warps=warps), st))
        for out, st in outs[1:]:
            torch.testing.assert_close(out, outs[0][0], rtol=0, atol=0)
            torch.testing.assert_close(st, outs[0][1], rtol=0, atol=0)


def _capture(fn, warmup=None):
    """fn run once on a side stream (``warmup`` instead where given: e.g. on copies of state fn updates), then
    captured in a CUDA graph; returns (graph, what the captured call returned)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (warmup or fn)()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        result = fn()
    return g, result


@pytest.mark.gpu
@requires_gpu
def test_gpu_conv_epilogue_in_a_cuda_graph():
    """Captured once, replayed on new inputs: the same bits as an eager call on the same state."""
    _skip_without_library()
    n, k, c, m = 12288, 2048, 8192, 4
    w = _fp8_weight(n, k, per_row=False, device="cuda", seed=5)
    wm = FM.prepack_fp8_mma(w)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    taps = torch.randn(c, 4, device="cuda").to(torch.bfloat16)
    states = torch.randn(m, c, 3, device="cuda").to(torch.bfloat16)
    slots = torch.arange(m, device="cuda")
    init = torch.ones(m, dtype=torch.bool, device="cuda")
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    g, _ = _capture(lambda: FM.fp8_linear_mma_conv(x, wm, taps, states, slots, init, out=out),
                    warmup=lambda: FM.fp8_linear_mma_conv(x, wm, taps, states.clone(), slots, init, out=out))
    x.copy_(torch.randn_like(x))
    before = states.clone()
    g.replay()
    after = before.clone()
    want = FM.fp8_linear_mma_conv(x, wm, taps, after, slots, init)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(states, after, rtol=0, atol=0)


def test_add_rms_norm_rejects_bad_inputs():
    codes = torch.zeros(32, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = FM.prepack_fp8_mma(prepack_fp8(codes, 0.5))
    x = torch.randn(2, 256).to(torch.bfloat16)
    r, nw = torch.randn(2, 32).to(torch.bfloat16), torch.randn(32)
    with pytest.raises(ValueError, match="x must be bf16"):
        FM.fp8_linear_mma_add_rms_norm(x.float(), w, r, nw, 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        FM.fp8_linear_mma_add_rms_norm(x, w, r.float(), nw, 1e-6)
    with pytest.raises(ValueError, match="residual must be"):
        FM.fp8_linear_mma_add_rms_norm(x, w, r[:1], nw, 1e-6)
    with pytest.raises(RuntimeError, match="not available"):
        FM.fp8_linear_mma_add_rms_norm(x, w, r, nw, 1e-6)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 3, 8, 16, 24, 32, 64])
@pytest.mark.parametrize("n,k", [(2048, 4096), (2064, 2048)])  # split K (the model's out projections); no split
def test_gpu_add_rms_norm_equals_three_launches(m, n, k):
    """fp8_linear_mma_add_rms_norm against fp8_linear_mma + rms_norm (residual): the residual stream bit for bit;
    the normed output equal up to the norm's fp32 summation order (one bf16 ulp at most, under 1% of the values;
    bit for bit without a K split, which runs the same two kernels)."""
    _skip_without_library()
    from vibeqwen_kernels.norm_fused import rms_norm

    w = _fp8_weight(n, k, per_row=(m % 2 == 0), device="cuda", seed=60 + m)
    wm = FM.prepack_fp8_mma(w)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    res = (torch.randn(m, n, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    nw = torch.randn(n, device="cuda", generator=gen) * 0.2
    y_ref, h_ref = rms_norm(FM.fp8_linear_mma(x, wm), nw, 1e-6, residual=res)
    y, h = FM.fp8_linear_mma_add_rms_norm(x, wm, res, nw, 1e-6)
    assert y.shape == h.shape == (m, n) and y.dtype == h.dtype == torch.bfloat16
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    if FM.launch_plan(m, n, k)[2] == 1:
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    else:
        diff = (y.float() - y_ref.float()).abs()
        assert (diff <= 2.0**-7 * y_ref.float().abs() + 1e-6).all()
        assert (diff > 0).float().mean().item() <= 0.01


@pytest.mark.gpu
@requires_gpu
def test_gpu_add_rms_norm_in_a_cuda_graph():
    _skip_without_library()
    n, k, m = 2048, 4096, 8
    wm = FM.prepack_fp8_mma(_fp8_weight(n, k, per_row=True, device="cuda", seed=8))
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    res = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    nw = torch.randn(n, device="cuda") * 0.2
    g, (y, h) = _capture(lambda: FM.fp8_linear_mma_add_rms_norm(x, wm, res, nw, 1e-6))
    x.copy_(torch.randn_like(x))
    res.copy_(torch.randn_like(res))
    g.replay()
    y2, h2 = FM.fp8_linear_mma_add_rms_norm(x, wm, res, nw, 1e-6)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    torch.testing.assert_close(h, h2, rtol=0, atol=0)

