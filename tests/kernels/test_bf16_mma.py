"""bf16 decode GEMMs on the CUDA MMA kernel (`vibeqwen_kernels.bf16_mma`, `csrc/bf16_mma.cu`).

CPU: the fragment layout (every element of a 16 x 16 tile-step lands in exactly one lane slot, where the PTX ISA's
mma.m16n8k16 A fragment wants it), the shuffle read back through an emulation of the kernel's GEMM against the
bf16 reference GEMM, the argument checks.
GPU: the kernel against cuBLAS's bf16 GEMM on fresh random inputs for 1-64 rows (every n8-tile count), N not a
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
    seen = {pos for lane in src for pos in lane}
    assert len(seen) == 256 and seen == {(r, k) for r in range(16) for k in range(16)}
    assert src[0] == ((0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9))
    assert src[5][6] == (9, 10) and src[31][7] == (15, 15)  # g = 1, t = 1: a3 low half; g = 7, t = 3: a3 high


@pytest.mark.parametrize("rows,k", [(16, 16), (257, 256), (40, 128)])
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
    w = B.prepack_bf16_mma(torch.randn(64, 128).to(torch.bfloat16))
    assert (w.n, w.k) == (64, 128) and w.packed.shape == (4, 8, 32, 8)
    with pytest.raises(ValueError, match="x must be bf16"):
        B.bf16_linear_mma(torch.randn(2, 128), w)
    with pytest.raises(ValueError, match="x must be bf16"):
        B.bf16_linear_mma(torch.randn(65, 128).to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="x must be bf16"):
        B.bf16_linear_mma(torch.randn(2, 256).to(torch.bfloat16), w)
    assert not B.bf16_mma_supported(64, 128, torch.device("cpu"))


def _close_to_one_ulp(got: torch.Tensor, ref: torch.Tensor) -> None:
    got, ref = got.float(), ref.float()
    ulp = ref.abs().clamp_min(2.0 ** -126) * 2.0 ** -7
    assert ((got - ref).abs() <= ulp).all(), (got - ref).abs().max()
    assert (got == ref).float().mean() > 0.9


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("n,k", [(64, 2048), (264, 2048), (40, 256), (2048, 1024)])
def test_gpu_matches_cublas(m, n, k):
    if B.bf16_mma_library(torch.device("cuda")) is None:
        pytest.skip("bf16_mma.cu does not build here")
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    weight = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(torch.bfloat16)
    w = B.prepack_bf16_mma(weight)
    for _ in range(2):
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        _close_to_one_ulp(B.bf16_linear_mma(x, w), x @ weight.t())


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
    _close_to_one_ulp(y, x @ weight.t())
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
    x = torch.randn(100, 2048, device="cuda").to(torch.bfloat16)  # prefill-sized: cuBLAS
    assert torch.equal(layer(x), x @ weight.t())
    monkeypatch.setenv("VIBEQWEN_BF16_MMA", "0")
    assert DenseLinear(weight).mma is None
