"""NVFP4 weight-only linear layer, reference implementation (the specification for `linear.py`)."""

from __future__ import annotations

import torch

from vibeqwen.checkpoint.quant import nvfp4_dequantize

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def nvfp4_linear_ref(
    x: torch.Tensor,
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: float | torch.Tensor,
) -> torch.Tensor:
    """``y = x @ w^T`` with ``w`` dequantized from NVFP4, all in float32.

    Args:
        x: bf16 / fp16 / fp32 ``[M, K]``.
        packed: uint8 ``[N, K // 2]``, two E2M1 codes per byte (low nibble = even k).
        block_scale: float8_e4m3fn ``[N, K // 16]``.
        global_scale: the checkpoint's ``weight_scale_2`` (a multiplier): float or one-element tensor.

    Returns:
        float32 ``[M, N]`` on ``x``'s device.

    Raises:
        ValueError: ``x`` is not a 2-D float tensor, or its K does not match ``packed``; the weight
            checks of :func:`vibeqwen.checkpoint.quant.nvfp4_dequantize` apply to the rest.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(
            "nvfp4_linear_ref: x must be a 2-D bf16/fp16/fp32 tensor [M, K], got "
            f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}"
        )
    if packed.dim() != 2 or x.shape[1] != 2 * packed.shape[1]:
        raise ValueError(
            f"nvfp4_linear_ref: x is [M, K] = {tuple(x.shape)} but packed is {tuple(packed.shape)} "
            "(expected [N, K / 2])"
        )
    w = nvfp4_dequantize(packed, block_scale, global_scale, dtype=torch.float32).to(x.device)  # [N, K]
    return x.float() @ w.T
