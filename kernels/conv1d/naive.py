"""Causal depthwise conv1d with SiLU and a rolling state, reference implementation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time followed by SiLU, for one sequence.

    x: [T, C] (T >= 1); weight: [C, W]; conv_state: [C, W-1], the last W-1 inputs before x (zeros for a
    new sequence; None means zeros). Returns (y [T, C] in x's dtype, new_state [C, W-1] in conv_state's
    dtype, or x's dtype when conv_state is None): y_t = silu(sum_j w[:, j] * x_{t-(W-1)+j}).
    Raises ValueError on mismatched channel counts.
    """
    t, c = x.shape
    width = weight.shape[-1]
    if weight.shape[0] != c:
        raise ValueError(f"conv weight has {weight.shape[0]} channels, input has {c}")
    state_dtype = conv_state.dtype if conv_state is not None else x.dtype
    if conv_state is None:
        conv_state = x.new_zeros(c, width - 1)
    # [C, W-1+T]: the state followed by the new inputs
    full = torch.cat([conv_state.to(weight.dtype), x.t().to(weight.dtype)], dim=1)
    # sliding windows [C, T, W] dotted with the per-channel taps
    y = (full.unfold(1, width, 1) * weight[:, None, :]).sum(-1)  # [C, T]
    y = F.silu(y).t().to(x.dtype)
    return y, full[:, -(width - 1):].to(state_dtype)
