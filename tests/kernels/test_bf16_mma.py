"""bf16 decode GEMMs on the CUDA MMA kernel (`vibeqwen_kernels.bf16_mma`, `csrc/bf16_mma.cu`).

CPU: the fragment layout (every element of a 16 x 16 tile-step lands in exactly one lane slot, where the PTX ISA's
mma.m16n8k16 A fragment wants it), the shuffle read back through an emulation of the kernel's GEMM against the
bf16 reference GEMM, the argument checks.
GPU: the kernel against the fp32 GEMM rounded to bf16 on fresh random inputs for 1-64 rows (every n8-tile count), N not a
multiple of 16, strided x, CUDA-graph replay, and DenseLinear's decode path. Both round fp32 sums to bf16 once:
outputs agree to one bf16 ulp (the summation order differs), most of them exactly.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from vibeqwen_kernels import bf16_mma as B

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU")


def test_fragment_layout_is_a_permutation_matching_the_ptx_a_fragment():
    src = B.fragment_sources()
    seen = {pos for h in src for lane in h for pos in lane}
    assert len(seen) == 512 and seen == {(r, k) for r in range(16) for k in range(32)}
    for h in range(2):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            # registers a0..a3 (rows g, g + 8, g, g + 8); the A side pairs k with the B fragment's k, and the lane's
            # B fragments of both steps are the chunk's x elements 8 t .. 8 t + 7 (b0, b1 of step 0; of step 1)
            rows = [r for r, _ in src[h][lane]]
            assert rows == [g, g, g + 8, g + 8, g, g, g + 8, g + 8]
            ks = [k for _, k in src[h][lane]]
            b0 = [8 * t + 4 * h, 8 * t + 4 * h + 1]
            b1 = [8 * t + 4 * h + 2, 8 * t + 4 * h + 3]
            assert ks == b0 + b0 + b1 + b1


@pytest.mark.parametrize("rows,k", [(16, 32), (257, 256), (40, 96)])
def test_shuffle_reads_back_through_the_emulated_gemm(rows, k):
    gen = torch.Generator().manual_seed(rows + k)
    w = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    packed = B.shuffle_bf16_mma(w)
    tiles = -(-rows // 16)
    assert packed.shape == (tiles, k // 16, 32, 8) and packed.dtype == torch.bfloat16
    got = B.bf16_mma_emulated(x, packed)
    want = (x.float() @ w.float().t()).to(torch.bfloat16).float()
    assert torch.equal(got[:, :rows], want)
    assert torch.equal(got[:, rows:], torch.zeros(5, tiles * 16 - rows))  # zero padding rows


def test_argument_checks():
    w = B.prepack_bf16_mma(torch.randn(64, 256).to(torch.bfloat16))
    assert (w.n, w.k) == (64, 256) and w.packed.shape == (4, 16, 32, 8)
    with pytest.raises(ValueError, match="x must be bf16"):
        B.bf16_linear_mma(torch.randn(2, 256), w)
    with pytest.raises(ValueError, match="x must be bf16"):
        B.bf16_linear_mma(torch.randn(65, 256).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="x must be bf16"):
        B.bf16_linear_mma(torch.randn(2, 512).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="multiple of 256"):
        B.bf16_linear_mma(torch.randn(2, 96).to(torch.bfloat16), B.prepack_bf16_mma(torch.randn(16, 96).to(torch.bfloat16)))
    with pytest.raises(ValueError, match="K % 32"):
        B.shuffle_bf16_mma(torch.randn(16, 48).to(torch.bfloat16))
    x = torch.randn(2, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="out must be"):
        B.bf16_linear_mma(x, w, out=torch.empty(2, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="not available"):
        B.bf16_linear_mma(x, w)
    assert not B.bf16_mma_supported(64, 256, torch.device("cpu"))


def _ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fp32 GEMM rounded once to bf16 (cuBLAS's own bf16 GEMM may reduce split-K partials in bf16: PyTorch's
    allow_bf16_reduced_precision_reduction, on by default)."""
    return (x.float() @ weight.float().t()).to(torch.bfloat16)


def _close_to_one_ulp(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Both sides round an fp32 sum once: they differ by at most one bf16 ulp of the larger, plus the fp32 sums'
    own order difference (~2^-24 sqrt(K) |x| |w|, which matters where the sum cancels to near zero)."""
    got, ref = got.float(), ref.float()
    mag = torch.maximum(got.abs(), ref.abs())
    scale = (x.float().abs() @ weight.float().abs().t()) * 2.0 ** -16
    assert ((got - ref).abs() <= mag * 2.0 ** -7 + scale).all(), (got - ref).abs().max()
    assert (got == ref).float().mean() > 0.9


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("n,k", [(64, 2048), (264, 2048), (40, 256), (2048, 1024), (24, 4096)])
def test_gpu_matches_cublas(m, n, k):
    if B.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    weight = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(torch.bfloat16)
    w = B.prepack_bf16_mma(weight)
    for _ in range(2):
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        _close_to_one_ulp(B.bf16_linear_mma(x, w), _ref(x, weight), x, weight)


@pytest.mark.gpu
@requires_gpu
def test_gpu_strided_x_out_and_graph_replay():
    if B.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    gen = torch.Generator(device="cuda").manual_seed(3)
    weight = (torch.randn(64, 2048, generator=gen, device="cuda") / 45).to(torch.bfloat16)
    w = B.prepack_bf16_mma(weight)
    big = torch.randn(6, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    x = big[:, 1002:3050]  # row stride 4096, offset 2004 bytes
    out = torch.full((6, 80), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = B.bf16_linear_mma(x, w, out=out[:, 8:72])
    _close_to_one_ulp(y, _ref(x, weight), x, weight)
    assert torch.isnan(out[:, :8]).all() and torch.isnan(out[:, 72:]).all()
    xs = torch.randn(3, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    B.bf16_linear_mma(xs, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        ys = B.bf16_linear_mma(xs, w)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        xs.copy_(torch.randn(3, 2048, generator=gen, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ys, B.bf16_linear_mma(xs, w))


@pytest.mark.gpu
@requires_gpu
def test_gpu_dense_linear_decode_path(monkeypatch):
    from vibeqwen.model.quant_linear import DenseLinear

    if B.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    weight = (torch.randn(64, 2048, device="cuda") / 45).to(torch.bfloat16)
    layer = DenseLinear(weight)
    assert layer.mma is not None
    x = torch.randn(4, 2048, device="cuda").to(torch.bfloat16)
    assert torch.equal(layer(x), B.bf16_linear_mma(x, layer.mma))
    x = torch.randn(40, 2048, device="cuda").to(torch.bfloat16)  # past DENSE_MMA_MAX_M: cuBLAS
    assert torch.equal(layer(x), x @ weight.t())
    assert DenseLinear(torch.randn(1024, 2048, device="cuda").to(torch.bfloat16)).mma is None  # > DENSE_MMA_MAX_N
    monkeypatch.setenv("VIBEQWEN_BF16_MMA", "0")
    assert DenseLinear(weight).mma is None
