"""NVFP4 and FP8 (E4M3) weight quantization, bit-compatible with NVIDIA ModelOpt's HF export.

This module is the numerical reference for every checkpoint layout in DESIGN.md section 2: the
loaders use the dequantizers, and the synthetic-checkpoint writers and the "BF16 original ->
NVFP4 at load time" path use the quantizers. Everything is plain, vectorised PyTorch and runs
on whatever device the input lives on (CPU or CUDA); nothing here loops over rows or blocks.

Formats
-------
NVFP4 (ModelOpt ``NVFP4`` / ``W4A16_NVFP4``), for a weight ``w`` of shape ``[..., N, K]``:

* ``weight``         uint8 ``[..., N, K // 2]``: two 4-bit E2M1 codes per byte, the LOW nibble is
                     element ``2i`` and the HIGH nibble element ``2i + 1`` (row-major).
* ``weight_scale``   float8_e4m3fn ``[..., N, K // 16]``: one scale per 16 consecutive elements of K.
* ``weight_scale_2`` float32, one per 2-D matrix: ``amax / (6 * 448)`` (dimensionless multiplier).
* value = ``E2M1_VALUES[code] * (float32(weight_scale) * weight_scale_2)``.

E2M1 code: bit 3 is the sign, bits 0-2 index the magnitudes ``{0, .5, 1, 1.5, 2, 3, 4, 6}``.

FP8 per-tensor (ModelOpt ``FP8``): ``weight`` float8_e4m3fn (same shape as ``w``), ``weight_scale``
float32 scalar ``amax / 448``; value = ``float32(weight) * weight_scale``.

Source of the math
------------------
NVIDIA Model-Optimizer (github.com/NVIDIA/Model-Optimizer, formerly TensorRT-Model-Optimizer),
tag 0.46.0; the functions below are unchanged on main as of 2026-08. (Third-party notes put the
vendor's Qwen3.6 NVFP4 export at a 0.46.0 dev build; check ``producer.version`` in its
``hf_quant_config.json``.) This is ModelOpt's max-calibration ("dynamic") weight path. If an
export used MSE weight calibration (ModelOpt's ``nvfp4_experts_only_mse`` recipe for this model),
its block scales come from a searched per-block amax rather than the block's max |w|, and cannot
be reproduced from the weights alone; the E2M1 rounding, packing and scale semantics are the same.

* ``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``: ``NVFP4QTensor.get_weights_scaling_factor_2``
  / ``get_weights_scaling_factor_2_from_quantizer`` (global scale), ``get_weights_scaling_factor``
  and the module function ``_cast_per_block_scale_to_fp8`` (block scales), ``_cast_fp4`` and the
  module tables ``e2m1_bounds`` / ``e2m1_values`` (rounding to E2M1), ``quantize`` (scaling and
  packing), ``dequantize`` (reconstruction), ``get_activation_scaling_factor`` (NVFP4 input scale).
* ``modelopt/torch/export/unified_export_hf.py``: ``_export_quantized_weight`` (FP8 weight scale
  ``amax / 448``; a per-tensor max-calibrated amax is 0-d, so its float32-tensor branch applies).
* ``modelopt/torch/export/quant_utils.py``: ``to_quantized_weight`` (FP8:
  ``(weight / weight_scale).to(float8_e4m3fn)``), ``get_scaling_factor`` (FP8 input scale
  ``amax / 448``).
* ``modelopt/torch/export/moe_utils.py``: ``_export_fused_experts`` (each expert's gate and up
  projections are quantized with ONE shared amax, so they share ``weight_scale_2``; use the ``amax``
  keyword of :func:`nvfp4_quantize` to reproduce that).

Each quantizer below uses the same operations, operand dtypes and operand kinds (tensor on the
input's device vs. Python scalar) as ModelOpt, so on a given device it reproduces ModelOpt's bits
(checked against ModelOpt 0.46's own ``NVFP4QTensor`` code on CPU, and against its expressions on an
H200 with torch 2.11), including how PyTorch evaluates a division on that device. Those device
effects are real and ModelOpt has them too: on CUDA, ``x / python_float`` is computed as
``x * float32(1 / python_float)`` (so ``amax / 2688`` and ``amax / 448`` can land one float32 ulp away
from the CPU result, which occasionally moves a block scale or code), and ``bf16_tensor /
fp32_0d_cuda_tensor`` first rounds the divisor to bf16 (so FP8 codes of bf16/fp16 weights quantized
on CUDA differ from CPU-quantized ones in a few percent of elements, by one E4M3 step). Both
results are valid; quantize on CUDA to match an export made on GPUs.

Where ModelOpt divides by zero
------------------------------
* All-zero tensor (amax == 0): ModelOpt's NVFP4 path computes ``weight_scale_2 = 0`` and then
  ``0 / 0`` -> NaN block scales and garbage codes; its FP8 weight path computes ``0 / 0`` -> NaN
  weights. Here the scale becomes 1.0 instead (``weight_scale_2 = 1.0`` for NVFP4, ``weight_scale =
  1.0`` for FP8), mirroring ``TensorQuantizer.export_amax`` which maps a zero amax to a unit scale.
  The codes are then all 0, the block scales all 1.0, and the tensor dequantizes to exact zeros.
* All-zero 16-element block in a non-zero tensor: ModelOpt sets that block's scale to 1.0 (its
  ``per_block_scale[per_block_scale == 0] = 1.0``); so does this module. Its codes are 0.
* Tiny blocks whose scale would underflow E4M3: ModelOpt >= 0.45 clamps block scales to
  ``[2**-9, 448]`` before the cast (``_cast_per_block_scale_to_fp8``); so does this module, so no
  block scale is ever 0 or NaN. (ModelOpt <= 0.44 did not clamp: such blocks got a 0 scale.)
* Non-finite inputs (NaN/inf anywhere in ``w``) are rejected with ValueError; ModelOpt would emit NaN.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "ct_nvfp4_quantize",
    "NVFP4_BLOCK_SIZE",
    "fp8_dequantize",
    "fp8_quantize",
    "input_scale_for",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "pack_e2m1",
    "unpack_e2m1",
]

#: Largest E2M1 magnitude.
E2M1_MAX = 6.0
#: Largest finite float8_e4m3fn magnitude.
E4M3_MAX = 448.0
#: NVFP4 block length along the last (K) dimension.
NVFP4_BLOCK_SIZE = 16
#: Smallest positive float8_e4m3fn value (a subnormal); ModelOpt clamps block scales up to it.
_E4M3_MIN_SUBNORMAL = 2.0**-9

#: float32 [16]: the value of each 4-bit E2M1 code (index = code). Codes 8..15 are the negatives of
#: 0..7; code 8 decodes to +0.0, exactly as ModelOpt's ``e2m1_values`` table does.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Decision points between consecutive E2M1 magnitudes (midpoints of the grid): 0.25, 0.75, 1.25,
# 1.75, 2.5, 3.5, 5.0.
# Midpoints whose upper neighbour has an even mantissa (1.0, 2.0, 4.0): ties there round UP.
# At the other midpoints (0.25, 1.25, 2.5, 5.0) the lower neighbour is the even one: ties round DOWN.
_TIES_ROUND_UP = (0.75, 1.75, 3.5)
_E2M1_MIDPOINTS_DOWN = (0.25, 1.25, 2.5, 5.0)

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SCALE_DTYPES = (torch.float8_e4m3fn, torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# helpers


def _check_float_weight(w: object, what: str, min_ndim: int) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{what}: expected a bfloat16, float16 or float32 tensor, got dtype {w.dtype}")
    if w.dim() < min_ndim:
        raise ValueError(f"{what}: expected at least {min_ndim} dimensions, got shape {tuple(w.shape)}")
    if w.numel() == 0:
        raise ValueError(f"{what}: cannot quantize an empty tensor (shape {tuple(w.shape)})")
    return w


def _abs_max(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """max |x| over ``dims`` without materialising |x| (ModelOpt's ``reduce_amax`` does the same)."""
    return torch.maximum(x.amax(dim=dims).abs(), x.amin(dim=dims).abs())


def _require_finite(amax: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"{what}: input contains NaN or infinite values (amax = {amax.tolist()})")


def _round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scales) to 4-bit E2M1 codes (uint8).

    Same result as ModelOpt ``NVFP4QTensor._cast_fp4``: magnitudes are rounded to the nearest of
    {0, .5, 1, 1.5, 2, 3, 4, 6} with ties to the even mantissa (0.25->0, 0.75->1, 1.25->1, 1.75->2,
    2.5->2, 3.5->4, 5->4), magnitudes above 6 saturate to 6, and bit 3 is set for every x < 0 (so a
    small negative value that rounds to zero gets code 8, "-0"). Does not modify ``x``.
    """
    mag = x.abs()
    # The magnitude code counts the decision points below |x|: strictly below where a tie rounds
    # down (lower neighbour even), at-or-below where it rounds up. Seven compares beat bucketize.
    code = (mag > _E2M1_MIDPOINTS_DOWN[0]).to(torch.uint8)
    for m in _E2M1_MIDPOINTS_DOWN[1:]:
        code += mag > m
    for m in _TIES_ROUND_UP:
        code += mag >= m
    code |= (x < 0).to(torch.uint8) << 3
    return code


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def _amax_override(
    amax: float | torch.Tensor, lead: torch.Size, device: torch.device, what: str
) -> torch.Tensor:
    """Turn a user-given amax into float32 on ``device`` with shape ``lead``."""
    if isinstance(amax, bool) or not isinstance(amax, (Real, torch.Tensor)):
        raise TypeError(f"{what}: amax must be a real number or a tensor, got {type(amax).__name__}")
    t = torch.as_tensor(amax, dtype=torch.float32).to(device)
    if t.numel() == 1:
        t = t.reshape(()).expand(lead).clone() if len(lead) else t.reshape(())
    elif tuple(t.shape) != tuple(lead):
        raise ValueError(
            f"{what}: amax must be a scalar or have shape {tuple(lead)} (one per matrix), "
            f"got shape {tuple(t.shape)}"
        )
    if not bool((torch.isfinite(t) & (t > 0)).all()):
        raise ValueError(f"{what}: amax must be finite and > 0, got {t.tolist()}")
    return t


# ----------------------------------------------------------------------------------------------
# E2M1 packing


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit E2M1 codes two per byte.

    Args:
        codes: uint8 ``[..., K]`` with values in 0..15 and K even.

    Returns:
        uint8 ``[..., K // 2]`` where byte ``i`` holds ``codes[..., 2i]`` in its LOW nibble and
        ``codes[..., 2i + 1]`` in its HIGH nibble (ModelOpt ``NVFP4QTensor.quantize``:
        ``(q[..., 1::2] << 4) | q[..., 0::2]``).

    Raises:
        TypeError: ``codes`` is not a tensor.
        ValueError: ``codes`` is not uint8, is 0-d, has an odd last dimension, or holds a
            value above 15.
    """
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"pack_e2m1: expected a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_e2m1: expected a uint8 tensor of 4-bit codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(
            f"pack_e2m1: the last dimension must be even (two codes per byte), got shape {tuple(codes.shape)}"
        )
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"pack_e2m1: codes must be in 0..15, found {int(codes.max())}")
    return _pack(codes)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`.

    Args:
        packed: uint8 ``[..., K // 2]``.

    Returns:
        uint8 ``[..., K]`` codes in 0..15: element ``2i`` from the LOW nibble of byte ``i``,
        element ``2i + 1`` from its HIGH nibble (ModelOpt ``NVFP4QTensor.dequantize``).

    Raises:
        TypeError: ``packed`` is not a tensor.
        ValueError: ``packed`` is not uint8 or is 0-d.
    """
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"unpack_e2m1: expected a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_e2m1: expected a packed uint8 tensor, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("unpack_e2m1: expected at least one dimension, got a 0-d tensor")
    return _unpack(packed)


# ----------------------------------------------------------------------------------------------
# NVFP4


def nvfp4_quantize(
    w: torch.Tensor, *, amax: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize weights to NVFP4 exactly as ModelOpt's HF export does.

    Args:
        w: bfloat16 / float16 / float32 ``[..., N, K]`` (rows = output features, K = input
            features), K a multiple of 16. A 2-D matrix gets one global scale; with leading
            dimensions (e.g. ``[E, N, K]`` for stacked experts) every ``[N, K]`` matrix gets its own.
        amax: optional override of the per-matrix absolute maximum used for the global scale:
            a positive finite number or tensor of shape ``w.shape[:-2]``. Default: ``max |w|`` per
            matrix, which is what ModelOpt's max calibration yields for weights. Pass the max over
            several tensors to make them share ``weight_scale_2`` as ModelOpt does for a fused
            group (an expert's gate_proj and up_proj, see ``moe_utils._export_fused_experts``).
            If it is below the true max, out-of-range values saturate (block scale 448, code +-6).

    Returns:
        ``(packed, block_scale, global_scale)``:

        * packed: uint8 ``[..., N, K // 2]``, codes packed by :func:`pack_e2m1`.
        * block_scale: float8_e4m3fn ``[..., N, K // 16]`` (checkpoint name ``weight_scale``).
        * global_scale: float32 with shape ``w.shape[:-2]``, i.e. 0-d for a 2-D ``w`` (checkpoint
          name ``weight_scale_2``): ``amax / (6 * 448)``; 1.0 where amax == 0.

        All on ``w``'s device. Dequantize with :func:`nvfp4_dequantize`.

    Math (ModelOpt 0.46 ``NVFP4QTensor``), all in float32:

    1. ``global_scale = amax / 2688`` (``get_weights_scaling_factor_2``; divisor a Python scalar).
    2. ``s = block_amax / (6 * global_scale)``; ``s[s == 0] = 1``; ``s = clamp(s, 2**-9, 448)``;
       ``block_scale = s.to(float8_e4m3fn)`` (round to nearest even) (``get_weights_scaling_factor``,
       ``_cast_per_block_scale_to_fp8``).
    3. ``x = w / (float32(block_scale) * global_scale)`` per block, rounded to E2M1 with ties to
       even and saturation at 6, sign in bit 3 for ``x < 0`` (``quantize``, ``_cast_fp4``).

    Raises:
        TypeError: ``w`` is not a tensor, or ``amax`` is not a number/tensor.
        ValueError: ``w``'s dtype is not bf16/fp16/fp32, it has fewer than 2 dimensions, is
            empty, has K not divisible by 16, or contains NaN/inf; ``amax`` has the wrong shape or
            is not finite and positive.
    """
    w = _check_float_weight(w, "nvfp4_quantize", 2)
    n, k = w.shape[-2], w.shape[-1]
    if k % NVFP4_BLOCK_SIZE:
        raise ValueError(
            f"nvfp4_quantize: the last dimension K={k} must be a multiple of the NVFP4 block size "
            f"{NVFP4_BLOCK_SIZE} (shape {tuple(w.shape)})"
        )
    lead = w.shape[:-2]

    # One amax per [N, K] matrix; 0-d for a 2-D input.
    tensor_amax = _abs_max(w, (-2, -1)).float()
    _require_finite(tensor_amax, "nvfp4_quantize")
    if amax is None:
        amax_t = tensor_amax
    else:
        amax_t = _amax_override(amax, lead, w.device, "nvfp4_quantize")

    # Step 1. The divisor stays a Python scalar, as in ModelOpt.
    global_scale = amax_t / (E2M1_MAX * E4M3_MAX)
    global_scale = torch.where(amax_t == 0, torch.ones_like(global_scale), global_scale)
    gs = global_scale.reshape(*lead, 1, 1)

    # Step 2. Per-block scales.
    blocks = w.reshape(*lead, n, k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    block_amax = _abs_max(blocks, (-1,)).float()
    scale = block_amax / (E2M1_MAX * gs)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    block_scale = scale.clamp_(min=_E4M3_MIN_SUBNORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)
    del scale, block_amax

    # Step 3. Scale (float32: the divisor is a float32 tensor), round to E2M1, pack.
    scaled = blocks / (block_scale.to(torch.float32) * gs).unsqueeze(-1)
    codes = _round_to_e2m1(scaled).reshape(*lead, n, k)
    del scaled
    packed = _pack(codes)
    return packed, block_scale, global_scale


def _as_global_scale(
    global_scale: float | torch.Tensor, lead: torch.Size, device: torch.device
) -> torch.Tensor:
    if isinstance(global_scale, bool) or not isinstance(global_scale, (Real, torch.Tensor)):
        raise TypeError(
            "nvfp4_dequantize: global_scale must be a Python float or a tensor, got "
            f"{type(global_scale).__name__}"
        )
    t = torch.as_tensor(global_scale).to(device=device, dtype=torch.float32)
    if t.numel() == 1:
        return t.reshape(())
    if tuple(t.shape) == tuple(lead):
        return t.reshape(*lead, 1, 1)
    raise ValueError(
        f"nvfp4_dequantize: global_scale must be a scalar (0-d or shape [1]) or have shape "
        f"{tuple(lead)} (one per matrix), got shape {tuple(t.shape)}"
    )


def nvfp4_dequantize(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: float | torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reconstruct NVFP4 weights: ``w = E2M1_VALUES[code] * (float32(block_scale) * global_scale)``.

    The product is formed in float32 in that order (block scale times global scale first, as in
    ModelOpt ``NVFP4QTensor.dequantize``) and cast to ``dtype`` at the end.

    Args:
        packed: uint8 ``[..., N, K // 2]`` (checkpoint ``weight``).
        block_scale: float8_e4m3fn ``[..., N, K // 16]`` (checkpoint ``weight_scale``); float32 /
            float16 / bfloat16 unquantized scales are accepted too.
        global_scale: checkpoint ``weight_scale_2``, a multiplier: Python float, 0-d tensor, shape
            ``[1]`` tensor, or (for leading dims) a tensor of shape ``packed.shape[:-2]``. Converted
            to float32 on ``packed``'s device. (compressed-tensors stores the reciprocal; invert it
            before calling.)
        dtype: floating output dtype.

    Returns:
        ``dtype`` tensor ``[..., N, K]`` on ``packed``'s device.

    Raises:
        TypeError: ``packed``/``block_scale`` are not tensors, or ``global_scale`` is not a number
            or tensor.
        ValueError: wrong dtypes, fewer than 2 dimensions, K not a multiple of 16, or inconsistent
            shapes (block_scale vs packed, global_scale vs the leading dims).
    """
    if not isinstance(packed, torch.Tensor) or not isinstance(block_scale, torch.Tensor):
        raise TypeError("nvfp4_dequantize: packed and block_scale must be torch.Tensors")
    if packed.dtype != torch.uint8:
        raise ValueError(f"nvfp4_dequantize: packed must be a uint8 tensor, got {packed.dtype}")
    if packed.dim() < 2:
        raise ValueError(f"nvfp4_dequantize: packed must be [..., N, K/2], got shape {tuple(packed.shape)}")
    if block_scale.dtype not in _SCALE_DTYPES:
        raise ValueError(
            "nvfp4_dequantize: block_scale must be a float8_e4m3fn (or float) tensor, got "
            f"{block_scale.dtype}"
        )
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"nvfp4_dequantize: dtype must be a floating dtype, got {dtype}")
    k = packed.shape[-1] * 2
    if k % NVFP4_BLOCK_SIZE:
        raise ValueError(
            f"nvfp4_dequantize: K = 2 * {packed.shape[-1]} = {k} is not a multiple of {NVFP4_BLOCK_SIZE}"
        )
    want = (*packed.shape[:-1], k // NVFP4_BLOCK_SIZE)
    if tuple(block_scale.shape) != want:
        raise ValueError(
            f"nvfp4_dequantize: block_scale shape {tuple(block_scale.shape)} does not match packed "
            f"shape {tuple(packed.shape)}; expected {want}"
        )
    lead = packed.shape[:-2]
    gs = _as_global_scale(global_scale, lead, packed.device)

    per_block = block_scale.to(device=packed.device, dtype=torch.float32) * gs
    values = E2M1_VALUES.to(packed.device)[_unpack(packed).long()]
    values = values.reshape(*want, NVFP4_BLOCK_SIZE) * per_block.unsqueeze(-1)
    return values.reshape(*packed.shape[:-1], k).to(dtype)


# ----------------------------------------------------------------------------------------------
# NVFP4, compressed-tensors (llm-compressor) flavour


def ct_nvfp4_quantize(
    w: torch.Tensor, *, amax: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize weights to NVFP4 the way compressed-tensors' ``nvfp4-pack-quantized`` compressor does.

    Same packing as :func:`nvfp4_quantize` (low nibble = even element; compressed-tensors
    ``pack_fp4_to_uint8``), but the global scale is stored as the RECIPROCAL multiplier and the rounding
    path differs slightly, so codes can differ from ModelOpt's in a small fraction of elements.

    Args:
        w: bfloat16 / float16 / float32 ``[..., N, K]``, K a multiple of 16.
        amax: optional per-matrix absolute maximum override (shape ``w.shape[:-2]`` or scalar), e.g. the
            max over q/k/v or gate/up, which llm-compressor gives one shared global scale.

    Returns:
        ``(packed, block_scale, global_scale)``: uint8 ``[..., N, K // 2]`` (``weight_packed``),
        float8_e4m3fn ``[..., N, K // 16]`` (``weight_scale``), float32 ``w.shape[:-2]``
        (``weight_global_scale``: ``2688 / amax``; dequantize with ``block_scale / global_scale``).

    Math (compressed-tensors ``generate_gparam``, ``calculate_qparams``, ``_quantize``,
    ``cast_to_fp4``), float32: ``gs = 448 * 6 / amax``; ``s = e4m3(gs * block_amax / 6)`` with a zero
    scale replaced by 0.125 (the E4M3 "eps"); ``x = w / (s / gs)`` clamped to [-6, 6], ROUNDED TO
    BFLOAT16, then to E2M1 with ties to even (the thresholds of :func:`nvfp4_quantize`). The bf16 step is
    what makes a code differ from ModelOpt's: values within bf16 rounding of an E2M1 decision point.
    Which intermediate dtype an llm-compressor observer uses for ``block_amax / 6`` varies by version;
    this uses float32 throughout.
    """
    w = _check_float_weight(w, "ct_nvfp4_quantize", 2)
    n, k = w.shape[-2], w.shape[-1]
    if k % NVFP4_BLOCK_SIZE:
        raise ValueError(f"ct_nvfp4_quantize: K={k} must be a multiple of {NVFP4_BLOCK_SIZE}")
    lead = w.shape[:-2]
    tensor_amax = _abs_max(w, (-2, -1)).float()
    _require_finite(tensor_amax, "ct_nvfp4_quantize")
    amax_t = tensor_amax if amax is None else _amax_override(amax, lead, w.device, "ct_nvfp4_quantize")
    global_scale = (E2M1_MAX * E4M3_MAX) / amax_t
    global_scale = torch.where(amax_t == 0, torch.ones_like(global_scale), global_scale)
    gs = global_scale.reshape(*lead, 1, 1)

    blocks = w.reshape(*lead, n, k // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)
    block_amax = _abs_max(blocks, (-1,)).float()
    scale = (gs * (block_amax / E2M1_MAX)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    scale = torch.where(scale == 0, torch.full_like(scale, 0.125), scale)
    block_scale = scale.to(torch.float8_e4m3fn)

    x = (blocks.float() / (scale / gs).unsqueeze(-1)).clamp_(-E2M1_MAX, E2M1_MAX)
    x = x.to(torch.bfloat16).float()
    codes = _round_to_e2m1(x).reshape(*lead, n, k)
    return _pack(codes), block_scale, global_scale


# ----------------------------------------------------------------------------------------------
# FP8 per-tensor


def fp8_quantize(
    w: torch.Tensor, *, amax: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 E4M3 weight quantization, as ModelOpt's HF export does for ``FP8`` layers.

    Args:
        w: bfloat16 / float16 / float32 tensor of any shape with at least one element (one scale
            for the whole tensor).
        amax: optional override of ``max |w|`` (positive, finite). Values beyond it saturate at
            +-448.

    Returns:
        ``(q, scale)``: ``q`` float8_e4m3fn, same shape and device as ``w`` (checkpoint ``weight``);
        ``scale`` float32 0-d on ``w``'s device (checkpoint ``weight_scale``), a multiplier:
        ``w ~= float32(q) * scale``.

    Math (ModelOpt ``unified_export_hf._export_quantized_weight`` and
    ``quant_utils.to_quantized_weight``): ``scale = amax / 448`` in float32 (``amax`` a 0-d float32
    tensor, as a max-calibrated per-tensor quantizer holds it), then
    ``q = (w / scale).clamp(-448, 448).to(float8_e4m3fn)``. ``scale`` is a 0-d tensor, so PyTorch
    evaluates ``w / scale`` in ``w``'s dtype (bf16 in, bf16 out, then the E4M3 cast), exactly as in
    ModelOpt (on CUDA that also rounds ``scale`` to bf16 inside the division: see the module
    docstring). The clamp (absent in ModelOpt) changes nothing for the default amax; it makes an
    ``amax`` override saturate instead of producing NaN (CUDA casts values >= 480 to NaN).
    amax == 0 gives ``scale = 1.0`` (ModelOpt: 0/0 = NaN weights).

    Raises:
        TypeError: ``w`` is not a tensor, or ``amax`` is not a number/tensor.
        ValueError: wrong dtype, empty tensor, NaN/inf in ``w``, or an ``amax`` override that is
            not a positive finite scalar.
    """
    w = _check_float_weight(w, "fp8_quantize", 0)
    tensor_amax = torch.maximum(w.max().abs(), w.min().abs()).float()
    _require_finite(tensor_amax, "fp8_quantize")
    if amax is None:
        amax_t = tensor_amax
    else:
        amax_t = _amax_override(amax, torch.Size(), w.device, "fp8_quantize")
    # 0-d float32 tensor on w's device divided by a Python scalar, as in ModelOpt.
    scale = amax_t / E4M3_MAX
    scale = torch.where(amax_t == 0, torch.ones_like(scale), scale)
    q = (w / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantize(
    q: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Reconstruct per-tensor FP8 weights: ``w = float32(q) * float32(scale)``, cast to ``dtype``.

    The product is taken in float32 and rounded once to ``dtype`` (ModelOpt's own
    ``FP8QTensor.dequantize`` multiplies in the target dtype, which for bf16 also rounds the scale;
    identical for ``dtype=float32``).

    Args:
        q: float8_e4m3fn tensor of any shape.
        scale: per-tensor multiplier (checkpoint ``weight_scale``): Python float, 0-d or shape
            ``[1]`` tensor.
        dtype: floating output dtype.

    Returns:
        ``dtype`` tensor of ``q``'s shape, on ``q``'s device.

    Raises:
        TypeError: ``q`` is not a tensor, or ``scale`` is not a number/tensor.
        ValueError: ``q`` is not float8_e4m3fn, ``scale`` has more than one element, or ``dtype``
            is not floating.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"fp8_dequantize: q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_dequantize: q must be a float8_e4m3fn tensor, got {q.dtype}")
    if isinstance(scale, bool) or not isinstance(scale, (Real, torch.Tensor)):
        raise TypeError(f"fp8_dequantize: scale must be a float or tensor, got {type(scale).__name__}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"fp8_dequantize: dtype must be a floating dtype, got {dtype}")
    s = torch.as_tensor(scale).to(device=q.device, dtype=torch.float32)
    if s.numel() != 1:
        raise ValueError(
            f"fp8_dequantize: expected a per-tensor scale (one element), got shape {tuple(s.shape)}"
        )
    return (q.to(torch.float32) * s.reshape(())).to(dtype)


# ----------------------------------------------------------------------------------------------
# activation scales


def input_scale_for(amax: float, kind: str = "fp8") -> torch.Tensor:
    """The activation ``input_scale`` a ModelOpt export writes for a given calibrated activation amax.

    Args:
        amax: absolute maximum of the layer's input activations (a positive finite number, or a
            one-element tensor). Synthetic checkpoints have no calibration: pass a plausible value.
        kind: ``"fp8"`` (FP8 per-tensor layers): ``amax / 448``
            (``quant_utils.get_scaling_factor``: ``amax / maxbound``); ``"nvfp4"`` (NVFP4 W4A4
            layers): ``amax / (6 * 448)`` (``NVFP4QTensor.get_activation_scaling_factor``:
            ``amax / (maxbound * 448)``, maxbound = 6). Computed in float32.

    Returns:
        float32 0-d CPU tensor (a multiplier: activation ~= q * input_scale).

    Raises:
        TypeError: ``amax`` is not a number or tensor.
        ValueError: ``kind`` is not "fp8"/"nvfp4", or ``amax`` is not a positive finite scalar
            (ModelOpt asserts the scale is positive).
    """
    divisors = {"fp8": E4M3_MAX, "nvfp4": E2M1_MAX * E4M3_MAX}
    if kind not in divisors:
        raise ValueError(f"input_scale_for: kind must be 'fp8' or 'nvfp4', got {kind!r}")
    if isinstance(amax, bool) or not isinstance(amax, (Real, torch.Tensor)):
        raise TypeError(f"input_scale_for: amax must be a number, got {type(amax).__name__}")
    a = torch.as_tensor(amax).detach().to(device="cpu", dtype=torch.float32)
    if a.numel() != 1:
        raise ValueError(f"input_scale_for: amax must be a scalar, got shape {tuple(a.shape)}")
    a = a.reshape(())
    if not (math.isfinite(float(a)) and float(a) > 0):
        raise ValueError(f"input_scale_for: amax must be finite and > 0, got {float(a)}")
    return a / divisors[kind]
