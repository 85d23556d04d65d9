"""Speculative-decoding rollback of the GDN states, every GDN layer in one launch each (GPU): the recurrent state
(:func:`gdn_commit_states`) and the conv window (:func:`gdn_commit_conv`).

After a verification pass kept the recurrent state after every token (``gdn_recurrent(...,
intermediate_states=...)``), each sequence's state slot must end at its last accepted token. With the
per-token states of all layers in one stacked buffer, that is one gather-copy for the whole batch and all
layers: ``ssm[l, slots[s]] = states[l, rows[s]]``. A per-layer ``index_copy_`` would cost ~2 launches (and
~20 us of Python) per layer and a temporary of 2 MiB per sequence; this kernel copies in place.

CUDA-graph capturable (grid depends only on shapes); runs under ``TRITON_INTERPRET=1`` on the CPU.
"""

from __future__ import annotations

import os

import torch
from vibeqwen_kernels.pdl import pdl_launch

__all__ = ["gdn_commit_conv", "gdn_commit_states"]

_BLOCK = 2048


def gdn_commit_states(ssm: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``ssm[l, slots[s]] = states[l, rows[s]]`` for every layer l and sequence s, in place.

    Args:
        ssm: ``[L, num_slots, *state]`` (the cache's stacked recurrent states), contiguous; float32 or
            bfloat16 (EngineConfig.gdn_state_dtype): the kernel copies elements as stored, any dtype.
        states: ``[L, N, *state]`` in ssm's dtype (per-token states of a verification pass), contiguous.
        slots: int ``[S]`` destination slots, distinct, in ``[0, num_slots)``.
        rows: int ``[S]`` source rows in ``[0, N)``.

    Raises:
        ValueError: shape/dtype/device mismatches, CPU tensors outside the Triton interpreter.
    """
    if ssm.dim() < 3 or states.dim() != ssm.dim() or states.shape[0] != ssm.shape[0] \
            or states.shape[2:] != ssm.shape[2:]:
        raise ValueError(f"gdn_commit_states: ssm {tuple(ssm.shape)} and states {tuple(states.shape)} must be "
                         "[L, slots, *state] and [L, N, *state]")
    if ssm.dtype != states.dtype or not ssm.is_contiguous() or not states.is_contiguous():
        raise ValueError("gdn_commit_states: ssm and states must be contiguous tensors of one dtype")
    if slots.shape != rows.shape or slots.dim() != 1:
        raise ValueError(f"gdn_commit_states: slots {tuple(slots.shape)} and rows {tuple(rows.shape)} must be [S]")
    if len({ssm.device, states.device, slots.device, rows.device}) != 1:
        raise ValueError("gdn_commit_states: all tensors must be on one device")
    if ssm.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("gdn_commit_states: needs CUDA tensors (or TRITON_INTERPRET=1)")
    n_layers, n_seqs = ssm.shape[0], slots.shape[0]
    if n_layers == 0 or n_seqs == 0:
        return
    size = ssm[0, 0].numel()
    from vibeqwen_kernels.gdn._commit_kernels import _gdn_commit_kernel

    block = min(_BLOCK, 1 << max(0, (size - 1)).bit_length())
    _gdn_commit_kernel[(n_layers * n_seqs, -(-size // block))](
        ssm, states, slots, rows, n_seqs, size, ssm.stride(0), ssm.stride(1), states.stride(0), states.stride(1),
        BLOCK=block, num_warps=4,
        **pdl_launch(ssm.device),
    )


_BLOCK_C = 1024


def gdn_commit_conv(conv: torch.Tensor, inputs: torch.Tensor, conv0: torch.Tensor, idx: torch.Tensor) -> None:
    """The conv half of the rollback, every layer in one launch: for each sequence s, ``conv[l, slot_s]`` (``[C,
    W-1]``) = the conv state after its first ``kept_s`` tokens of the pass, i.e. the W-1 conv inputs ending at
    token ``kept_s - 1``: ``inputs[l, start_s + kept_s - (W-1) + j]`` for window position j, or, for positions
    before the pass, ``conv0[l, row_s, :, kept_s + j]`` (the conv state before it). In place.

    Args:
        conv: ``[L, num_slots, C, W-1]`` (the cache's stacked conv states), contiguous in its last two dims.
        inputs: ``[L, N, C]`` conv inputs of every token of the pass, contiguous in its last dim.
        conv0: ``[L, R, C, W-1]`` each sequence's conv state before the pass, contiguous in its last two dims.
        idx: int64 ``[4, S]``: kept (1 <= kept_s <= the sequence's tokens), start (its first token's row in
            ``inputs``), row (its row in ``conv0``), slot (distinct, in ``[0, num_slots)``), on the same device.
            Its values are not checked (that would need a device sync): out-of-range ones read or write out of
            bounds.

    Raises:
        ValueError: shape/dtype/device mismatches, CPU tensors outside the Triton interpreter.
    """
    if conv.dim() != 4 or inputs.dim() != 3 or conv0.dim() != 4 or inputs.shape[0] != conv.shape[0] \
            or conv0.shape[0] != conv.shape[0] or inputs.shape[2] != conv.shape[2] \
            or conv0.shape[2:] != conv.shape[2:]:
        raise ValueError(f"gdn_commit_conv: conv {tuple(conv.shape)}, inputs {tuple(inputs.shape)} and conv0 "
                         f"{tuple(conv0.shape)} must be [L, slots, C, W-1], [L, N, C] and [L, R, C, W-1]")
    w1, c = conv.shape[3], conv.shape[2]

    def rows_contiguous(x: torch.Tensor) -> bool:  # [..., C, W-1] with element (c, j) at c * (W-1) + j
        return (w1 == 1 or x.stride(3) == 1) and (c == 1 or x.stride(2) == w1)

    if not (rows_contiguous(conv) and rows_contiguous(conv0)) or (c > 1 and inputs.stride(2) != 1):
        raise ValueError("gdn_commit_conv: conv and conv0 must be contiguous in [C, W-1], inputs in C")
    if not conv.dtype == inputs.dtype == conv0.dtype:
        raise ValueError(f"gdn_commit_conv: conv, inputs and conv0 must have one dtype, got {conv.dtype}, "
                         f"{inputs.dtype} and {conv0.dtype}")
    if idx.dim() != 2 or idx.shape[0] != 4 or idx.dtype != torch.int64:
        raise ValueError(f"gdn_commit_conv: idx must be int64 [4, S] (kept, start, row, slot), got {idx.dtype} "
                         f"{tuple(idx.shape)}")
    if len({conv.device, inputs.device, conv0.device, idx.device}) != 1:
        raise ValueError("gdn_commit_conv: all tensors must be on one device")
    if conv.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("gdn_commit_conv: needs CUDA tensors (or TRITON_INTERPRET=1)")
    n_layers, n_seqs = conv.shape[0], idx.shape[1]
    if n_layers == 0 or n_seqs == 0 or c == 0 or w1 == 0:
        return
    from vibeqwen_kernels.gdn._commit_kernels import _gdn_commit_conv_kernel

    idx = idx.contiguous()
    block = min(_BLOCK_C, 1 << max(0, (c - 1)).bit_length())
    _gdn_commit_conv_kernel[(n_layers * n_seqs, -(-c // block))](
        conv, inputs, conv0, idx, n_seqs, c, conv.stride(0), conv.stride(1), inputs.stride(0), inputs.stride(1),
        conv0.stride(0), conv0.stride(1), W1=w1, BLOCK_C=block, num_warps=4,
        **pdl_launch(conv.device),
    )
