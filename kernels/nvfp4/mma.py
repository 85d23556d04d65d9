"""Wide NVFP4 layers (the LM head, ``[248320, 2048]``) on the CUDA MMA kernels of ``csrc/moe_mma.cu``.

The LM head is run as a one-expert MoE GEMM: every row of x is a "pair" routed to expert 0, so the expert
kernels (NVFP4 codes straight into tensor-core fragments, fp32 accumulation, fp32 output) serve it unchanged.
H200, ``[248320, 2048]`` (286 MB of codes and scales, 67 us at copy bandwidth), CUDA-graph replays of one call:

======  ==================================  ===============================
M       Triton (``nvfp4_linear``, fp32 out)  these kernels (block pairs)
======  ==================================  ===============================
1       170 us                               89 us (32)
2       260 us                               93 us (32)
8       319 us                               104 us (64)
32      329 us                               146 us (64)
64      382 us                               236 us (64)
128     751 us                               460 us (64: two blocks)
======  ==================================  ===============================

(``bench/results/h200_notes.md``, tenth session.) The kernels read their own copy of the weight
(:func:`~vibeqwen_kernels.moe.mma_cuda.shuffle_mma_weights` layout: +11% for bf16 block scales, 318 MB for the LM
head), made once at load time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from vibeqwen_kernels.moe import mma_cuda

#: Rows up to which :func:`nvfp4_linear_mma` runs: measured up to 128 (every 64-row block reads the whole weight,
#: from L2 when the blocks of a row tile run together); beyond, the Triton kernels as before.
MMA_MAX_M = 128
#: Weight rows shuffled at a time at load (a multiple of 16).
ROW_CHUNK = 16384
#: Rows up to which 32-pair blocks (the wgmma kernel on Hopper) beat 64-pair ones (measured: M 1-2 32, M 8 64).
SMALL_BLOCK_MAX_M = 2


@dataclass(frozen=True)
class NVFP4MMAWeight:
    """An NVFP4 weight in the MMA kernels' layout plus the fixed routing that makes it a one-expert MoE GEMM.

    Attributes:
        weights: :class:`~vibeqwen_kernels.moe.mma_cuda.MMAWeights` with one expert, ``[N, K]``.
        gscale: float32 ``[1, N]``: the global scale on every row (the kernels' per-row scale input).
        pair_ids: int32 ``[MMA_MAX_M]`` = ``0, 1, 2, ...``: row i of x is pair i; entries >= M are padding
            (the kernels skip pairs >= n_pairs).
        block_expert: int32 zeros ``[MMA_MAX_M / 32]``: every block reads expert 0.
    """

    weights: mma_cuda.MMAWeights
    gscale: torch.Tensor
    pair_ids: torch.Tensor
    block_expert: torch.Tensor

    @property
    def n(self) -> int:
        return self.weights.n

    @property
    def k(self) -> int:
        return self.weights.k


def mma_supported(n: int, k: int, device: torch.device) -> bool:
    """Whether :func:`prepack_nvfp4_mma` can build an ``[n, k]`` weight on ``device``: a CUDA device the MMA
    library runs on (sm_90+, built), N a multiple of 16, K of 256 (whole register groups), and the MMA kernels
    not switched off (``VIBEQWEN_MOE_MMA=0`` turns them off for the MoE and the LM head alike)."""
    if device.type != "cuda" or os.environ.get("VIBEQWEN_MOE_MMA", "1") == "0":
        return False
    if not _shape_ok(n, k):
        return False
    return mma_cuda.mma_library(device) is not None


def _shape_ok(n: int, k: int) -> bool:
    """N in whole 16-row tiles, K in whole register groups (one K range of 64-pair blocks: ``split_ok``)."""
    return n % 16 == 0 and mma_cuda.split_ok(k, 1, 64)


def prepack_nvfp4_mma(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                      repacked: bool) -> NVFP4MMAWeight:
    """The MMA kernels' copy of one NVFP4 weight (load time; shuffles on ``packed``'s device).

    Args:
        packed: uint8 ``[N, K/2]`` codes, in the checkpoint's nibble order (``repacked=False``) or the Triton
            kernels' (``repacked=True``, :func:`~vibeqwen_kernels.nvfp4.prepack_nvfp4`'s ``packed``).
        block_scale: float8_e4m3fn (or its uint8 bits) ``[N, K/16]``.
        global_scale: float32 one-element tensor, the multiplier (``NVFP4Weight.global_scale``).
        repacked: the nibble order of ``packed``.

    Raises:
        ValueError: N not a multiple of 16 or K not of 256.
    """
    n, k = packed.shape[0], 2 * packed.shape[1]
    if not _shape_ok(n, k):
        raise ValueError(f"prepack_nvfp4_mma: need N % 16 == 0 and K % 256 == 0, got [{n}, {k}]")
    # 16-row tiles are independent in the kernels' layout: shuffle ROW_CHUNK rows at a time (the shuffle's int64
    # temporaries, estimated from its code: ~6 bytes per weight, ~3 GB at once for the LM head, ~200 MB a chunk)
    parts = [mma_cuda.shuffle_mma_weights(packed[None, r:r + ROW_CHUNK], block_scale[None, r:r + ROW_CHUNK],
                                          repacked) for r in range(0, n, ROW_CHUNK)]
    w = parts[0] if len(parts) == 1 else mma_cuda.MMAWeights(
        torch.cat([p.codes for p in parts], dim=1), torch.cat([p.scales for p in parts], dim=1), n, parts[0].k)
    dev = packed.device
    gscale = global_scale.to(device=dev, dtype=torch.float32).reshape(1, 1).repeat(1, n)
    pair_ids = torch.arange(MMA_MAX_M, device=dev, dtype=torch.int32)
    block_expert = torch.zeros(MMA_MAX_M // 32, device=dev, dtype=torch.int32)
    return NVFP4MMAWeight(w, gscale, pair_ids, block_expert)


def launch_plan(m: int) -> tuple[int, int]:
    """(block pairs, number of blocks) for ``m >= 1`` rows: 32-pair blocks up to :data:`SMALL_BLOCK_MAX_M` rows,
    else 64-pair blocks; ``ceil(m / block pairs)`` blocks. Pure arithmetic, raises nothing."""
    bp = 32 if m <= SMALL_BLOCK_MAX_M else 64
    return bp, -(-m // bp)


def nvfp4_linear_mma(x: torch.Tensor, weight: NVFP4MMAWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ w^T`` in float32 for 1 <= M <= :data:`MMA_MAX_M` rows, on the MMA kernels.

    Args:
        x: bf16 ``[M, K]`` on ``weight``'s CUDA device (copied to a fresh buffer unless its rows are contiguous
            and 16-byte aligned).
        weight: from :func:`prepack_nvfp4_mma`.
        out: optional float32 ``[M, N]`` contiguous output.

    Returns:
        float32 ``[M, N]``: the exact dequantized weight times x, fp32 sums (differs from
        ``nvfp4_linear_ref`` by the summation order only; ~5e-7 relative measured). Launches on the current
        stream without a host sync (CUDA-graph safe).

    Raises:
        ValueError: M out of range, K mismatch, not bf16, or a bad ``out``.
        RuntimeError: the launch failed.
    """
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != weight.k:
        raise ValueError(f"nvfp4_linear_mma: x must be bf16 [M, {weight.k}], got {x.dtype} {tuple(x.shape)}")
    m = x.shape[0]
    if not 1 <= m <= MMA_MAX_M:
        raise ValueError(f"nvfp4_linear_mma: takes 1 <= M <= {MMA_MAX_M} rows, got {m}")
    if x.stride(1) != 1 or (m > 1 and x.stride(0) % 8) or x.data_ptr() % 16:
        # a fresh buffer: .contiguous() would keep a contiguous view that starts off a 16-byte boundary
        x = torch.empty((m, weight.k), device=x.device, dtype=x.dtype).copy_(x)
    if out is None:
        out = torch.empty((m, weight.n), device=x.device, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (m, weight.n) or not out.is_contiguous():
        raise ValueError(f"nvfp4_linear_mma: out must be a contiguous float32 [{m}, {weight.n}] tensor")
    if x.device != weight.gscale.device or out.device != x.device:
        raise ValueError(f"nvfp4_linear_mma: x, out and the weight must be on one device, got {x.device}, "
                         f"{out.device} and {weight.gscale.device}")
    bp, blocks = launch_plan(m)
    # the weight and the routing were built (and fit the kernels) at prepack time: only x and out vary
    mma_cuda.moe_mma(x, 1, weight.weights, weight.gscale, weight.pair_ids[: blocks * bp],
                     weight.block_expert[:blocks], m, 1, out.view(1, m, weight.n), block_pairs=bp, check=False)
    return out
