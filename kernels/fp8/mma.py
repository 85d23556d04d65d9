"""FP8 W8A16 linear layers for decode-sized batches on the CUDA MMA kernel of ``csrc/fp8_mma.cu``.

``y = x @ (float32(q) * scale)^T`` for 1-64 rows of bf16 x: the E4M3 codes are widened exactly to bf16 in
registers and multiplied on the tensor cores (``mma.m16n8k16``, fp32 accumulation); the per-row (or
per-tensor) scale multiplies the fp32 sum; split-K launches write fp32 partials that the Triton reduce kernel of
``_linear_kernels.py`` sums in split order. Same numerics as :func:`~vibeqwen_kernels.fp8.fp8_linear` (exact
products, fp32 sums, the scale after the sum; the summation order differs).

* :func:`shuffle_fp8_mma` -- ``[N, K]`` codes -> the kernel's fragment layout (load time, on the weight's device).
* :func:`prepack_fp8_mma` -- an :class:`~vibeqwen_kernels.fp8.FP8Weight` -> :class:`FP8MMAWeight` (a second copy
  of the codes, the weight's size again).
* :func:`fp8_linear_mma` -- one call (two launches with a K split).
* :func:`fp8_linear_mma_add_rms_norm` -- an output projection with the residual add and the RMSNorm after it,
  the K split's reduce and the norm in one launch.
* :func:`fp8_linear_mma_conv` -- GDN's qkv|z projection of a decode step with the causal conv1d + SiLU (and the
  conv state's shift) of its first ``C`` output channels in the GEMM's epilogue: one launch instead of two.
* :func:`fp8_mma_supported` -- whether a shape runs here on a device.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch
from vibeqwen_kernels.cuda_build import hopper_library
from vibeqwen_kernels.pdl import pdl_launch, pdl_mode

#: rows of x a call takes (the kernel's n8 tiles: 1, 2, 4 or 8)
MMA_MAX_M = 64
#: k per staged x piece: K must be a multiple of it times the split
PIECE_K = 256


@functools.cache
def step_byte_sources() -> tuple:
    """``src[lane][byte]`` = (row within the 16-row tile, k within the 64-k chunk) of byte ``byte`` (0-31) of
    lane ``lane``'s 32 code bytes per chunk: step j = byte // 8, A register r = (byte % 8) // 2, half q = byte % 2;
    row g (+ 8 for odd r), k = 16 j + 2 t + q (+ 8 for r >= 2); g = lane // 4, t = lane % 4 (PTX ISA, the
    mma.m16n8k16 A fragment)."""
    out = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        row = []
        for byte in range(32):
            j, r, q = byte // 8, (byte % 8) // 2, byte % 2
            row.append((g + 8 * (r & 1), 16 * j + 2 * t + q + 8 * (r >> 1)))
        out.append(tuple(row))
    return tuple(out)


@functools.cache
def _gather_index(device: torch.device) -> torch.Tensor:
    """int64 [1024]: for the kernel's byte order in a chunk (half h, lane, byte b: the lane's byte 16 h + b), the
    offset row * 64 + k in a [16, 64] tile-chunk."""
    lane_major = torch.tensor([r * 64 + k for lane in step_byte_sources() for (r, k) in lane], dtype=torch.int64)
    return lane_major.view(32, 2, 16).transpose(0, 1).reshape(-1).to(device)  # [lane, half, 16] -> [half, lane, 16]


def shuffle_fp8_mma(weight: torch.Tensor, row_chunk: int = 4096) -> torch.Tensor:
    """E4M3 codes ``[N, K]`` (float8_e4m3fn or uint8) -> uint8 ``[N/16, K/64, 2, 32, 16]`` in the kernel's layout
    (see ``csrc/fp8_mma.cu``: half h of lane l holds its bytes 16 h .. 16 h + 15 of :func:`step_byte_sources`, so
    each 16-byte load of a warp reads 512 contiguous bytes), on the weight's device, ``row_chunk`` rows at a time.

    Raises:
        ValueError: not 2-D, N not a multiple of 16 or K of 64.
    """
    if weight.dim() != 2 or weight.shape[0] % 16 or weight.shape[1] % 64:
        raise ValueError(f"shuffle_fp8_mma: weight must be [N, K] with N % 16 == 0 and K % 64 == 0, got "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    codes = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    idx = _gather_index(codes.device)
    out = torch.empty((n // 16, k // 64, 2, 32, 16), dtype=torch.uint8, device=codes.device)
    step = max(16, row_chunk - row_chunk % 16)
    for r0 in range(0, n, step):
        part = codes[r0 : r0 + step]
        tiles = part.reshape(-1, 16, k // 64, 64).permute(0, 2, 1, 3).reshape(-1, k // 64, 1024)
        out[r0 // 16 : (r0 + part.shape[0]) // 16] = tiles[..., idx].view(-1, k // 64, 2, 32, 16)
    return out


@dataclass(frozen=True)
class FP8MMAWeight:
    """An FP8 weight in the kernel's layout.

    Attributes:
        codes: uint8 ``[N/16, K/64, 2, 32, 16]`` (:func:`shuffle_fp8_mma`).
        scale: float32 ``[1]`` or ``[N]`` (the :class:`~vibeqwen_kernels.fp8.FP8Weight`'s).
        n, k: the weight's shape.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    n: int
    k: int


def fp8_mma_library(device: torch.device):
    """The built ``csrc/fp8_mma.cu`` for ``device`` (None on CPU, before sm_90, or when it cannot be built)."""
    p, i = ctypes.c_void_p, ctypes.c_int  # pointers (and the stream), ints
    return hopper_library("fp8_mma", device, {
        "vq_fp8_mma_launch": [p, i, i, p, p, i, p, i, i, p, i, i, i, i, i, i, p],
        "vq_fp8_mma_conv_launch": [p, i, i, p, p, i, p, i, i, i, i, i, p, p, ctypes.c_longlong, p, p, i, i, p],
    })


def fp8_mma_supported(n: int, k: int, device: torch.device) -> bool:
    """Whether an ``[N, K]`` FP8 weight runs on the kernel on ``device``: N % 16 == 0, K % 256 == 0, the library
    built there (sm_90+, nvcc), and neither ``VIBEQWEN_FP8_MMA`` nor ``VIBEQWEN_MOE_MMA`` (no shuffled copies at
    all) is ``0``."""
    return (n % 16 == 0 and k % PIECE_K == 0 and os.environ.get("VIBEQWEN_FP8_MMA", "1") != "0"
            and os.environ.get("VIBEQWEN_MOE_MMA", "1") != "0" and fp8_mma_library(torch.device(device)) is not None)


def prepack_fp8_mma(weight) -> FP8MMAWeight:
    """:class:`~vibeqwen_kernels.fp8.FP8Weight` -> :class:`FP8MMAWeight` on its device (a copy of the codes in the
    kernel's layout). Raises ValueError for a shape :func:`shuffle_fp8_mma` does not take or K % 256 != 0."""
    if weight.k % PIECE_K:
        raise ValueError(f"prepack_fp8_mma: K={weight.k} is not a multiple of {PIECE_K}")
    return FP8MMAWeight(codes=shuffle_fp8_mma(weight.weight), scale=weight.scale, n=weight.n, k=weight.k)


#: H200, us per call (CUDA-graph replays over 6 weight copies; Triton ``fp8_linear`` / this kernel with the plan
#: below), the model's shapes:
#:   12288 x 2048: M 1 9.7 / 9.3, M 8 14.7 / 12.9, M 32 16.5 / 15.0, M 64 28.0 / 20.7
#:   9216 x 2048:  M 1 9.0 / 8.6, M 8 13.3 / 10.8, M 32 15.8 / 14.1, M 64 24.6 / 20.0
#:   2048 x 4096:  M 1 6.2 / 6.3, M 8 8.4 / 7.2, M 32 9.8 / 8.9, M 64 13.5 / 10.8
#: (bench/results/h200_notes.md, eleventh session; the floors at 4.24 TB/s are 5.9, 4.5 and 2.0 us.) Twenty-fourth
#: session, 12 warps in 2 k slices (6 tiles a CTA) for the wide weights at 5-32 rows, us (8 warps / 12):
#:   12288 x 2048: M 8 12.8 / 11.4, M 32 15.5 / 14.9;  9216 x 2048: M 8 11.3 / 10.1, M 32 14.5 / 13.1
#: and the decode step (bench/decode_ab.py, VIBEQWEN_FP8_WIDE=0 against the default, means of two rounds in one
#: engine): b8 3.860 -> 3.830 ms, b16 6.117 -> 6.016, b32 8.155 -> 8.062. Twenty-fifth session: the codes read in
#: whole sectors (the layout in shuffle_fp8_mma), us: 12288 x 2048 M 1 9.4 -> 9.1, M 8 11.5 -> 10.7, M 32 15.1 ->
#: 13.1; 9216 x 2048 M 32 13.7 -> 12.4; 2048 x 4096 M 32 9.2 -> 8.7. Slower or even there: 24 warps a CTA, 12 warps in
#: 4 k slices at two CTAs an SM, two pieces of codes in flight, a dequantizer with 15% fewer instructions
#: (bench/results/h200_notes.md): the kernel is bound neither by bytes in flight, nor warps per SM, nor issue.
_SMALL_N = 8192
_SMALL_N_CTAS = 256
#: warps per CTA the kernel takes (the conv-epilogue launch: 8 or more)
WARPS = (4, 8, 12, 16)
_MAX_SPLIT = 8


def launch_plan(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(warps per CTA, k slices per 16-row tile, K split) for an ``[M, K] x [N, K]^T`` call, as measured best on the
    H200 (table above): 8 warps; 4 k slices up to 4 rows, 2 up to 16, else 1 (more rows: each warp's x reads and
    accumulators grow, fewer slices keep its register group); weights of 8192 rows or more at 5-32 rows take 12
    warps in 2 k slices (``VIBEQWEN_FP8_WIDE=0``: the 8-warp plan); weights under 8192 rows also split K across
    CTAs (powers of two up to 8, whole 256-k pieces) until 256 CTAs. ``VIBEQWEN_FP8_PLAN="WxKS"`` (measuring)
    replaces the warps and k slices; ValueError for values the kernel does not take."""
    warps = 8
    kslices = 4 if m <= 4 else 2 if m <= 16 else 1
    if n >= _SMALL_N and 4 < m <= 32 and os.environ.get("VIBEQWEN_FP8_WIDE", "1") != "0":
        warps, kslices = 12, 2  # 6 tiles a CTA, 2 warps each: more warps per SM (the wide weights' 5-32 rows)
    override = os.environ.get("VIBEQWEN_FP8_PLAN", "")
    if override:  # "WxKS": warps x k slices (measuring: bench/decode_ab.py variants)
        parts = override.split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"VIBEQWEN_FP8_PLAN must be WxKS (e.g. 12x2), got {override!r}")
        warps, kslices = (int(v) for v in parts)
        if warps not in WARPS or kslices not in (1, 2, 4):
            raise ValueError(f"VIBEQWEN_FP8_PLAN: warps {warps} not in {WARPS} or k slices {kslices} not 1, 2, 4")
    ctas = -(-(n // 16) // (warps // kslices))
    split = 1
    if n < _SMALL_N:
        while ctas * split < _SMALL_N_CTAS and split < _MAX_SPLIT and k % (PIECE_K * split * 2) == 0:
            split *= 2
    return warps, kslices, split


def fp8_linear_mma(x: torch.Tensor, w: FP8MMAWeight, out: torch.Tensor | None = None,
                   out_dtype: torch.dtype = torch.bfloat16, plan: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``y = x @ (q * scale)^T`` for ``x`` bf16 ``[M, K]``, 1 <= M <= 64 (fp32 sums, the scale after the sum).

    Args:
        x: bf16 ``[M, K]`` on the weight's device, contiguous last dim (else copied), rows 16-byte aligned (else
            copied).
        w: :class:`FP8MMAWeight`.
        out: optional ``[M, N]`` output (bf16 or float32, contiguous last dim); default a new ``out_dtype`` one.
        out_dtype: bf16 or float32 when ``out`` is None.
        plan: (warps, k slices, split) instead of :func:`launch_plan` (4, 8, 12 or 16 warps, 1, 2 or 4 slices;
            measuring and tests).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, a bad plan.
        RuntimeError: the library is not available on the device, or the launch failed.
    """
    x = _checked_x(x, w, "fp8_linear_mma")
    m = x.shape[0]
    if out is None:
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"fp8_linear_mma: out_dtype must be bf16 or float32, got {out_dtype}")
        out = torch.empty((m, w.n), device=x.device, dtype=out_dtype)
    elif (tuple(out.shape) != (m, w.n) or out.dtype not in (torch.bfloat16, torch.float32) or out.device != x.device
          or out.stride(1) != 1):
        raise ValueError(f"fp8_linear_mma: out must be bf16/float32 [{m}, {w.n}] on {x.device} with a contiguous "
                         f"last dim")
    ws = _launch(x, w, out, plan, "fp8_linear_mma")
    if ws is not None:
        from vibeqwen_kernels.fp8 import _linear_kernels as kern

        block = 1024
        kern._fp8_splitk_reduce_kernel[(m, -(-w.n // block))](
            ws, w.scale, out, m, w.n, out.stride(0), 0 if w.scale.numel() == 1 else 1, SPLIT_K=ws.shape[0],
            BLOCK=block, num_warps=4, **pdl_launch(ws.device),
        )
    return out


def _checked_x(x: torch.Tensor, w: FP8MMAWeight, fn: str) -> torch.Tensor:
    """x as the kernel reads it: bf16 ``[1..MMA_MAX_M, K]`` on the weight's device (else ValueError), rows
    16-byte aligned with a contiguous last dim (else a fresh copy)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != w.k or not 1 <= x.shape[0] <= MMA_MAX_M:
        raise ValueError(f"{fn}: x must be bf16 [1..{MMA_MAX_M}, {w.k}], got {x.dtype} {tuple(x.shape)}")
    if x.device != w.codes.device:
        raise ValueError(f"{fn}: x is on {x.device}, the weight on {w.codes.device}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # a fresh copy: aligned rows of K (256k) values
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def _launch(x: torch.Tensor, w: FP8MMAWeight, out: torch.Tensor, plan, fn: str) -> torch.Tensor | None:
    """The GEMM launch of a checked call: the output into ``out`` (no K split), or the fp32 partials into a new
    ``ws [split, M, N]``, returned (``out`` untouched). Raises ValueError (a bad plan) or RuntimeError."""
    m = x.shape[0]
    warps, kslices, split = launch_plan(m, w.n, w.k) if plan is None else plan
    if warps not in WARPS or kslices not in (1, 2, 4) or split < 1 or w.k % (PIECE_K * split):
        raise ValueError(f"{fn}: bad plan (warps {warps}, k slices {kslices}, split {split}) for K={w.k}")
    lib = fp8_mma_library(x.device)
    if lib is None:
        raise RuntimeError(f"{fn}: the CUDA kernel is not available on this device")
    ws = torch.empty((split, m, w.n), device=x.device, dtype=torch.float32) if split > 1 else None
    stride_s = 0 if w.scale.numel() == 1 else 1
    rc = lib.vq_fp8_mma_launch(
        x.data_ptr(), x.stride(0), m, w.codes.data_ptr(), w.scale.data_ptr(), stride_s, out.data_ptr(),
        out.stride(0), 1 if out.dtype == torch.float32 else 0, ws.data_ptr() if ws is not None else None, w.n, w.k,
        split, warps, kslices, pdl_mode(x.device),
        ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"{fn}: launch failed with CUDA error {rc}")
    return ws


def fp8_linear_mma_add_rms_norm(x: torch.Tensor, w: FP8MMAWeight, residual: torch.Tensor, norm_weight: torch.Tensor,
                                eps: float, plan: tuple[int, int, int] | None = None,
                                norm_warps: int | None = None):
    """``rms_norm(fp8_linear_mma(x, w), norm_weight, eps, residual=residual)`` (a decoder layer's output
    projection, then the residual add and the post-attention RMSNorm) with the K split's reduce, the add and the
    norm in one launch (:func:`~vibeqwen_kernels.norm_fused.splitk_add_rms_norm`): two launches instead of three.
    Without a K split in the plan, the GEMM and :func:`~vibeqwen_kernels.norm_fused.rms_norm` (the same values).
    ``h`` is bit for bit the three launches'; ``y`` equal up to the norm's fp32 summation order.

    Args:
        x: bf16 ``[M, K]``, 1 <= M <= :data:`MMA_MAX_M` (as :func:`fp8_linear_mma`).
        w: :class:`FP8MMAWeight`, N <= :data:`~vibeqwen_kernels.norm_fused.SPLITK_NORM_MAX_D`.
        residual: bf16 ``[M, N]``, contiguous last dim.
        norm_weight: ``[N]`` float. eps: the norm's epsilon.
        plan: as :func:`fp8_linear_mma`.
        norm_warps: the fused launch's warps (:func:`~vibeqwen_kernels.norm_fused.splitk_add_rms_norm`; measuring).

    Returns:
        ``(y, h)``: bf16 ``[M, N]`` normed output and residual stream ``h = x W^T + residual``.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit, a bad plan.
        RuntimeError: the library is not available on the device, or the launch failed.
    """
    from vibeqwen_kernels.norm_fused import SPLITK_NORM_MAX_D, rms_norm, splitk_add_rms_norm

    x = _checked_x(x, w, "fp8_linear_mma_add_rms_norm")
    m = x.shape[0]
    if (residual.shape != (m, w.n) or residual.dtype != torch.bfloat16 or residual.device != x.device
            or residual.stride(1) != 1 or w.n > SPLITK_NORM_MAX_D):
        raise ValueError(f"fp8_linear_mma_add_rms_norm: residual must be bf16 [{m}, {w.n}] on {x.device} with a "
                         f"contiguous last dim (N <= {SPLITK_NORM_MAX_D}), got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    y = torch.empty((m, w.n), device=x.device, dtype=torch.bfloat16)
    ws = _launch(x, w, y, plan, "fp8_linear_mma_add_rms_norm")
    if ws is None:  # y holds the GEMM's output
        return rms_norm(y, norm_weight, eps, residual=residual)
    return splitk_add_rms_norm(ws, w.scale, residual, norm_weight, eps, out=y, num_warps=norm_warps)


#: rows up to which :func:`fp8_linear_mma_conv` runs (its 8-n8-tile kernel holds too many registers)
CONV_MAX_M = 32
#: the conv width the epilogue computes (Qwen3.6's ``linear_conv_kernel_dim``)
CONV_WIDTH = 4


def fp8_linear_mma_conv(x: torch.Tensor, w: FP8MMAWeight, conv_weight: torch.Tensor, conv_states: torch.Tensor,
                        slots: torch.Tensor, has_initial_state: torch.Tensor, out: torch.Tensor | None = None,
                        kslices: int | None = None, warps: int | None = None) -> torch.Tensor:
    """``y = x @ (q * scale)^T`` with the depthwise causal conv1d + SiLU of
    :func:`~vibeqwen_kernels.conv1d.causal.causal_conv1d` applied to output channels ``[0, C)``, for a decode step
    of M sequences of one token each (row m = sequence m): ``out[:, :C]`` equals ``causal_conv1d(y[:, :C], ...)``
    bit for bit, ``out[:, C:]`` equals ``y[:, C:]`` (:func:`fp8_linear_mma`'s bits), and each sequence's conv
    state slot is shifted as the conv kernel shifts it (``conv_states[slots[m]] = [old[1:], y[m, :C]]``; a
    sequence without initial state reads zeros). Rows sharing a slot (a CUDA graph's padding rows) race on it: only
    for scratch slots. Source of the conv: ``csrc/fp8_mma.cu`` (its header gives the operation order).

    Args:
        x: bf16 ``[M, K]``, 1 <= M <= :data:`CONV_MAX_M` (last dim contiguous; rows 16-byte aligned, else copied).
        w: :class:`FP8MMAWeight` with N >= C.
        conv_weight: ``[C, 4]`` bf16 conv taps (C a multiple of 16), contiguous.
        conv_states: bf16 ``[num_slots, C, 3]``, each slot contiguous; updated in place.
        slots: int64 ``[M]`` each sequence's slot. has_initial_state: bool ``[M]``.
        out: optional bf16 ``[M, N]`` output (contiguous last dim); default a new one.
        kslices: k slices per 16-row tile (1, 2 or 4); default :func:`launch_plan`'s.
        warps: per CTA (8, 12 or 16); default :func:`launch_plan`'s (at least 8).

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not fit (the caller falls back to the two launches:
            :func:`fp8_conv_supported` says beforehand).
        RuntimeError: the library is not available on the device, or the launch failed.
    """
    m = x.shape[0] if x.dim() == 2 else 0
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != w.k or not 1 <= m <= CONV_MAX_M:
        raise ValueError(f"fp8_linear_mma_conv: x must be bf16 [1..{CONV_MAX_M}, {w.k}], got {x.dtype} "
                         f"{tuple(x.shape)}")
    c = conv_weight.shape[0] if conv_weight.dim() == 2 else 0
    if (conv_weight.dim() != 2 or conv_weight.shape[1] != CONV_WIDTH or conv_weight.dtype != torch.bfloat16
            or not conv_weight.is_contiguous() or c < 16 or c % 16 or c > w.n):
        raise ValueError(f"fp8_linear_mma_conv: conv_weight must be contiguous bf16 [C, {CONV_WIDTH}] with C a "
                         f"multiple of 16 and <= {w.n}, got {conv_weight.dtype} {tuple(conv_weight.shape)}")
    if (conv_states.dim() != 3 or conv_states.shape[1:] != (c, CONV_WIDTH - 1) or conv_states.dtype != torch.bfloat16
            or conv_states.stride(2) != 1 or conv_states.stride(1) != CONV_WIDTH - 1):
        raise ValueError(f"fp8_linear_mma_conv: conv_states must be bf16 [slots, {c}, {CONV_WIDTH - 1}] with "
                         f"contiguous slots, got {conv_states.dtype} {tuple(conv_states.shape)}")
    if slots.shape != (m,) or slots.dtype != torch.int64 or has_initial_state.shape != (m,) \
            or has_initial_state.dtype != torch.bool:
        raise ValueError(f"fp8_linear_mma_conv: slots must be int64 [{m}] and has_initial_state bool [{m}]")
    tensors = (x, w.codes, conv_weight, conv_states, slots, has_initial_state)
    if len({t.device for t in tensors}) != 1:
        raise ValueError("fp8_linear_mma_conv: tensors on several devices")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    slots, has_initial_state = slots.contiguous(), has_initial_state.contiguous()
    if out is None:
        out = torch.empty((m, w.n), device=x.device, dtype=torch.bfloat16)
    elif tuple(out.shape) != (m, w.n) or out.dtype != torch.bfloat16 or out.device != x.device or out.stride(1) != 1:
        raise ValueError(f"fp8_linear_mma_conv: out must be bf16 [{m}, {w.n}] on {x.device} with a contiguous last dim")
    plan_warps, plan_ks, _ = launch_plan(m, w.n, w.k)
    ks = plan_ks if kslices is None else kslices
    nw = max(plan_warps, 8) if warps is None else warps
    if ks not in (1, 2, 4) or nw not in (8, 12, 16):
        raise ValueError(f"fp8_linear_mma_conv: kslices must be 1, 2 or 4 and warps 8, 12 or 16, got {ks}, {nw}")
    lib = fp8_mma_library(x.device)
    if lib is None:
        raise RuntimeError("fp8_linear_mma_conv: the CUDA kernel is not available on this device")
    stride_s = 0 if w.scale.numel() == 1 else 1
    rc = lib.vq_fp8_mma_conv_launch(
        x.data_ptr(), x.stride(0), m, w.codes.data_ptr(), w.scale.data_ptr(), stride_s, out.data_ptr(), out.stride(0),
        w.n, w.k, nw, ks, conv_weight.data_ptr(), conv_states.data_ptr(), conv_states.stride(0), slots.data_ptr(),
        has_initial_state.data_ptr(), c, pdl_mode(x.device),
        ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream),
    )
    if rc != 0:
        raise RuntimeError(f"fp8_linear_mma_conv: launch failed with CUDA error {rc}")
    return out


def fp8_conv_supported(m: int, w: FP8MMAWeight, conv_channels: int, conv_width: int) -> bool:
    """Whether :func:`fp8_linear_mma_conv` takes a decode step of ``m`` sequences over ``w`` with a conv of
    ``conv_channels`` x ``conv_width``: 1 <= m <= :data:`CONV_MAX_M`, width 4, channels a multiple of 16 within N,
    no K split in :func:`launch_plan`, and ``VIBEQWEN_FP8_CONV`` not ``0`` (the two launches, for comparison)."""
    return (1 <= m <= CONV_MAX_M and conv_width == CONV_WIDTH and 16 <= conv_channels <= w.n
            and conv_channels % 16 == 0 and launch_plan(m, w.n, w.k)[2] == 1
            and os.environ.get("VIBEQWEN_FP8_CONV", "1") != "0")
