"""Decode GEMMs of bf16 weights on the CUDA MMA kernels of ``csrc/bf16_mma.cu``.

``y = bf16(x @ W^T)`` for 1-64 rows of bf16 x (``mma.m16n8k16``, fp32 sums, rounded once to bf16: what F.linear
returns, up to the summation order). The weight is shuffled at load time so that each lane's 16-byte load per
k16 step is its A fragment. The same library holds the MoE router kernel (:mod:`vibeqwen_kernels.moe.route_cuda`).

Why: cuBLAS takes ~5 us for each of the decode step's small bf16 GEMMs on the H200 (GDN's b|a: 64 x 2048, 30 a
step), most of it launch latency its kernels do not overlap with the previous kernel's tail (ours use PDL).

* :func:`shuffle_bf16_mma` -- ``[N, K]`` -> the kernel's fragment layout (load time, on the weight's device).
* :func:`prepack_bf16_mma` -- a dense weight -> :class:`BF16MMAWeight`.
* :func:`bf16_linear_mma` -- one launch.
* :func:`bf16_mma_supported` -- whether a shape runs here on a device.
* :func:`bf16_mma_emulated` -- the kernel's GEMM in PyTorch, reading the shuffled layout (CPU tests).
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch
from vibeqwen_kernels.cuda_build import hopper_library
from vibeqwen_kernels.pdl import pdl_mode

#: rows of x a call takes (the kernel's 8 n8 tiles)
BF16_MMA_MAX_M = 64
#: K must be a multiple of it (8 warps x a pair of k16 steps)
BF16_MMA_K_MULTIPLE = 256


@functools.cache
def fragment_sources() -> tuple:
    """``src[h][lane][i]`` = (row within the 16-row tile, k within the 32-k chunk) of bf16 element i (0-7) of lane
    ``lane``'s 16 bytes for step h (0, 1) of a chunk's two k16 steps.

    The mma.m16n8k16 A fragment (PTX ISA) gives lane (g = lane // 4, t = lane % 4) register r = i // 2, half
    q = i % 2, at row g (+ 8 for odd r) and step-local k = 2 t + q (+ 8 for r >= 2); the B fragment gives it x's
    k = 2 t + q (+ 8) of token g. Any permutation of k applied to both sides leaves the sum unchanged, so the
    kernel takes step h's k = 2 t + q (+ 8) at chunk offset 8 t + 4 h + q (+ 2): the lane's B fragments of both
    steps are x's 8 consecutive elements [8 t, 8 t + 8) of the chunk, one 16-byte load."""
    out = []
    for h in range(2):
        lanes = []
        for lane in range(32):
            g, t = lane // 4, lane % 4
            lanes.append(tuple((g + 8 * ((i // 2) & 1), 8 * t + 4 * h + 2 * (i // 4) + i % 2) for i in range(8)))
        out.append(tuple(lanes))
    return tuple(out)


def shuffle_bf16_mma(weight: torch.Tensor) -> torch.Tensor:
    """bf16 ``[R, K]`` -> bf16 ``[ceil(R / 16), K / 16, 32, 8]``: per 16-row tile and k16 step (2 d + h), lane l's
    A fragment (:func:`fragment_sources` of the 32-k chunk d); rows past R are zero. On the weight's device.

    Raises:
        ValueError: not a 2-D bf16 tensor, or K not a multiple of 32.
    """
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.shape[1] % 32:
        raise ValueError(f"shuffle_bf16_mma: weight must be bf16 [R, K] with K % 32 == 0, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    r, k = weight.shape
    tiles = -(-r // 16)
    padded = torch.zeros((tiles * 16, k), dtype=weight.dtype, device=weight.device)
    padded[:r] = weight
    idx = torch.tensor([row * 32 + kk for h in fragment_sources() for lane in h for (row, kk) in lane],
                       dtype=torch.int64, device=weight.device)
    chunks = padded.view(tiles, 16, k // 32, 32).permute(0, 2, 1, 3).reshape(tiles, k // 32, 512)
    return chunks[..., idx].reshape(tiles, k // 16, 32, 8).contiguous()


@dataclass(frozen=True)
class BF16MMAWeight:
    """A bf16 weight in the kernel's layout: ``packed`` bf16 ``[ceil(N / 16), K / 16, 32, 8]``
    (:func:`shuffle_bf16_mma`), ``n`` and ``k`` its shape."""

    packed: torch.Tensor
    n: int
    k: int


def prepack_bf16_mma(weight: torch.Tensor) -> BF16MMAWeight:
    """bf16 ``[N, K]`` -> :class:`BF16MMAWeight` on its device (a copy in the kernel's layout, N rounded up to 16 with
    zero rows). Raises ValueError as :func:`shuffle_bf16_mma` (not bf16, K % 32 != 0); the kernel itself needs
    K % 256 == 0 (:func:`bf16_mma_supported`)."""
    return BF16MMAWeight(packed=shuffle_bf16_mma(weight), n=weight.shape[0], k=weight.shape[1])


def bf16_mma_library(device: torch.device):
    """The built ``csrc/bf16_mma.cu`` for ``device`` (None on CPU, before sm_90, or when it cannot be built)."""
    p, i = ctypes.c_void_p, ctypes.c_int  # pointers (and the stream), ints
    return hopper_library("bf16_mma", device, {
        "vq_bf16_mma_launch": [p, i, i, p, i, i, i, p, i, i, p],
        "vq_moe_route_launch": [p, i, i, p, i, i, i, i, p, p, p, p, p, p, p, i, i, i, p, i, i, i, i, i, p],
    })


def bf16_mma_supported(n: int, k: int, device: torch.device) -> bool:
    """Whether an ``[N, K]`` bf16 weight runs on the kernel on ``device``: K % 256 == 0, the library built there
    (sm_90+, nvcc), and ``VIBEQWEN_BF16_MMA`` not ``0``."""
    return (n >= 1 and k % BF16_MMA_K_MULTIPLE == 0 and os.environ.get("VIBEQWEN_BF16_MMA", "1") != "0"
            and bf16_mma_library(torch.device(device)) is not None)


def bf16_linear_mma(x: torch.Tensor, w: BF16MMAWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``bf16(x @ W^T)`` for ``x`` bf16 ``[M, K]``, 1 <= M <= 64 (fp32 sums in the kernel's order).

    Args:
        x: bf16 ``[M, K]`` on the weight's device (last dim contiguous, rows 16-byte aligned; else copied).
        w: :class:`BF16MMAWeight`.
        out: optional bf16 ``[M, N]`` output with a contiguous last dim; default a new one.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit.
        RuntimeError: the library is not available on the device, or the launch failed.
    """
    if w.k % BF16_MMA_K_MULTIPLE:
        raise ValueError(f"bf16_linear_mma: K={w.k} is not a multiple of {BF16_MMA_K_MULTIPLE}")
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != w.k or not 1 <= x.shape[0] <= BF16_MMA_MAX_M:
        raise ValueError(f"bf16_linear_mma: x must be bf16 [1..{BF16_MMA_MAX_M}, {w.k}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if x.device != w.packed.device:
        raise ValueError(f"bf16_linear_mma: x is on {x.device}, the weight on {w.packed.device}")
    m = x.shape[0]
    if x.stride(1) != 1 or x.stride(0) % 8 or x.stride(0) < w.k or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    if out is None:
        out = torch.empty((m, w.n), device=x.device, dtype=torch.bfloat16)
    elif (tuple(out.shape) != (m, w.n) or out.dtype != torch.bfloat16 or out.device != x.device or out.stride(1) != 1
          or (m > 1 and out.stride(0) < w.n)):
        raise ValueError(f"bf16_linear_mma: out must be bf16 [{m}, {w.n}] on {x.device} with a contiguous last dim")
    lib = bf16_mma_library(x.device)
    if lib is None:
        raise RuntimeError("bf16_linear_mma: the CUDA kernel is not available on this device")
    rc = lib.vq_bf16_mma_launch(
        x.data_ptr(), x.stride(0), m, w.packed.data_ptr(), w.packed.shape[0], w.k, w.n, out.data_ptr(),
        out.stride(0) if m > 1 else w.n, pdl_mode(x.device),
        ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"bf16_linear_mma: launch failed with CUDA error {rc}")
    return out


def bf16_mma_emulated(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The kernels' GEMM in PyTorch, reading the shuffled layout as their lanes do: fp32 ``[T, 16 * tiles]`` of
    bf16-rounded ``x @ W^T`` (fp32 sums; CPU tests of the layout)."""
    tiles, chunks = packed.shape[0], packed.shape[1] // 2
    w = torch.empty((tiles, 16, chunks, 32), dtype=torch.float32, device=packed.device)
    p5 = packed.view(tiles, chunks, 2, 32, 8)
    for h, lanes in enumerate(fragment_sources()):
        for lane, elems in enumerate(lanes):
            for i, (row, kk) in enumerate(elems):
                w[:, row, :, kk] = p5[:, :, h, lane, i].float()
    return (x.float() @ w.reshape(tiles * 16, chunks * 32).t()).to(torch.bfloat16).float()
