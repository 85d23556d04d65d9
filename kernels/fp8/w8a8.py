"""FP8 W8A8 linear for many-row passes: activations quantized per token to E4M3, FP8 tensor cores.

``y = (q_x * s_x) @ (w * s_w)^T`` where, per row m of x, ``s_x[m] = max(max_k |x[m, k]|, tiny) / 448``
(448: the largest finite E4M3 value) and ``q_x[m] = e4m3(clamp(x[m] / s_x[m], -448, 448))`` (round to
nearest even); ``w`` and ``s_w`` are the checkpoint's E4M3 weight and its scale (one per output row,
:class:`~vibeqwen_kernels.fp8.FP8Weight`). This is the dynamic per-token activation scaling vLLM uses for
FP8 W8A8 layers (``scaled_fp8_quant(..., use_per_token_if_dynamic=True)``). The checkpoint's static
``input_scale`` is not used: a synthetic checkpoint's value is assumed, not calibrated, and a per-token scale
never clips.

Accuracy: a token's E4M3 codes carry 3 mantissa bits, so each activation is rounded to a relative step of
2^-3 (about 2.4% rms relative error for normally distributed values); products and the fp32 accumulation
are exact up to summation order. Against W8A16 (bf16 activations, 2^-8 steps) the projections' outputs
carry roughly 2% relative noise; bench/results/h200_notes.md gives the end-to-end effect on the logits.

Public surface: :func:`quantize_rows_fp8` / :func:`quantize_rows_fp8_ref` and :func:`fp8_w8a8_linear` /
:func:`fp8_w8a8_linear_ref`. On CUDA tensors the quantizer is a Triton kernel (``_quant_kernels.py``) and the
GEMM is ``torch._scaled_mm`` with row-wise scales (CUTLASS / cuBLASLt FP8 kernels on sm_90); elsewhere both
run the references.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from vibeqwen_kernels.fp8.linear import FP8Weight
from vibeqwen_kernels.pdl import pdl_launch

__all__ = ["E4M3_MAX", "QuantizedRows", "fp8_w8a8_linear", "fp8_w8a8_linear_ref", "quantize_rows_fp8", "quantize_rows_fp8_ref",
           "weight_scale_row"]

class QuantizedRows(NamedTuple):
    """Activations already quantized per row (:func:`quantize_rows_fp8`, or a norm kernel that quantizes its
    output: ``vibeqwen_kernels.norm_fused``): q float8_e4m3fn ``[M, K]`` (rows contiguous), scale float32
    ``[M, 1]``, ``x ~= q.float() * scale``."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


#: The largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
#: Floor of a row's amax (an all-zero row, e.g. padding, gets this scale and zero codes).
_TINY = 1e-12


def quantize_rows_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch per-row E4M3 quantization (the definition; see the module docstring).

    Args:
        x: ``[M, K]`` bf16 / fp16 / fp32.
    Returns:
        (q float8_e4m3fn ``[M, K]`` contiguous, scale float32 ``[M, 1]``) with ``x ~= q.float() * scale``.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(_TINY)
    # tensor / tensor: an IEEE division (torch turns a division by a Python number into a multiplication by
    # its rounded reciprocal, which differs in the last bit about half the time)
    scale = amax / torch.full_like(amax, E4M3_MAX)
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row E4M3 quantization: the Triton kernel on CUDA, :func:`quantize_rows_fp8_ref` elsewhere; the
    same values either way (IEEE divisions, round to nearest even).

    Args:
        x: ``[M, K]`` bf16 / fp16 / fp32 with unit stride along K (rows may be strided).
    Returns:
        (q float8_e4m3fn ``[M, K]``, scale float32 ``[M, 1]``).
    Raises:
        ValueError: x not 2-D, or its last dimension not contiguous.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_fp8: x must be [M, K], got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise ValueError(f"quantize_rows_fp8: x's last dimension must be contiguous, strides {x.stride()}")
    if x.device.type != "cuda":
        return quantize_rows_fp8_ref(x)
    import triton
    from vibeqwen_kernels.fp8._quant_kernels import _quant_rows_kernel

    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m:
        block = triton.next_power_of_2(k)
        rows, warps = _quant_launch(block)
        _quant_rows_kernel[(triton.cdiv(m, rows),)](x, q, scale, m, k, x.stride(0), q.stride(0), _TINY, ROWS=rows,
                                                    BLOCK_K=block, num_warps=warps, **pdl_launch(x.device))
    return q, scale


