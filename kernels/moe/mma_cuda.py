"""The decode-sized expert GEMM in CUDA (``csrc/moe_mma.cu``): weight shuffling, launch, and an emulation.

:func:`fused_moe` runs it for configs with ``MMA = 1`` (tuned for T <= 64 on the H200): both expert GEMMs
stream NVFP4 codes straight into the tensor cores' register fragments (``mma.m16n8k16``, bf16, fp32
accumulation). The alignment, SiLU-and-mul and slot-sum kernels are the Triton ones.

* :func:`shuffle_mma_weights` -- ``[E', N, K/2]`` codes + ``[E', N, K/16]`` scales -> the kernel's layout
  (load time, on the weights' device; the Triton layout stays for prefill: the shuffled copy costs the
  experts' size again, ~17 GB for the full model).
* :func:`moe_mma` -- one launch: fp32 partial sums ``out[s, pair, n]`` per K split ``s``.
* :func:`moe_mma_emulated` -- the same sums in PyTorch, reading the shuffled layout exactly as the kernel's
  lanes do (the CPU tests check the shuffle with it; the GPU tests check the kernel against the reference).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

#: pairs per expert block: the kernel's two n8 MMA halves (moe_align's block_m)
BLOCK_PAIRS = 16
#: 64-k chunks per register group: a split's K range must be a multiple of 64 * CHUNK_GROUP
CHUNK_GROUP = 4


@dataclass
class MMAWeights:
    """One stacked NVFP4 matrix set in the kernel layout (see ``csrc/moe_mma.cu``).

    codes: uint8 ``[E', N/16, K/64, 32, 16]``; scales: uint8 ``[E', N/16, K/64, 64]`` (e4m3 bits);
    n, k: the matrix shape (N output rows, K inputs) per expert."""

    codes: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int


def _codes_from_packed(packed: torch.Tensor, repacked: bool) -> torch.Tensor:
    """uint8 ``[..., K/2]`` packed NVFP4 -> E2M1 codes uint8 ``[..., K]`` (k order)."""
    lead, kh = packed.shape[:-1], packed.shape[-1]
    if repacked:  # byte 8g+j: k 16g+j (low), 16g+8+j (high)
        g = packed.reshape(*lead, kh // 8, 8)
        return torch.cat((g & 0x0F, g >> 4), dim=-1).reshape(*lead, 2 * kh)
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*lead, 2 * kh)


def shuffle_mma_weights(packed: torch.Tensor, scales: torch.Tensor, repacked: bool,
                        experts_per_step: int = 16) -> MMAWeights:
    """Stacked experts -> the CUDA kernel's fragment layout.

    Args:
        packed: uint8 ``[E', N, K/2]`` (``MoEWeights.w13_packed`` / ``w2_packed``).
        scales: float8_e4m3fn or uint8 ``[E', N, K/16]``.
        repacked: ``MoEWeights.repacked`` (the nibble order of ``packed``).
        experts_per_step: experts converted at a time (bounds the temporary memory).

    Returns:
        :class:`MMAWeights` on ``packed``'s device.

    Raises:
        ValueError: N not a multiple of 16 or K not a multiple of 64.
    """
    e_count, n, kh = packed.shape
    k = 2 * kh
    if n % 16 or k % 64:
        raise ValueError(f"shuffle_mma_weights: need N % 16 == 0 and K % 64 == 0, got N={n}, K={k}")
    s8 = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    nt, kc = n // 16, k // 64
    codes_out = torch.empty((e_count, nt, kc, 32, 16), dtype=torch.uint8, device=packed.device)
    scales_out = torch.empty((e_count, nt, kc, 64), dtype=torch.uint8, device=packed.device)
    for e0 in range(0, e_count, experts_per_step):
        e1 = min(e_count, e0 + experts_per_step)
        c = _codes_from_packed(packed[e0:e1], repacked)  # [e, N, K]
        # row = 16 T + 8 h + g; k = 64 C + 16 j + 8 half + 2 t + p
        c = c.reshape(e1 - e0, nt, 2, 8, kc, 4, 2, 4, 2)  # e, T, h, g, C, j, half, t, p
        byte = c[:, :, :, :, :, :, 0] | (c[:, :, :, :, :, :, 1] << 4)  # e, T, h, g, C, j, t, p
        # -> e, T, C, g, t, j, h, p  (lane = 4 g + t; byte b = 2 h + p)
        codes_out[e0:e1] = byte.permute(0, 1, 4, 3, 6, 5, 2, 7).reshape(e1 - e0, nt, kc, 32, 16)
        s = s8[e0:e1].reshape(e1 - e0, nt, 2, 8, kc, 4)  # e, T, h, g, C, j
        scales_out[e0:e1] = s.permute(0, 1, 4, 3, 5, 2).reshape(e1 - e0, nt, kc, 64)  # e, T, C, g, j, h
    return MMAWeights(codes_out, scales_out, n, k)


def moe_mma_emulated(x: torch.Tensor, x_row_div: int, w: MMAWeights, gscale: torch.Tensor | None,
                     sorted_ids: torch.Tensor, block_expert: torch.Tensor, n_pairs: int, split: int,
                     out: torch.Tensor) -> torch.Tensor:
    """What :func:`moe_mma` computes, in fp32 PyTorch, reading ``w`` lane by lane as the kernel does
    (scales applied as e4m3 values; the kernel's 2^-9 dequantization bias and ``gscale * 2^9`` cancel, so
    without ``gscale`` the result here is 2^9 times the kernel's raw sums). For tests of the shuffle: Python
    loops, tiny shapes only.

    Args and layout as :func:`moe_mma` (x ``[rows, K]`` any float dtype, ``gscale`` float32 ``[E', N]`` or
    None, ``sorted_ids`` / ``block_expert`` int32 from moe_align with block_m 16, ``out`` float32
    ``[split, n_pairs, N]``), on any device. Writes and returns ``out`` (rows of pairs in no block untouched).
    No checks: wrong shapes raise whatever indexing raises (IndexError / RuntimeError)."""
    from vibeqwen.checkpoint.quant import E2M1_VALUES

    table = E2M1_VALUES.to(device=x.device, dtype=torch.float32)
    nt, kc = w.n // 16, w.k // 64
    lane = torch.arange(32, device=x.device)
    g, t = lane // 4, lane % 4
    per = kc // split
    for blk in range(block_expert.numel()):
        e = int(block_expert[blk])
        if e < 0:
            continue
        pairs = [int(p) for p in sorted_ids[blk * BLOCK_PAIRS:(blk + 1) * BLOCK_PAIRS]]
        for s in range(split):
            acc = torch.zeros(w.n, BLOCK_PAIRS, dtype=torch.float32, device=x.device)
            xcols = torch.zeros(BLOCK_PAIRS, w.k, dtype=torch.float32, device=x.device)
            for col, p in enumerate(pairs):
                if p < n_pairs:
                    xcols[col] = x[p // x_row_div].float()
            for tile in range(nt):
                wt = torch.zeros(16, w.k, dtype=torch.float32, device=x.device)
                for c in range(s * per, (s + 1) * per):
                    lanes = w.codes[e, tile, c]  # [32, 16]: step j, byte b
                    sc = w.scales[e, tile, c].view(8, 4, 2)  # g, j, h
                    for j in range(4):
                        for b in range(4):
                            h, p = b // 2, b % 2
                            byte = lanes[:, 4 * j + b].long()
                            bits = sc[g, j, h]
                            scale = bits.view(torch.float8_e4m3fn).float() if bits.dtype == torch.uint8 \
                                else bits.float()
                            row = g + 8 * h
                            kk = 64 * c + 16 * j + 2 * t + p
                            wt[row, kk] = table[byte & 15] * scale
                            wt[row, kk + 8] = table[byte >> 4] * scale
                acc[tile * 16:(tile + 1) * 16] = wt @ xcols.t()
            for col, p in enumerate(pairs):
                if p < n_pairs:
                    v = acc[:, col]
                    out[s, p] = v * gscale[e] if gscale is not None else v
            # (the kernel writes only real pairs; padding columns are dropped the same way)
    return out


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def mma_library(device: torch.device):
    """The built ``csrc/moe_mma.cu`` for ``device`` (None on CPU, before sm_90, or when it cannot be built)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return None
    from vibeqwen_kernels.cuda_build import load_library

    lib = load_library("moe_mma", _arch(device))
    if lib is not None and not getattr(lib, "_vq_typed", False):
        lib.vq_moe_mma_smem_bytes.restype = ctypes.c_int
        lib.vq_moe_mma_smem_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.vq_moe_mma_launch.restype = ctypes.c_int
        lib.vq_moe_mma_launch.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ]
        lib._vq_typed = True
    return lib


#: dynamic shared memory the kernel may use (its x tile): 227 KB per block on an H100/H200, less its 1 KB scale table
MAX_SMEM_BYTES = 226 * 1024


def smem_bytes(k: int, split: int) -> int:
    """Dynamic shared memory of one launch: 16 staged x columns of K / split bf16 values (+16 padding)."""
    return BLOCK_PAIRS * (k // split + 16) * 2


def split_ok(k: int, split: int) -> bool:
    """Whether K splits into ``split`` ranges of whole register groups (the kernel's requirement) whose x
    tile fits in shared memory."""
    return split >= 1 and k % (64 * CHUNK_GROUP * split) == 0 and smem_bytes(k, split) <= MAX_SMEM_BYTES


def moe_mma(x: torch.Tensor, x_row_div: int, w: MMAWeights, gscale: torch.Tensor | None,
            sorted_ids: torch.Tensor, block_expert: torch.Tensor, n_pairs: int, split: int,
            out: torch.Tensor) -> torch.Tensor:
    """``out[s, pair, n] = sum_{k in split s} W[e, n, k] x[pair // x_row_div, k]`` (fp32) for every real pair
    of every expert block (``moe_align`` with ``block_m = 16``), times ``gscale[e, n] * 2^9`` when
    ``gscale`` is given; without it the raw sums carry the dequantization's 2^-9 (as the Triton MMA kernels'
    split partials do). Launches on the current stream, no sync (CUDA-graph safe).

    Args:
        x: bf16 ``[rows, K]``, last dim contiguous, rows 16-byte aligned (data pointer and row stride).
        x_row_div: the x row of pair p is ``p // x_row_div`` (k' for the gate/up GEMM, 1 for down).
        w: :class:`MMAWeights` from :func:`shuffle_mma_weights`.
        gscale: float32 ``[E', N]`` or None.
        sorted_ids, block_expert: int32, from ``moe_align(topk_ids, E', 16)``.
        n_pairs: T * k' (the sentinel in ``sorted_ids``).
        split: K splits (:func:`split_ok`).
        out: float32 ``[split, n_pairs, N]`` (last two dims contiguous; pairs not in any block are untouched).

    Raises:
        ValueError: bad split, shapes, dtypes, devices or alignment (checked first, on any machine).
        RuntimeError: the library is not available on ``x``'s device, or the launch failed.
    """
    if not split_ok(w.k, split):
        raise ValueError(f"moe_mma: K={w.k} does not split into {split} x {64 * CHUNK_GROUP}-multiples")
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1 or x.shape[-1] != w.k:
        raise ValueError(f"moe_mma: x must be bf16 [rows, {w.k}] with a contiguous last dim")
    if x.data_ptr() % 16 or x.stride(0) % 8:
        raise ValueError("moe_mma: x rows must start at 16-byte boundaries (the kernel reads 16 bytes at a time)")
    if out.dtype != torch.float32 or tuple(out.shape) != (split, n_pairs, w.n) or out.stride(2) != 1:
        raise ValueError(f"moe_mma: out must be float32 [{split}, {n_pairs}, {w.n}]")
    for name, ids in (("sorted_ids", sorted_ids), ("block_expert", block_expert)):
        if ids.dtype != torch.int32 or ids.device != x.device or not ids.is_contiguous():
            raise ValueError(f"moe_mma: {name} must be a contiguous int32 tensor on {x.device}")
    if sorted_ids.numel() < BLOCK_PAIRS * block_expert.numel():
        raise ValueError(f"moe_mma: sorted_ids needs {BLOCK_PAIRS} entries per block ({block_expert.numel()} blocks)")
    if w.codes.device != x.device or out.device != x.device:
        raise ValueError("moe_mma: x, the weights and out must be on one device")
    if gscale is not None and (gscale.dtype != torch.float32 or gscale.device != x.device or gscale.stride(1) != 1
                               or gscale.shape[1] != w.n):
        raise ValueError(f"moe_mma: gscale must be float32 [E', {w.n}] on {x.device} with a contiguous last dim")
    lib = mma_library(x.device)
    if lib is None:
        raise RuntimeError("moe_mma: the CUDA kernel is not available on this device")
    gs_ptr, gs_stride = (gscale.data_ptr(), gscale.stride(0)) if gscale is not None else (None, 0)
    rc = lib.vq_moe_mma_launch(
        x.data_ptr(), x_row_div, x.stride(0), w.codes.data_ptr(), w.scales.data_ptr(), gs_ptr, gs_stride,
        out.data_ptr(), out.stride(0), out.stride(1), sorted_ids.data_ptr(), block_expert.data_ptr(),
        block_expert.numel(), n_pairs, w.n, w.k, split, 1 if gscale is not None else 0,
        ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"moe_mma: launch failed with CUDA error {rc}")
    return out
