"""Fused RMSNorm kernels (`vibeqwen_kernels.norm_fused`) against `rms_norm_ref` / `gated_rms_norm_ref`.

Tolerances. The residual sum is one fp32 add rounded once to x's dtype, as torch does: it must be
bit-exact. The normalised outputs differ from the references only by fp32 summation order of
mean(x^2) and the GPU's sqrt / division / exp (a few fp32 ulp), so a final (or, for the gated norm,
an intermediate) rounding to bf16 can flip by one bf16 ulp (2^-8 relative) where the fp32 value sits
near a rounding tie. GPU checks: |y - ref| <= 2^-7 |ref| + 1e-6 elementwise (one ulp plus margin;
two for the gated norm, whose intermediates are rounded three times) and at most 1% of elements
differing at all. The interpreter runs fp32/fp16 (its bf16 is broken) on the CPU with numpy's exact
sqrt/exp: near bit-exact there.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from vibeqwen_kernels.norm import gated_rms_norm_ref, rms_norm_ref

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and a CUDA GPU"
)
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

EPS = 1e-6


def _close_bf16(y: torch.Tensor, ref: torch.Tensor, ulps: int) -> None:
    assert torch.isfinite(y).all(), "non-finite or unwritten outputs"
    yf, rf = y.float(), ref.float()
    # one bf16 ulp is up to 2^-7 relative (just above a power of two); the fp32 reduction order and the
    # GPU's rsqrt move a value across a rounding boundary at most `ulps` times
    torch.testing.assert_close(yf, rf, rtol=ulps * 2.0**-7 + 2.0**-9, atol=1e-6)
    frac = (y != ref).float().mean().item()
    assert frac <= 0.01, f"{frac:.2%} of elements differ from the reference"


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [1, 7, 64, 8192])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gpu(t, with_residual):
    from vibeqwen_kernels.norm_fused import rms_norm

    d = 2048
    dev = torch.device("cuda")
    base = torch.randn(t, d + 64, device=dev, dtype=torch.bfloat16) * 4
    x = base[:, 32 : 32 + d]  # strided row view
    w = (torch.randn(d, device=dev) * 0.2).to(torch.bfloat16)
    if with_residual:
        r = torch.randn(t, d, device=dev, dtype=torch.bfloat16) * 20
        x_before, r_before = x.clone(), r.clone()
        y, h = rms_norm(x, w, EPS, r)
        assert torch.equal(x, x_before) and torch.equal(r, r_before), "inputs modified"
        assert torch.equal(h, x + r), "residual sum not bit-exact"
        _close_bf16(y, rms_norm_ref(x + r, w, EPS), 1)
        # in place into the residual buffer
        y2, h2 = rms_norm(x, w, EPS, r, residual_out=r)
        assert h2 is r and torch.equal(r, x + r_before) and torch.equal(y2, y)
    else:
        y = rms_norm(x, w, EPS)
        assert y.shape == (t, d) and y.dtype == torch.bfloat16 and y.is_contiguous()
        _close_bf16(y, rms_norm_ref(x, w, EPS), 1)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [1, 64, 8192])
def test_gated_rms_norm_gpu(t):
    from vibeqwen_kernels.norm_fused import gated_rms_norm

    h, d = 32, 128
    dev = torch.device("cuda")
    x = torch.randn(t, h, d, device=dev, dtype=torch.bfloat16)
    fused = torch.randn(t, 3 * h * d, device=dev, dtype=torch.bfloat16) * 3  # z a column slice of it
    z = fused[:, h * d : 2 * h * d].view(t, h, d)
    assert t == 1 or not z.is_contiguous()
    w = (1 + 0.2 * torch.randn(d, device=dev)).to(torch.bfloat16)
    y = gated_rms_norm(x, z, w, EPS)
    assert y.shape == (t, h, d) and y.is_contiguous() and y.dtype == torch.bfloat16
    _close_bf16(y, gated_rms_norm_ref(x, z, w, EPS), 2)
    # fp32 weight (rounded to bf16 inside, as the reference does)
    w32 = 1 + 0.2 * torch.randn(d, device=dev)
    _close_bf16(gated_rms_norm(x, z, w32, EPS), gated_rms_norm_ref(x, z, w32, EPS), 2)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [1, 65, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantize_gpu(t, with_residual):
    """rms_norm(quantize=True): h exactly and y within the kernel tolerance of the plain launch (the two
    compilations may sum mean(x^2) in another order: a rare one-ulp flip), and the E4M3 codes and scales bit
    for bit those of quantize_rows_fp8 of the y it returned (the same operations on the same values)."""
    from vibeqwen_kernels.fp8 import quantize_rows_fp8
    from vibeqwen_kernels.norm_fused import rms_norm

    d = 2048
    x = (torch.randn(t, d, device="cuda") * torch.logspace(-2, 2, t, device="cuda")[:, None]).to(torch.bfloat16)
    w = torch.randn(d, device="cuda") * 0.1
    r = torch.randn(t, d, device="cuda", dtype=torch.bfloat16) if with_residual else None
    plain = rms_norm(x, w, EPS, r) if with_residual else (rms_norm(x, w, EPS),)
    got = rms_norm(x, w, EPS, r, quantize=True)
    assert len(got) == len(plain) + 1
    _close_bf16(got[0], plain[0], ulps=1)
    if with_residual:
        assert torch.equal(got[1], plain[1])
    yq = got[-1]
    q, s = quantize_rows_fp8(got[0])
    assert torch.equal(yq.scale, s)
    assert torch.equal(yq.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("t", [1, 65, 1024])
def test_gated_rms_norm_fp8_gpu(t):
    """gated_rms_norm_fp8: the E4M3 codes and scales of quantize_rows_fp8(gated_rms_norm(...) as [T, H * D]),
    bit for bit; the gate a strided view, as in the model."""
    from vibeqwen_kernels.fp8 import quantize_rows_fp8
    from vibeqwen_kernels.norm_fused import gated_rms_norm, gated_rms_norm_fp8

    h, d = 32, 128
    x = (torch.randn(t, h, d, device="cuda") * torch.logspace(-2, 2, t, device="cuda")[:, None, None]).to(torch.bfloat16)
    z = (torch.randn(t, h, 2 * d, device="cuda", dtype=torch.bfloat16) * 3)[..., d:]
    w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    got = gated_rms_norm_fp8(x, z, w, EPS)
    q, s = quantize_rows_fp8(gated_rms_norm(x, z, w, EPS).reshape(t, h * d))
    assert got.q.shape == (t, h * d) and got.scale.shape == (t, 1)
    assert torch.equal(got.scale, s)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.gpu
@requires_gpu
def test_cuda_graph_capture():
    from vibeqwen_kernels.norm_fused import gated_rms_norm, rms_norm

    dev = torch.device("cuda")
    x = torch.randn(16, 2048, device=dev, dtype=torch.bfloat16)
    r = torch.randn(16, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, device=dev, dtype=torch.bfloat16) * 0.1
    gx = torch.randn(16, 4, 128, device=dev, dtype=torch.bfloat16)
    gz = torch.randn(16, 4, 128, device=dev, dtype=torch.bfloat16)
    gw = torch.randn(128, device=dev, dtype=torch.bfloat16)
    rms_norm(x, w, EPS, r)
    gated_rms_norm(gx, gz, gw, EPS)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y, h = rms_norm(x, w, EPS, r)
        gy = gated_rms_norm(gx, gz, gw, EPS)
    x.copy_(torch.randn_like(x))
    gx.copy_(torch.randn_like(gx))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(h, x + r)
    _close_bf16(y, rms_norm_ref(x + r, w, EPS), 1)
    _close_bf16(gy, gated_rms_norm_ref(gx, gz, gw, EPS), 2)


def _interpreted_worst(script: str) -> float:
    """Runs script under Triton's CPU interpreter (a subprocess: TRITON_INTERPRET must be set before triton
    compiles anything); returns the float its last line of output prints (its worst error)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return float(res.stdout.strip().splitlines()[-1])