#: Elements per program of the quantizer, and its warps (see `_quant_launch`; on the H200 other shapes were
#: within 0.2 us at 1k rows: bench/results/h200.json kernel_experiments_ninth_session).
QUANT_ELEMS = 4096
QUANT_WARPS = 4


def _quant_launch(block_k: int) -> tuple[int, int]:
    """(rows per program, num_warps) of the quantizer for rows of block_k (a power of two) elements."""
    rows = max(1, QUANT_ELEMS // block_k)
    return 1 << (rows.bit_length() - 1), QUANT_WARPS  # a power of two (tl.arange)


def weight_scale_row(weight: FP8Weight) -> torch.Tensor:
    """The weight's scale as the ``[1, N]`` float32 row ``torch._scaled_mm`` takes (per-tensor scales
    expanded); build it once at load time."""
    return weight.scale.float().reshape(1, -1).expand(1, weight.n).contiguous()


def fp8_w8a8_linear_ref(x: torch.Tensor | QuantizedRows, weight: FP8Weight) -> torch.Tensor:
    """Plain-torch W8A8: ``(q_x * s_x) @ (w * s_w)^T`` in fp32, x quantized by :func:`quantize_rows_fp8_ref`
    (or given as its :class:`QuantizedRows`).

    x ``[M, K]`` (bf16 / fp16 / fp32) -> float32 ``[M, N]``.
    """
    q, s = x if isinstance(x, QuantizedRows) else quantize_rows_fp8_ref(x)
    return (q.float() * s) @ weight.dequantize(torch.float32).t()


def fp8_w8a8_linear(x: torch.Tensor | QuantizedRows, weight: FP8Weight, scale_row: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``y = x W^T`` with x quantized per row to E4M3 (module docstring), on FP8 tensor cores.

    Args:
        x: ``[M, K]`` bf16 / fp16 / fp32, K contiguous, or its :class:`QuantizedRows`; K and N multiples of
            16 on CUDA.
        weight: the E4M3 weight ``[N, K]`` and its scale (:func:`~vibeqwen_kernels.fp8.prepack_fp8`).
        scale_row: :func:`weight_scale_row` of ``weight`` (built here when None).
        out_dtype: bf16 or fp32 (CUDA); the reference's fp32 result is cast to it elsewhere.
    Returns:
        ``[M, N]`` ``out_dtype``: fp32 accumulation, both scales applied before the one rounding.
    Raises:
        ValueError: shapes that do not match, or K / N not multiples of 16 on CUDA.
    """
    if len(x.shape) != 2 or x.shape[1] != weight.k:
        raise ValueError(f"fp8_w8a8_linear: x must be [M, {weight.k}], got shape {tuple(x.shape)}")
    quantized = isinstance(x, QuantizedRows)
    if (x.q if quantized else x).device.type != "cuda":
        return fp8_w8a8_linear_ref(x, weight).to(out_dtype)
    if weight.k % 16 or weight.n % 16:
        raise ValueError(f"fp8_w8a8_linear: K and N must be multiples of 16 for FP8 tensor cores, got "
                         f"N={weight.n}, K={weight.k}")
    if scale_row is None:
        scale_row = weight_scale_row(weight)
    q, s = x if quantized else quantize_rows_fp8(x)
    return torch._scaled_mm(q, weight.weight.t(), scale_a=s, scale_b=scale_row, out_dtype=out_dtype)
