"""FP8 W8A8 linear (`vibeqwen_kernels.fp8.w8a8`): the per-token E4M3 quantizer and the scaled-mm GEMM.

CPU: the reference quantizer's definition (scale = amax / 448, every code within half an E4M3 step of x /
scale) and the W8A8 reference's distance from the exact W8A16 product (the activation rounding alone).
GPU: the Triton quantizer against the reference, bit for bit (both divide with IEEE rounding and round to
nearest even), and `fp8_w8a8_linear` against the fp64 product of the codes the quantizer gave, on fresh
random inputs. Tolerance of the GEMM: E4M3 x E4M3 products are exact and the accumulation is fp32, so only
the summation order and the output's one bf16 rounding (2^-9 relative) differ: ||y - ref|| / ||ref|| <= 4e-3
and elementwise |y - ref| <= 8e-3 |ref| + 1e-3 rms(ref), as in test_fp8_linear.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from vibeqwen_kernels.fp8 import (
    fp8_linear_ref,
    fp8_w8a8_linear,
    fp8_w8a8_linear_ref,
    prepack_fp8,
    quantize_rows_fp8,
    quantize_rows_fp8_ref,
)

from vibeqwen.checkpoint.quant import fp8_quantize

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU")

# (N, K) of the model's FP8 projections: GDN in_proj qkv|z, attention q|k|v, the out projections
SHAPES = [(12288, 2048), (9216, 2048), (2048, 4096), (64, 2048)]
MS = [65, 300, 1024, 2048]


def _weight(n: int, k: int, device, scale: float = 0.02):
    q, s = fp8_quantize(torch.randn(n, k, device=device, dtype=torch.bfloat16) * scale)
    return prepack_fp8(q, s, device)


def _e4m3_half_step(v: torch.Tensor) -> torch.Tensor:
    """Half the E4M3 spacing at |v| (3 mantissa bits; subnormal spacing 2^-9 below 2^-6)."""
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**-6)))
    return 2.0 ** (e - 3) / 2


def test_reference_quantizer_definition():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=g) * torch.logspace(-3, 2, 37)[:, None]
    x[5] = 0  # an all-zero row: finite scale, zero codes
    x[7, 11] = -1e4  # one outlier: its row's scale follows it, nothing clips
    q, s = quantize_rows_fp8_ref(x.to(torch.bfloat16))
    xb = x.to(torch.bfloat16).float()
    assert q.dtype == torch.float8_e4m3fn and s.shape == (37, 1) and s.dtype == torch.float32
    amax = xb.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(s.double(), (amax.clamp_min(1e-12).double() / 448).float().double(), rtol=0, atol=0)
    assert (q[5].float() == 0).all()
    qf = q.float()
    assert qf.abs().max() <= 448 and (qf.abs().amax(-1)[amax[:, 0] > 0] == 448).all()
    err = (qf - xb / s).abs()
    assert (err <= _e4m3_half_step(xb / s) + 1e-6).all(), "a code is not the nearest E4M3 value"


def test_reference_w8a8_within_activation_rounding_of_w8a16():
    """W8A8 differs from the exact product only by the activations' E4M3 rounding: ~2.4% rms relative per
    value, the same order on the output; a wrong scale or layout gives O(1)."""
    g = torch.Generator().manual_seed(1)
    w = prepack_fp8(*fp8_quantize(torch.randn(256, 512, generator=g) * 0.02), "cpu")
    x = torch.randn(96, 512, generator=g).to(torch.bfloat16)
    ref = fp8_linear_ref(x.float(), w)
    y = fp8_w8a8_linear_ref(x, w)
    rel = ((y - ref).norm() / ref.norm()).item()
    assert 5e-3 < rel < 4e-2, rel
    # the CPU dispatch runs the reference
    torch.testing.assert_close(fp8_w8a8_linear(x, w, out_dtype=torch.float32), y, rtol=0, atol=0)


def test_bad_shapes_raise():
    w = prepack_fp8(*fp8_quantize(torch.randn(32, 64) * 0.02), "cpu")
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        fp8_w8a8_linear(torch.randn(4, 48), w)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_rows_fp8(torch.randn(64, 4).t())


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("k", [2048, 4096, 300])
@pytest.mark.parametrize("m", [1, 65, 1024])
def test_quantizer_matches_reference_bitwise(m, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * torch.logspace(-4, 3, m, device="cuda")[:, None]
    x[0, : k // 3] = 0
    if m > 1:
        x[1] = 0
    q, s = quantize_rows_fp8(x)
    rq, rs = quantize_rows_fp8_ref(x)
    # the scale is one IEEE division of amax (fp64 of two fp32 values, rounded once, is the same)
    exact = (x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12).double() / 448).float()
    assert torch.equal(rs, exact)
    assert torch.equal(s, rs), f"{(s != rs).sum().item()} of {m} scales differ"
    bad = q.view(torch.uint8) != rq.view(torch.uint8)
    where = bad.nonzero()[:5].tolist()
    detail = [((x[i, j].float() / s[i, 0]).item(), q[i, j].float().item(), rq[i, j].float().item()) for i, j in where]
    assert not bad.any(), f"{bad.sum().item()} of {q.numel()} codes differ (x / scale, ours, reference): {detail}"


@pytest.mark.gpu
@requires_gpu
def test_quantizer_keeps_nan_rows():
    """A row holding a NaN quantizes to a NaN scale and NaN codes (as the reference: a bad activation is not
    hidden behind finite codes); other rows are untouched."""
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    x[1, 7] = float("nan")
    q, s = quantize_rows_fp8(x)
    rq, rs = quantize_rows_fp8_ref(x)
    assert torch.isnan(s[1]).all() and torch.isnan(rs[1]).all()
    assert torch.isnan(q[1].float()).all() and torch.isnan(rq[1].float()).all()
    keep = [0, 2, 3]
    assert torch.equal(s[keep], rs[keep]) and torch.equal(q[keep].view(torch.uint8), rq[keep].view(torch.uint8))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", MS, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
def test_linear_matches_reference(n, k, m):
    w = _weight(n, k, "cuda")
    base = torch.randn(m, k + 64, device="cuda", dtype=torch.bfloat16)
    x = base[:, 32 : 32 + k]  # strided rows
    y = fp8_w8a8_linear(x, w)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    _check_gemm(y, x, w)


def _check_gemm(y, x, w):
    """y against the exact product of the codes the quantizer produced (fp64): the GEMM alone (the codes
    themselves are test_quantizer_matches_reference_bitwise's)."""
    q, s = quantize_rows_fp8(x)
    ref = ((q.double() * s.double()) @ (w.weight.double() * w.scale.double().reshape(-1, 1)).t()).float()
    yf = y.float()
    rel = ((yf - ref).norm() / ref.norm()).item()
    assert rel <= 4e-3, rel
    rms = ref.pow(2).mean().sqrt().item()
    torch.testing.assert_close(yf, ref, rtol=8e-3, atol=1e-3 * rms)


@pytest.mark.gpu
@requires_gpu
def test_linear_per_row_scales():
    """A concatenation of modules with different per-tensor scales (per-row scale vector)."""
    w1, w2 = _weight(256, 2048, "cuda", 0.02), _weight(128, 2048, "cuda", 0.5)
    w = prepack_fp8(torch.cat([w1.weight, w2.weight]),
                    torch.cat([w1.scale.expand(256), w2.scale.expand(128)]), "cuda")
    x = torch.randn(300, 2048, device="cuda", dtype=torch.bfloat16)
    y = fp8_w8a8_linear(x, w)
    _check_gemm(y[:, :256], x, w1)
    _check_gemm(y[:, 256:], x, w2)
