"""Speculative-decoding rollback of the GDN recurrent state, every GDN layer in one launch (GPU).

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

__all__ = ["gdn_commit_states"]

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
