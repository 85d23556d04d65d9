"""Causal depthwise conv1d + SiLU over a flattened varlen batch, with per-sequence state slots (GPU).

The reference is :func:`vibeqwen_kernels.conv1d.naive.causal_conv1d_ref` (one sequence); the Triton
kernels live in ``_causal_kernels.py`` and are imported on first use, so this module imports on machines
without Triton. Everything here is CUDA-graph capturable: no host/device sync, grids depend only on
shapes and the caller's ``max_query_len``.
"""

from __future__ import annotations

import os

import torch
from vibeqwen_kernels.pdl import pdl_launch

__all__ = ["causal_conv1d"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _kernels():
    from vibeqwen_kernels.conv1d import _causal_kernels

    return _causal_kernels


def _check_device(name: str, x: torch.Tensor) -> None:
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"{name}: needs CUDA tensors (got {x.device}); use the *_ref functions on the CPU "
            "or set TRITON_INTERPRET=1"
        )


def _block_t(max_query_len: int) -> int:
    # decode (q_len 1) wastes little with 2 rows; prefill uses 8-token tiles x 128 channels, 4 warps (the 4 taps
    # hit L1): the best of 8-64 tokens x 64-256 channels x 2-8 warps on the H200 for a strided [T, 8192] bf16
    # input, 24 / 141 us at T = 1k / 8k against 32 / 203 us with 16-token tiles
    return max(2, min(8, 1 << max(0, (max_query_len - 1)).bit_length()))


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    max_query_len: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d (width W) + SiLU for every sequence of a flattened batch; updates the slots.

    For sequence b (tokens ``query_start_loc[b] : query_start_loc[b+1]``, state slot ``slots[b]``) this
    equals ``causal_conv1d_ref(x[tokens], weight, state0)`` with ``state0 = conv_states[slots[b]]`` when
    ``has_initial_state[b]`` else zeros (whatever the slot holds):
    ``y_t = silu(sum_j weight[:, j] * x_{t-(W-1)+j})``, inputs before the sequence coming from the
    state. Afterwards ``conv_states[slots[b]]`` holds the sequence's last W-1 inputs (old state's tail
    included when q_len < W-1). Sequences with q_len 0 are no-ops (their slot is not touched).

    Args:
        x: ``[T, C]`` bf16/fp16/fp32; rows may be strided (``x.stride(1)`` must be 1), e.g. a column
            slice of a larger projection output.
        weight: ``[C, W]`` (any float dtype, any strides), the conv taps (checkpoint ``conv1d.weight``
            squeezed), applied in fp32.
        conv_states: ``[num_slots, C, W-1]`` (activation dtype), read and updated in place.
        slots: ``[B]`` int32/int64 slot of each sequence (distinct for sequences with tokens).
        query_start_loc: ``[B+1]`` int32 (or int64), non-decreasing token offsets.
        has_initial_state: ``[B]`` bool; False starts the sequence from a zero state.
        max_query_len: Python int >= every q_len of the batch (sizes the grid; tokens beyond it are
            not computed). 0 launches nothing.
        out: optional ``[T, C]`` output (last dim contiguous); by default a new tensor of x's dtype.

    Returns:
        ``y`` ``[T, C]`` in x's dtype (or ``out``). Rows not covered by any sequence are left unwritten.

    Raises:
        ValueError: bad ranks/shapes/dtypes, or CPU tensors outside Triton's interpreter.

    Work: fp32 accumulation of the W products (the reference accumulates in weight's dtype), one
    rounding to x's dtype. Two launches (conv, then the state shift) on the current stream; one when
    max_query_len fits one token block (<= 8: decode, speculative verification), the conv kernel shifting the state.
    """
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(
            f"causal_conv1d: x must be a 2-D bf16/fp16/fp32 [T, C] tensor, got {x.dtype} {tuple(x.shape)}"
        )
    t, c = x.shape
    if weight.dim() != 2 or weight.shape[0] != c:
        raise ValueError(f"causal_conv1d: weight must be [C={c}, W], got {tuple(weight.shape)}")
    width = weight.shape[1]
    if width < 2:
        raise ValueError(f"causal_conv1d: conv width must be >= 2, got {width}")
    if conv_states.dim() != 3 or conv_states.shape[1:] != (c, width - 1):
        raise ValueError(
            f"causal_conv1d: conv_states must be [num_slots, {c}, {width - 1}], got {tuple(conv_states.shape)}"
        )
    nb = slots.shape[0]
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError("causal_conv1d: slots must be a 1-D int32/int64 tensor")
    if query_start_loc.shape != (nb + 1,) or query_start_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"causal_conv1d: query_start_loc must be int32 [B+1={nb + 1}]")
    if has_initial_state.shape != (nb,) or has_initial_state.dtype != torch.bool:
        raise ValueError(f"causal_conv1d: has_initial_state must be bool [B={nb}]")
    _check_device("causal_conv1d", x)
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    elif out.shape != (t, c) or (t > 0 and c > 1 and out.stride(1) != 1):
        raise ValueError(f"causal_conv1d: out must be [{t}, {c}] with a contiguous last dim")
    if nb == 0 or t == 0 or max_query_len <= 0 or c == 0:
        return out
    kern = _kernels()
    block_t = _block_t(max_query_len)
    block_c = 256 if block_t <= 2 else 128
    fuse = _cdiv(max_query_len, block_t) == 1  # one token block per sequence: the conv kernel shifts the state
    block_j = max(2, 1 << (width - 2).bit_length())
    kern.causal_conv1d_fwd_kernel[(_cdiv(max_query_len, block_t), nb, _cdiv(c, block_c))](
        x,
        x.stride(0),
        weight,
        weight.stride(0),
        weight.stride(1),
        conv_states,
        conv_states.stride(0),
        conv_states.stride(1),
        conv_states.stride(2),
        slots,
        query_start_loc,
        has_initial_state.view(torch.uint8),  # bool as bytes (the interpreter mis-loads i1)
        out,
        out.stride(0),
        c,
        W=width,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        FUSE_STATE=fuse,
        BLOCK_J=block_j,
        num_warps=4,
        **pdl_launch(x.device),
    )
    if fuse:
        return out
    block_cs = 256
    kern.causal_conv1d_state_kernel[(nb, _cdiv(c, block_cs))](
        x,
        x.stride(0),
        conv_states,
        conv_states.stride(0),
        conv_states.stride(1),
        conv_states.stride(2),
        slots,
        query_start_loc,
        has_initial_state.view(torch.uint8),  # bool as bytes (the interpreter mis-loads i1)
        c,
        W=width,
        BLOCK_J=block_j,
        BLOCK_C=block_cs,
        num_warps=4,
        **pdl_launch(x.device),
    )
    return out


def _cdiv(a: int, b: int) -> int:
    """Ceil division of Python ints (kept here so the module imports without Triton)."""
    return -(-a // b)
