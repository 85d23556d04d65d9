"""Triton kernel behind :func:`vibeqwen_kernels.gdn.commit.gdn_commit_states` (private)."""

from __future__ import annotations

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait


@triton.jit
def _gdn_commit_kernel(
    p_ssm,
    p_states,
    p_slots,
    p_rows,
    n_seqs,
    size,
    stride_sl,
    stride_ss,
    stride_tl,
    stride_tn,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (l * n_seqs + s, chunk c): elements [c * BLOCK, +BLOCK) of ssm[l, slots[s]] = states[l, rows[s]]."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    layer = (pid // n_seqs).to(tl.int64)
    seq = pid % n_seqs
    slot = tl.load(p_slots + seq).to(tl.int64)
    row = tl.load(p_rows + seq).to(tl.int64)
    o = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = o < size
    v = tl.load(p_states + layer * stride_tl + row * stride_tn + o, mask=mask)
    tl.store(p_ssm + layer * stride_sl + slot * stride_ss + o, v, mask=mask)
