"""RMSNorm variants of Qwen3.6, reference implementations (the GPU issue adds fused kernels beside them)."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + w), computed in float32.

    x: [..., D] any float dtype; weight: [D]. Returns x's dtype. Source: Qwen3.5/3.6 `RMSNorm`
    (HF `Qwen3_5MoeRMSNorm`), the normalised value is scaled by (1 + w) before the cast back.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of the GDN output: y = w * norm(x) * silu(gate), plain (not zero-centred) weight.

    x, gate: [..., D]; weight: [D]. Norm in float32, weight applied in x's dtype, gate in float32, as the
    HF oracle (`Qwen3_5MoeRMSNormGated`) does. Returns x's dtype.
    """
    dtype = x.dtype
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = weight.to(dtype) * y
    return (y.float() * torch.nn.functional.silu(gate.float())).to(dtype)
