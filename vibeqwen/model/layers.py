"""Building blocks shared by the decoder layers: linear layers over quantized weights, rotary embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vibeqwen.checkpoint.layout import Precision
from vibeqwen.checkpoint.quant import fp8_dequantize, nvfp4_dequantize


def dequantize_module(tensors: dict[str, torch.Tensor], path: str, precision: Precision, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight of module `path` from its checkpoint tensors, in `dtype`.

    NVFP4: e2m1(weight) * weight_scale * weight_scale_2; FP8: weight * weight_scale; BF16: weight.
    Raises KeyError naming the missing tensor.
    """
    w = tensors[f"{path}.weight"]
    if precision == Precision.NVFP4:
        return nvfp4_dequantize(w, tensors[f"{path}.weight_scale"], tensors[f"{path}.weight_scale_2"], dtype=dtype)
    if precision == Precision.FP8:
        return fp8_dequantize(w, tensors[f"{path}.weight_scale"], dtype=dtype)
    return w.to(dtype)


class Linear:
    """y = x W^T over a weight held dense (reference path: dequantized once at load).

    weight: [N, K]. The GPU path swaps this for kernels that read the packed NVFP4/FP8 weight directly.
    """

    def __init__(self, weight: torch.Tensor, precision: Precision = Precision.BF16):
        self.weight = weight
        self.precision = precision

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [T, rotary_dim] for integer positions [T] (rotate-half layout: frequencies repeated twice).

    inv_freq_i = theta^(-2i / rotary_dim). Text-only inputs give Qwen3.6's interleaved M-RoPE identical
    positions on all three axes, which reduces to this plain RoPE.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of x [T, H, D] (rotate-half); the rest pass through."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, xp], dim=-1)
