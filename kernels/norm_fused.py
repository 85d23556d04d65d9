"""Fused RMSNorm kernels (Triton): residual add + zero-centred RMSNorm, and the GDN gated RMSNorm.

References (the specification) are :func:`vibeqwen_kernels.norm.rms_norm_ref` and
:func:`vibeqwen_kernels.norm.gated_rms_norm_ref`. Each wrapper is one kernel launch whose grid depends
only on tensor shapes (no host<->device sync), so both are CUDA-graph capturable. On the CPU they run
only under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
from vibeqwen_kernels.pdl import pdl_launch

__all__ = ["gated_rms_norm", "gated_rms_norm_fp8", "gated_rms_norm_fp8_supports", "rms_norm", "splitk_add_rms_norm",
           "SPLITK_NORM_MAX_D"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Elements one program holds (rows x padded D); bounds registers and sets rows per program for small D.
_ELEMS_PER_PROGRAM = 2048
#: The E4M3 quantizer's floor of a row's amax (vibeqwen_kernels.fp8.w8a8).
_QUANT_TINY = 1e-12


@lru_cache(maxsize=1)
def _kernels():
    from vibeqwen_kernels import _norm_kernels

    return _norm_kernels


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _check_device(fn: str, *tensors: torch.Tensor, ref: str = "the *_ref function") -> None:
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"{fn}: all tensors must be on one device, got {dev} and {t.device}")
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"{fn}: needs CUDA tensors (got {dev}); use {ref} or TRITON_INTERPRET=1"
        )


def _launch_shape(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS per program, num_warps) for row length d."""
    block_d = _next_pow2(d)
    rows = max(1, _ELEMS_PER_PROGRAM // block_d)
    # ~8-16 elements per thread: 4 warps for D <= 2048, 8 beyond
    warps = 4 if rows * block_d <= 2048 else 8
    return block_d, rows, warps


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    quantize: bool = False,
):
    """Zero-centred RMSNorm, optionally fused with the residual add, in one kernel launch.

    Without ``residual``: ``y = rms_norm_ref(x, weight, eps)``. With it: ``h = x + residual`` rounded
    to ``x.dtype`` (the sum in fp32, one rounding: exactly torch's ``x + residual`` for same-dtype
    operands), ``y = rms_norm_ref(h, weight, eps)``, returns ``(y, h)``. Formula: Qwen3.5/3.6 ``RMSNorm``
    ``y = x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, cast to ``x.dtype`` (HF
    ``Qwen3_5MoeRMSNorm``); equal to the reference up to fp32 summation order and the GPU's rsqrt.

    Args:
        x: ``[T, D]`` bf16/fp16/fp32; rows may be strided (last dim contiguous, else it is copied).
        weight: ``[D]`` any float dtype (read as fp32).
        eps: variance epsilon (1e-6 for the model).
        residual: optional ``[T, D]`` float tensor (last dim contiguous); not modified unless passed
            again as ``residual_out``.
        out: optional ``[T, D]`` ``x.dtype`` output for ``y`` (last dim contiguous).
        residual_out: optional ``[T, D]`` ``x.dtype`` output for ``h``; may be ``residual`` or ``x``
            itself (in-place: each element is read before it is written by the same program).
        quantize: also return ``y`` quantized per row to E4M3 for a W8A8 linear layer
            (:class:`~vibeqwen_kernels.fp8.QuantizedRows`, the same codes and scales
            :func:`~vibeqwen_kernels.fp8.quantize_rows_fp8` gives for ``y``), from the same launch.

    Returns:
        ``y`` (``[T, D]``, ``x.dtype``), or ``(y, h)`` when ``residual`` is given; with ``quantize`` the
        QuantizedRows of ``y`` is appended: ``(y, yq)`` or ``(y, h, yq)``.

    Raises:
        ValueError: bad dims/shapes/dtypes, tensors on different devices, or CPU tensors outside the
            Triton interpreter.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"rms_norm: x must be a 2-D bf16/fp16/fp32 tensor, got {getattr(x, 'dtype', x)}")
    t, d = x.shape
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (d,) or not weight.is_floating_point():
        raise ValueError(f"rms_norm: weight must be a float tensor of shape [{d}]")
    tensors = [x, weight]
    if residual is not None:
        if tuple(residual.shape) != (t, d) or residual.dtype not in _DTYPES:
            raise ValueError(
                f"rms_norm: residual must be a float [{t}, {d}] tensor, got {residual.dtype} "
                f"{tuple(residual.shape)}"
            )
        tensors.append(residual)
    for name, o in (("out", out), ("residual_out", residual_out)):
        if o is not None:
            if tuple(o.shape) != (t, d) or o.dtype != x.dtype or (d > 1 and t > 0 and o.stride(1) != 1):
                raise ValueError(
                    f"rms_norm: {name} must be a [{t}, {d}] {x.dtype} tensor with a contiguous last dim"
                )
            tensors.append(o)
    if residual_out is not None and residual is None:
        raise ValueError("rms_norm: residual_out needs residual")
    _check_device("rms_norm", *tensors)
    if d > 1 and x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and d > 1 and residual.stride(1) != 1:
        residual = residual.contiguous()
    weight = weight.contiguous()
    y = out if out is not None else torch.empty((t, d), device=x.device, dtype=x.dtype)
    if residual is not None and residual_out is None:
        residual_out = torch.empty((t, d), device=x.device, dtype=x.dtype)
    yq = None
    if quantize:
        from vibeqwen_kernels.fp8.w8a8 import QuantizedRows

        yq = QuantizedRows(torch.empty((t, d), device=x.device, dtype=torch.float8_e4m3fn),
                           torch.empty((t, 1), device=x.device, dtype=torch.float32))
    if t > 0 and d > 0:
        block_d, rows, warps = _launch_shape(d)
        has_res = residual is not None
        r = residual if has_res else x
        ro = residual_out if has_res else y
        qq, qs = (yq.q, yq.scale) if quantize else (y, y)
        _kernels()._rms_norm_kernel[(-(-t // rows),)](
            x, r, weight, y, ro, t, d,
            x.stride(0), r.stride(0), y.stride(0), ro.stride(0),
            float(eps), qq, qs, qq.stride(0), _QUANT_TINY,
            HAS_RESIDUAL=has_res, ROWS=rows, BLOCK_D=block_d, QUANT=quantize, num_warps=warps,
            **pdl_launch(x.device),
        )  # fmt: skip
    outs = (y, residual_out) if residual is not None else (y,)
    if quantize:
        outs += (yq,)
    return outs if len(outs) > 1 else y


#: the longest row :func:`splitk_add_rms_norm` holds in one program
SPLITK_NORM_MAX_D = 8192
#: :func:`splitk_add_rms_norm`'s warps per program (one program a row: more warps, more of the row's partial sums
#: in flight at once; bench/kernels/bench_post_norm.py)
SPLITK_NORM_WARPS = 8


def splitk_add_rms_norm(
    ws: torch.Tensor,
    scale: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    num_warps: int | None = None,
):
    """A split-K GEMM's reduction, the residual add and the RMSNorm after it, in one launch: the split-K reduce of
    :func:`~vibeqwen_kernels.fp8.mma.fp8_linear_mma` followed by :func:`rms_norm` with ``residual``.

    ``x = (sum_s ws[s]) * scale`` (fp32, splits in order) rounded to ``residual.dtype`` (the GEMM's output),
    ``h = x + residual`` (fp32 add, one rounding), ``y = h * rsqrt(mean(h^2) + eps) * (1 + w)`` (fp32, cast):
    ``h`` bit for bit the two launches', ``y`` up to the fp32 summation order of ``mean(h^2)`` (a rare one-ulp flip
    of the final rounding; see :func:`rms_norm`). One program per row.

    Args:
        ws: float32 ``[S, M, N]`` contiguous unscaled partial sums, 1 <= S <= 16, N <= :data:`SPLITK_NORM_MAX_D`.
        scale: float32, one value (per-tensor) or ``[N]`` (per output column), contiguous.
        residual: ``[M, N]`` bf16/fp16/fp32 (last dim contiguous); its dtype is the outputs'.
        weight: ``[N]`` float (zero-centred RMSNorm weight).
        eps: variance epsilon.
        out, residual_out: optional ``[M, N]`` outputs of ``residual.dtype`` (last dim contiguous);
            ``residual_out`` may be ``residual`` itself.
        num_warps: warps per program (1-16, a power of two); default :data:`SPLITK_NORM_WARPS` (measuring).

    Returns:
        ``(y, h)``, both ``[M, N]`` of ``residual.dtype``.

    Raises:
        ValueError: bad shapes, dtypes or strides, tensors on several devices, or CPU tensors outside the Triton
            interpreter.
    """
    if not isinstance(ws, torch.Tensor) or ws.dim() != 3 or ws.dtype != torch.float32:
        raise ValueError(f"splitk_add_rms_norm: ws must be a float32 [S, M, N] tensor, got "
                         f"{getattr(ws, 'dtype', ws)} {tuple(getattr(ws, 'shape', ()))}")
    if not ws.is_contiguous():
        raise ValueError(f"splitk_add_rms_norm: ws must be contiguous, got strides {ws.stride()}")
    s, t, d = ws.shape
    if not 1 <= s <= 16 or not 1 <= d <= SPLITK_NORM_MAX_D:
        raise ValueError(f"splitk_add_rms_norm: needs 1..16 splits and 1..{SPLITK_NORM_MAX_D} columns, got "
                         f"{tuple(ws.shape)}")
    if (not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() not in (1, d)
            or not scale.is_contiguous()):
        raise ValueError(f"splitk_add_rms_norm: scale must be a contiguous float32 tensor of 1 or {d} values, got "
                         f"{getattr(scale, 'dtype', scale)} {tuple(getattr(scale, 'shape', ()))}")
    if (not isinstance(residual, torch.Tensor) or tuple(residual.shape) != (t, d) or residual.dtype not in _DTYPES
            or (d > 1 and residual.stride(1) != 1)):
        raise ValueError(f"splitk_add_rms_norm: residual must be a float [{t}, {d}] tensor with a contiguous last "
                         f"dim, got {getattr(residual, 'dtype', residual)} {tuple(getattr(residual, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (d,) or not weight.is_floating_point():
        raise ValueError(f"splitk_add_rms_norm: weight must be a float tensor of shape [{d}], got "
                         f"{getattr(weight, 'dtype', weight)} {tuple(getattr(weight, 'shape', ()))}")
    outs = []
    for name, o in (("out", out), ("residual_out", residual_out)):
        if o is None:
            o = torch.empty((t, d), device=residual.device, dtype=residual.dtype)
        elif tuple(o.shape) != (t, d) or o.dtype != residual.dtype or (d > 1 and o.stride(1) != 1):
            raise ValueError(f"splitk_add_rms_norm: {name} must be a [{t}, {d}] {residual.dtype} tensor with a "
                             f"contiguous last dim")
        outs.append(o)
    y, h = outs
    warps = SPLITK_NORM_WARPS if num_warps is None else num_warps
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"splitk_add_rms_norm: num_warps must be a power of two in 1..16, got {warps}")
    _check_device("splitk_add_rms_norm", ws, scale, residual, weight, y, h,
                  ref="the sum of ws times scale, then vibeqwen_kernels.norm.rms_norm_ref of it plus the residual")
    if t > 0:
        block_d = _next_pow2(d)
        _kernels()._splitk_add_rms_norm_kernel[(t,)](
            ws, scale, residual, weight.contiguous(), y, h, t, d,
            0 if scale.numel() == 1 else 1, residual.stride(0), y.stride(0), h.stride(0), float(eps),
            SPLIT_K=s, BLOCK_D=block_d, num_warps=warps,
            **pdl_launch(ws.device),
        )  # fmt: skip
    return y, h


def _check_gated(fn: str, x, z, weight) -> tuple[int, int, int]:
    """The gated norms' checks of shapes and dtypes (see :func:`gated_rms_norm`); returns (T, H, D). Raises
    ValueError."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype not in _DTYPES:
        raise ValueError(f"{fn}: x must be a 3-D bf16/fp16/fp32 tensor, got {getattr(x, 'dtype', x)}")
    t, h, d = x.shape
    if not isinstance(z, torch.Tensor) or tuple(z.shape) != (t, h, d) or z.dtype not in _DTYPES:
        raise ValueError(f"{fn}: z must be a float [{t}, {h}, {d}] tensor")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (d,) or not weight.is_floating_point():
        raise ValueError(f"{fn}: weight must be a float tensor of shape [{d}]")
    return t, h, d


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of the GDN output, one kernel launch: ``y = (w * norm(x)) * silu(z)``.

    Follows :func:`vibeqwen_kernels.norm.gated_rms_norm_ref` (HF ``Qwen3_5MoeRMSNormGated``) rounding
    step by step: ``n = (x * rsqrt(mean(x^2) + eps))`` in fp32 rounded to ``x.dtype``; ``w`` rounded to
    ``x.dtype``; ``w * n`` rounded to ``x.dtype``; times ``silu(z)`` (fp32, ``z / (1 + exp(-z))``);
    rounded to ``x.dtype``. Equal to the reference up to fp32 summation order and the GPU's
    sqrt/exp/division (a rare one-ulp flip of an intermediate rounding).

    Args:
        x: ``[T, H, D]`` bf16/fp16/fp32, any strides.
        z: ``[T, H, D]`` gate, any float dtype, any strides (e.g. a column view of a fused projection).
        weight: ``[D]`` float (plain weight, not zero-centred).
        eps: variance epsilon.

    Returns:
        contiguous ``[T, H, D]`` tensor of ``x.dtype``.

    Raises:
        ValueError: bad dims/shapes/dtypes, tensors on different devices, or CPU tensors outside the
            Triton interpreter.
    """
    t, h, d = _check_gated("gated_rms_norm", x, z, weight)
    _check_device("gated_rms_norm", x, z, weight)
    y = torch.empty((t, h, d), device=x.device, dtype=x.dtype)
    r = t * h
    if r > 0 and d > 0:
        block_d, rows, warps = _launch_shape(d)
        _kernels()._gated_rms_norm_kernel[(-(-r // rows),)](
            x, z, weight.contiguous(), y, r, h, d,
            x.stride(0), x.stride(1), x.stride(2), z.stride(0), z.stride(1), z.stride(2),
            float(eps), y, y, _QUANT_TINY,
            ROWS=rows, BLOCK_D=block_d, num_warps=warps,
            **pdl_launch(x.device),
        )  # fmt: skip
    return y


def gated_rms_norm_fp8_supports(h: int, d: int) -> bool:
    """Whether :func:`gated_rms_norm_fp8` takes H heads of D: powers of two, H * D <= 8192 (one token's
    outputs in one program)."""
    return d == _next_pow2(d) and h == _next_pow2(h) and h * d <= 8192


def gated_rms_norm_fp8(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float):
    """:func:`gated_rms_norm` quantized for a W8A8 linear layer, in one launch: the E4M3 codes and scale of
    each token's ``H * D`` outputs (the codes :func:`~vibeqwen_kernels.fp8.quantize_rows_fp8` gives for
    ``gated_rms_norm(x, z, weight, eps).reshape(T, H * D)``); the bf16 output itself is not written.

    Args: as :func:`gated_rms_norm`; H and D must be powers of two and H * D at most 8192.
    Returns:
        :class:`~vibeqwen_kernels.fp8.QuantizedRows` (q float8_e4m3fn ``[T, H * D]``, scale float32 ``[T, 1]``).
    Raises:
        ValueError: as :func:`gated_rms_norm`, or D / H * D outside the above.
    """
    from vibeqwen_kernels.fp8.w8a8 import QuantizedRows

    t, h, d = _check_gated("gated_rms_norm_fp8", x, z, weight)
    if not gated_rms_norm_fp8_supports(h, d):
        raise ValueError(f"gated_rms_norm_fp8: needs H and D powers of two, H * D <= 8192; got H={h}, D={d}")
    _check_device("gated_rms_norm_fp8", x, z, weight)
    out = QuantizedRows(torch.empty((t, h * d), device=x.device, dtype=torch.float8_e4m3fn),
                        torch.empty((t, 1), device=x.device, dtype=torch.float32))
    if t > 0:
        rows = h  # one token per program: ROWS must hold whole tokens
        warps = 4 if h * d <= 2048 else 8
        _kernels()._gated_rms_norm_kernel[(t,)](
            x, z, weight.contiguous(), out.q, t * h, h, d,
            x.stride(0), x.stride(1), x.stride(2), z.stride(0), z.stride(1), z.stride(2),
            float(eps), out.q, out.scale, _QUANT_TINY,
            ROWS=rows, BLOCK_D=d, QUANT_HEADS=h, num_warps=warps,
            **pdl_launch(x.device),
        )  # fmt: skip
    return out