@requires_triton
def test_interpreter_fp32_fp16():
    """The same kernels under Triton's CPU interpreter (subprocess: TRITON_INTERPRET must be set before
    triton compiles anything): strided rows, odd D, several rows per program, residual in place."""
    script = textwrap.dedent(
        """
        import torch
        from vibeqwen_kernels.norm import gated_rms_norm_ref, rms_norm_ref
        from vibeqwen_kernels.norm_fused import gated_rms_norm, rms_norm
        torch.manual_seed(0)
        worst = 0.0
        def err(y, ref):
            assert y.dtype == ref.dtype and y.shape == ref.shape and torch.isfinite(y).all()
            return ((y.float() - ref.float()).abs() / (ref.float().abs() + 1e-3)).max().item()
        for dt in (torch.float32, torch.float16):
            for t, d in ((1, 2048), (5, 300), (37, 64)):
                base = torch.randn(t, d + 8, dtype=dt) * 3
                x = base[:, 3:3 + d]
                r = torch.randn(t, d, dtype=dt) * 5
                w = torch.randn(d) * 0.1
                worst = max(worst, err(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)))
                y, h = rms_norm(x, w, 1e-6, r)
                assert torch.equal(h, x + r)
                worst = max(worst, err(y, rms_norm_ref(x + r, w, 1e-6)))
                r0 = r.clone()
                y2, h2 = rms_norm(x, w, 1e-6, r, residual_out=r)
                assert h2 is r and torch.equal(r, x + r0) and torch.equal(y2, y)
            for t, hh, d in ((3, 5, 128), (4, 3, 48)):
                x = torch.randn(t, hh, d, dtype=dt).transpose(0, 1).contiguous().transpose(0, 1)
                z = (torch.randn(t, hh, 2 * d, dtype=dt) * 3)[..., d:]
                for w in (torch.randn(d).to(dt), torch.randn(d)):
                    y = gated_rms_norm(x, z, w, 1e-6)
                    assert y.is_contiguous()
                    worst = max(worst, err(y, gated_rms_norm_ref(x, z, w, 1e-6)))
        print(worst)
        """
    )
    # fp16 outputs may flip one fp16 ulp (2^-10) where fp32 summation order moves a tie
    assert _interpreted_worst(script) <= 2.0**-10


