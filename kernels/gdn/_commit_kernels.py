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


@triton.jit
def _gdn_commit_conv_kernel(
    p_conv,
    p_inputs,
    p_conv0,
    p_idx,
    n_seqs,
    C,
    stride_cl,
    stride_cs,
    stride_il,
    stride_it,
    stride_0l,
    stride_0r,
    W1: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (l * n_seqs + s, channel block c): conv[l, slot_s, c, j] for j < W1 = the window of W1 conv inputs
    ending at sequence s's last kept token: input (kept_s - W1 + j) of its pass, inputs[l, start_s + that], or,
    before the pass's first token, conv0[l, row_s, c, kept_s + j] (its conv state before the pass). p_idx: int64
    [4, n_seqs] rows kept, start, row, slot."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    layer = (pid // n_seqs).to(tl.int64)
    seq = pid % n_seqs
    kept = tl.load(p_idx + seq)
    start = tl.load(p_idx + n_seqs + seq)
    row = tl.load(p_idx + 2 * n_seqs + seq)
    slot = tl.load(p_idx + 3 * n_seqs + seq)
    oc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = oc < C
    for j in tl.static_range(W1):
        pos = kept - W1 + j  # the window's j-th input, as an index into the pass's tokens
        # the scalar condition folded into integer bounds (Triton's interpreter mis-handles tensor & scalar-bool)
        in_pass = tl.minimum(tl.maximum(pos + 1, 0), 1)  # 1 if pos >= 0 else 0
        from_pass = oc < C * in_pass
        from_before = oc < C * (1 - in_pass)
        src_t = start + tl.maximum(pos, 0)
        src_0 = tl.minimum(pos + W1, W1 - 1)
        v_in = tl.load(p_inputs + layer * stride_il + src_t * stride_it + oc, mask=from_pass, other=0.0)
        v_0 = tl.load(p_conv0 + layer * stride_0l + row * stride_0r + oc * W1 + src_0, mask=from_before, other=0.0)
        v = tl.where(from_pass, v_in.to(p_conv.dtype.element_ty), v_0.to(p_conv.dtype.element_ty))
        tl.store(p_conv + layer * stride_cl + slot * stride_cs + oc * W1 + j, v, mask=mask)
