"""The expert alignment of mid-sized batches in one CUDA launch (``csrc/moe_align.cu``).

:func:`~vibeqwen_kernels.moe.fused.moe_align` runs it for 129 to :data:`ALIGN_CUDA_MAX_PAIRS` pairs (15-512 tokens at
k' = 9: decode batches past the fused router's 32 tokens, speculative verification, short prefills) when the library
builds on the device: one CTA of 32 warps groups the pairs by expert with per-warp histograms in shared memory (one
ballot per id bit finds a round's lanes of one expert; no atomics) and places them in a second pass. Its outputs are
position for position those of the three Triton launches it replaces (per-chunk histograms, scan, scatter).
``VIBEQWEN_CUDA_ALIGN=0`` keeps the Triton kernels.

* :func:`align_supported` -- whether a call can run here.
* :func:`moe_align_cuda` -- one launch into given output tensors.
"""

from __future__ import annotations

import ctypes
import os

import torch
from vibeqwen_kernels.cuda_build import hopper_library
from vibeqwen_kernels.pdl import pdl_mode

#: experts (routed + shared) the kernel takes: one scanning thread each
ALIGN_MAX_EXPERTS = 1024
#: pairs up to which moe_align uses the kernel. H200, E' 257, block_m 64 (bench/kernels/bench_align.py), us per call
#: Triton / CUDA: T = 256 15.3 / 8.8, T = 1024 17.5 / 19.2, T = 8192 41.4 / 121.0 (one CTA: its rounds of 32 pairs
#: are serial per warp, while the Triton kernels spread the pairs over the GPU)
ALIGN_CUDA_MAX_PAIRS = 4608


def align_library(device: torch.device):
    """The built ``csrc/moe_align.cu`` for ``device`` (None on CPU, before sm_90, or when it cannot be built)."""
    p, i = ctypes.c_void_p, ctypes.c_int
    return hopper_library("moe_align", device, {
        "vq_moe_align_launch": [p, i, i, i, i, i, p, p, p, i, p],
    })


def align_supported(num_experts: int, device: torch.device) -> bool:
    """Whether :func:`moe_align_cuda` runs ``num_experts`` (E' <= 1024) on ``device``: a CUDA device of sm_90+ where
    the library builds (nvcc), and ``VIBEQWEN_CUDA_ALIGN`` not ``0``."""
    return (1 <= num_experts <= ALIGN_MAX_EXPERTS and os.environ.get("VIBEQWEN_CUDA_ALIGN", "1") != "0"
            and align_library(torch.device(device)) is not None)


def moe_align_cuda(ids: torch.Tensor, num_experts: int, block_m: int, sorted_ids: torch.Tensor,
                   block_expert: torch.Tensor, num_padded: torch.Tensor) -> None:
    """Group the pairs of ``ids`` by expert into the given outputs (one launch on the current stream).

    Args:
        ids: int32 ``[n_pairs]`` contiguous, ``n_pairs >= 1``, every id in ``[0, num_experts)`` (not checked: that
            would sync; an id out of range corrupts shared memory of the launch and the result).
        num_experts: E', 1..1024.
        block_m: group padding, a power of two.
        sorted_ids, block_expert, num_padded: int32 ``[P_max]``, ``[B_max]``, ``[1]`` on ids' device, with
            ``(P_max, B_max) = align_bounds(n_pairs, num_experts, block_m)``; written as
            :func:`~vibeqwen_kernels.moe.fused.moe_align` documents.

    Raises:
        ValueError: dtypes, shapes or devices that do not fit.
        RuntimeError: the library is unavailable on the device, or the launch failed.
    """
    from vibeqwen_kernels.moe.fused import align_bounds

    n_pairs = ids.numel()
    dev = ids.device
    outs = (sorted_ids, block_expert, num_padded)
    if (ids.dtype != torch.int32 or ids.dim() != 1 or not ids.is_contiguous() or n_pairs < 1
            or any(o.dtype != torch.int32 or o.device != dev or not o.is_contiguous() for o in outs)):
        raise ValueError("moe_align_cuda: ids and the outputs must be contiguous int32 tensors on one device, "
                         f"ids 1-D and non-empty (got ids {ids.dtype} {tuple(ids.shape)})")
    if not 1 <= num_experts <= ALIGN_MAX_EXPERTS or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"moe_align_cuda: need 1 <= num_experts <= {ALIGN_MAX_EXPERTS} and block_m a power of two, "
                         f"got {num_experts}, {block_m}")
    p_max, b_max = align_bounds(n_pairs, num_experts, block_m)
    if sorted_ids.numel() != p_max or block_expert.numel() != b_max or num_padded.numel() != 1:
        raise ValueError(f"moe_align_cuda: outputs must have {p_max}, {b_max} and 1 elements, got "
                         f"{sorted_ids.numel()}, {block_expert.numel()}, {num_padded.numel()}")
    lib = align_library(dev)
    if lib is None:
        raise RuntimeError("moe_align_cuda: the CUDA kernel is not available on this device")
    rc = lib.vq_moe_align_launch(
        ids.data_ptr(), n_pairs, num_experts, block_m, p_max, b_max, sorted_ids.data_ptr(), block_expert.data_ptr(),
        num_padded.data_ptr(), pdl_mode(dev), ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"moe_align_cuda: launch failed with CUDA error {rc}")