@requires_triton
def test_interpreter_splitk_add_rms_norm():
    """splitk_add_rms_norm under the interpreter against its definition: the partials summed in split order, the
    scale (one value or per column), the rounding to the residual's dtype, the add (bit for bit) and rms_norm_ref;
    residual_out in place of the residual."""
    script = textwrap.dedent(
        """
        import torch
        from vibeqwen_kernels.norm import rms_norm_ref
        from vibeqwen_kernels.norm_fused import splitk_add_rms_norm
        torch.manual_seed(1)
        worst = 0.0
        for dt in (torch.float32, torch.float16):
            for s, t, d, per_col in ((1, 1, 2048, False), (4, 3, 300, True), (8, 9, 64, True)):
                ws = torch.randn(s, t, d) * 4
                scale = torch.rand(d) + 0.5 if per_col else torch.tensor([0.25])
                r = (torch.randn(t, 2 * d) * 3).to(dt)[:, d:]  # strided rows
                w = torch.randn(d) * 0.1
                acc = torch.zeros(t, d)
                for i in range(s):
                    acc = acc + ws[i]
                x = (acc * scale).to(dt)
                h_ref = (x.float() + r.float()).to(dt)
                y, h = splitk_add_rms_norm(ws, scale, r, w, 1e-6)
                assert y.dtype == dt and h.dtype == dt and torch.equal(h, h_ref), (dt, s, t, d)
                ref = rms_norm_ref(h_ref, w, 1e-6)
                worst = max(worst, ((y.float() - ref.float()).abs() / (ref.float().abs() + 1e-3)).max().item())
                r2 = r.clone()
                y2, h2 = splitk_add_rms_norm(ws, scale, r2, w, 1e-6, residual_out=r2)
                assert h2 is r2 and torch.equal(r2, h_ref) and torch.equal(y2, y)
        print(worst)
        """
    )
    assert _interpreted_worst(script) <= 2.0**-10


def test_splitk_add_rms_norm_rejects_bad_inputs(monkeypatch):
    from vibeqwen_kernels.norm_fused import splitk_add_rms_norm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ws, sc, r, w = torch.randn(2, 3, 16), torch.ones(16), torch.randn(3, 16), torch.randn(16)
    with pytest.raises(ValueError, match="CUDA"):
        splitk_add_rms_norm(ws, sc, r, w, EPS)  # CPU outside the interpreter
    with pytest.raises(ValueError, match="ws must be"):
        splitk_add_rms_norm(ws.double(), sc, r, w, EPS)
    with pytest.raises(ValueError, match="splits"):
        splitk_add_rms_norm(torch.randn(17, 3, 16), sc, r, w, EPS)
    with pytest.raises(ValueError, match="scale"):
        splitk_add_rms_norm(ws, torch.ones(8), r, w, EPS)
    with pytest.raises(ValueError, match="residual"):
        splitk_add_rms_norm(ws, sc, torch.randn(3, 8), w, EPS)
    with pytest.raises(ValueError, match="weight"):
        splitk_add_rms_norm(ws, sc, r, torch.randn(8), EPS)
    with pytest.raises(ValueError, match="residual_out"):
        splitk_add_rms_norm(ws, sc, r, w, EPS, residual_out=torch.empty(3, 16, dtype=torch.float16))


def test_gated_rms_norm_fp8_rejects_bad_shapes():
    from vibeqwen_kernels.norm_fused import gated_rms_norm_fp8

    x = torch.randn(2, 3, 128)
    with pytest.raises(ValueError, match="powers of two"):
        gated_rms_norm_fp8(x, x, torch.ones(128), EPS)
    with pytest.raises(ValueError, match="z must be"):
        gated_rms_norm_fp8(torch.randn(2, 4, 128), x, torch.ones(128), EPS)


def test_rejects_bad_inputs(monkeypatch):
    from vibeqwen_kernels.norm_fused import gated_rms_norm, rms_norm

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(4, 16)
    w = torch.randn(16)
    with pytest.raises(ValueError):
        rms_norm(x, w, EPS)  # CPU outside the interpreter
    with pytest.raises(ValueError):
        rms_norm(x[0], w, EPS)
    with pytest.raises(ValueError):
        rms_norm(x, torch.randn(8), EPS)
    with pytest.raises(ValueError):
        rms_norm(x, w, EPS, torch.randn(4, 8))
    with pytest.raises(ValueError):
        rms_norm(x, w, EPS, residual_out=torch.empty(4, 16))
    with pytest.raises(ValueError):
        rms_norm(x.int(), w, EPS)
    with pytest.raises(ValueError):
        gated_rms_norm(torch.randn(2, 3, 8), torch.randn(2, 3, 4), torch.randn(8), EPS)
    with pytest.raises(ValueError):
        gated_rms_norm(torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(8), EPS)
