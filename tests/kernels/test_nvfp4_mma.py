"""The LM head on the CUDA MMA kernels (`vibeqwen_kernels.nvfp4.mma`): a one-expert MoE GEMM.

CPU: the routing the wrapper builds (pair ids, block experts, per-row global scale) run through the kernels'
lane-by-lane emulation (`moe_mma_emulated`) against `nvfp4_linear_ref`, for both nibble orders of the codes.
GPU: the kernels against the fp32 reference on fresh random weights. Both compute the exact dequantized
weight times x in fp32, so only the summation order differs: relative Frobenius error <= 1e-5 (measured
~5e-7 on the full LM head).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from vibeqwen_kernels.moe import mma_cuda
from vibeqwen_kernels.nvfp4 import nvfp4_linear_ref, prepack_nvfp4
from vibeqwen_kernels.nvfp4.mma import (
    MMA_MAX_M,
    launch_plan,
    mma_supported,
    nvfp4_linear_mma,
    prepack_nvfp4_mma,
)

from vibeqwen.checkpoint.quant import nvfp4_quantize
from vibeqwen.model.quant_linear import NVFP4Linear

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA GPU")

REL_FRO = 1e-5


def _weight(n: int, k: int, device, gen=None):
    w = torch.randn(n, k, generator=gen).to(device)
    return nvfp4_quantize(w)


def _rel(y, ref) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def test_launch_plan():
    assert launch_plan(1) == (32, 1)
    assert launch_plan(2) == (32, 1)
    assert launch_plan(3) == (64, 1)
    assert launch_plan(64) == (64, 1)
    assert launch_plan(65) == (64, 2)
    assert launch_plan(MMA_MAX_M) == (64, MMA_MAX_M // 64)


@pytest.mark.parametrize("repacked", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_emulated_routing_matches_reference(repacked, m):
    gen = torch.Generator().manual_seed(7 + m)
    n, k = 32, 256
    packed, bs, gs = _weight(n, k, "cpu", gen)
    # the Triton copy's codes (repacked nibble order) and global scale, as NVFP4Linear.enable_mma passes them
    tw = prepack_nvfp4(packed, bs, gs, repack=repacked)
    w = prepack_nvfp4_mma(tw.packed, tw.block_scale, tw.global_scale, repacked=tw.repacked)
    assert tuple(w.gscale.shape) == (1, n) and w.gscale.stride(1) == 1
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    bp, blocks = launch_plan(m)
    out = torch.full((1, m, n), float("nan"))
    mma_cuda.moe_mma_emulated(x, 1, w.weights, w.gscale, w.pair_ids[: blocks * bp], w.block_expert[:blocks],
                              m, 1, out, block_pairs=bp)
    ref = nvfp4_linear_ref(x, packed, bs, gs)
    assert torch.isfinite(out).all()
    assert _rel(out[0], ref) <= REL_FRO


def test_row_chunks_shuffle_like_one_piece(monkeypatch):
    """The load-time shuffle in row chunks gives the one-piece layout (16-row tiles are independent)."""
    from vibeqwen_kernels.nvfp4 import mma as mma_mod

    packed, bs, gs = _weight(48, 256, "cpu")
    tw = prepack_nvfp4(packed, bs, gs)
    whole = prepack_nvfp4_mma(tw.packed, tw.block_scale, tw.global_scale, repacked=True)
    monkeypatch.setattr(mma_mod, "ROW_CHUNK", 16)
    parts = prepack_nvfp4_mma(tw.packed, tw.block_scale, tw.global_scale, repacked=True)
    assert torch.equal(parts.weights.codes, whole.weights.codes)
    assert torch.equal(parts.weights.scales, whole.weights.scales)
    assert (parts.n, parts.k) == (48, 256)


def test_rejects_bad_inputs():
    packed, bs, gs = _weight(32, 256, "cpu")
    tw = prepack_nvfp4(packed, bs, gs)
    w = prepack_nvfp4_mma(tw.packed, tw.block_scale, tw.global_scale, repacked=True)
    with pytest.raises(ValueError, match="1 <= M"):
        nvfp4_linear_mma(torch.zeros(0, 256, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="1 <= M"):
        nvfp4_linear_mma(torch.zeros(MMA_MAX_M + 1, 256, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bf16"):
        nvfp4_linear_mma(torch.zeros(1, 256), w)
    with pytest.raises(ValueError, match="bf16"):
        nvfp4_linear_mma(torch.zeros(1, 128, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="K % 256"):
        p2, b2, _ = _weight(32, 128, "cpu")
        prepack_nvfp4_mma(p2, b2, torch.tensor([1.0]), repacked=False)


def test_not_on_cpu():
    assert not mma_supported(32, 256, torch.device("cpu"))
    packed, bs, gs = _weight(32, 256, "cpu")
    layer = NVFP4Linear(packed, bs, gs)
    assert layer.enable_mma() is False and layer.mma is None


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("m", [1, 2, 3, 8, 17, 64, 65, MMA_MAX_M])
@pytest.mark.parametrize("n,k", [(4096 + 16, 2048), (1024, 512)])
def test_gpu_matches_reference(n, k, m):
    dev = torch.device("cuda")
    if not mma_supported(n, k, dev):
        pytest.skip("the MMA library does not run here")
    packed, bs, gs = _weight(n, k, dev)
    tw = prepack_nvfp4(packed, bs, gs)
    w = prepack_nvfp4_mma(tw.packed, tw.block_scale, tw.global_scale, repacked=True)
    x = torch.randn(m + 1, k, device=dev).to(torch.bfloat16)[1:]  # a view: rows start 4 KB in
    out = torch.full((m, n), float("nan"), device=dev)
    y = nvfp4_linear_mma(x, w, out=out)
    assert y is out and torch.isfinite(y).all(), "unwritten (NaN-poisoned) outputs"
    ref = nvfp4_linear_ref(x, packed, bs, gs)
    assert _rel(y, ref) <= REL_FRO
    # a contiguous view that starts 6 bytes off a 16-byte boundary: copied, not read misaligned
    flat = torch.empty(m * k + 3, device=dev, dtype=torch.bfloat16)
    xo = flat[3:].view(m, k)
    xo.copy_(x)
    assert xo.data_ptr() % 16 and xo.is_contiguous()
    assert _rel(nvfp4_linear_mma(xo, w), ref) <= REL_FRO


@pytest.mark.gpu
@requires_gpu
def test_gpu_lm_head_layer_full_size():
    """NVFP4Linear with the MMA copy on the model's LM head shape [248320, 2048]: fp32 calls of 1..128 rows go
    to the MMA kernels, the rest to Triton; both agree with the reference."""
    dev = torch.device("cuda")
    n, k = 248320, 2048
    if not mma_supported(n, k, dev):
        pytest.skip("the MMA library does not run here")
    packed, bs, gs = _weight(n, k, dev)
    layer = NVFP4Linear(packed, bs, gs)
    assert layer.enable_mma()
    for m in (1, 4, 130):
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        ref = nvfp4_linear_ref(x, packed, bs, gs)
        y = layer(x, out_dtype=torch.float32)
        assert y.dtype == torch.float32 and tuple(y.shape) == (m, n)
        assert _rel(y, ref) <= (REL_FRO if m <= MMA_MAX_M else 4e-3)
