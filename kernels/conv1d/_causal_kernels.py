"""Triton kernels behind :func:`vibeqwen_kernels.conv1d.causal.causal_conv1d` (private: call the wrapper).

Two launches, in this order on one stream (one when every sequence fits one token block, i.e. decode and
speculative verification: the conv kernel then shifts the state itself, ``FUSE_STATE``):

* ``causal_conv1d_fwd_kernel``: grid (cdiv(max_query_len, BLOCK_T), B, cdiv(C, BLOCK_C)). A program
  computes y for BLOCK_T tokens x BLOCK_C channels of one sequence (token blocks past the sequence's end
  return at once). Tap j of token t reads input
  position t - (W-1) + j of the sequence; a negative position reads column (W-1) + position of the
  sequence's old conv state (or 0 for a new sequence). fp32 accumulation, SiLU, store in y's dtype.
* ``causal_conv1d_state_kernel``: grid (B, cdiv(C, BLOCK_C)). Writes the last W-1 inputs of each
  sequence back to its state slot: new column i is position q_len - (W-1) + i of [old state | x], i.e.
  x[q_len - (W-1) + i] when that is >= 0, else old column q_len + i. It runs after the first kernel
  (stream order), so the conv never reads a half-updated state; inside the program every load is
  issued before a CTA barrier and every store after it, so the in-place shift is race-free.

Sequences with q_len 0 write nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait


@triton.jit
def causal_conv1d_fwd_kernel(
    x_ptr,
    stride_x_t,
    w_ptr,
    stride_w_c,
    stride_w_j,
    state_ptr,
    stride_s_slot,
    stride_s_c,
    stride_s_j,
    slots_ptr,
    qsl_ptr,
    init_ptr,
    y_ptr,
    stride_y_t,
    C,
    W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FUSE_STATE: tl.constexpr,  # one token block per sequence: this program also writes its channels' new state
    BLOCK_J: tl.constexpr,  # next power of two >= W - 1 (FUSE_STATE)
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    it = tl.program_id(0)  # token blocks on axis 0 (no 65535 limit: long prefills)
    ib = tl.program_id(1)
    ic = tl.program_id(2)
    start = tl.load(qsl_ptr + ib).to(tl.int64)
    end = tl.load(qsl_ptr + ib + 1).to(tl.int64)
    qlen = end - start
    if it * BLOCK_T >= qlen:
        # the grid covers the longest sequence: shorter ones' (a prefill graph's empty padding row's) programs
        # stop here (masked through, they cost as much as real ones: 19 -> 34 us for a 1k prefill's two rows)
        return
    slot = tl.load(slots_ptr + ib).to(tl.int64)
    # scalar conditions are folded into integer bounds (Triton's interpreter mis-handles tensor & scalar-bool)
    n_old = tl.load(init_ptr + ib).to(tl.int32) * (W - 1)  # usable old-state columns: W-1, or 0 if new

    t = it * BLOCK_T + tl.arange(0, BLOCK_T)  # token index within the sequence
    c = ic * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask = t < qlen
    c_mask = c < C
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    # only the first W-1 tokens of a sequence read its old state: the other token blocks skip those loads and
    # their address arithmetic (a 1k prefill's conv took ~8x its bytes with them); the same sums either way
    if it * BLOCK_T < W - 1:
        for j in tl.static_range(W):
            pos = t - (W - 1) + j  # input position within the sequence; < 0 is the old state
            x_off = (start + pos).to(tl.int64)[:, None] * stride_x_t + c[None, :]
            xv = tl.load(x_ptr + x_off, mask=(t_mask & (pos >= 0))[:, None] & c_mask[None, :], other=0.0)
            s_col = (W - 1) + pos
            s_off = slot * stride_s_slot + c[None, :].to(tl.int64) * stride_s_c + s_col[:, None] * stride_s_j
            s_mask = (t_mask & (pos < 0) & (pos >= -n_old))[:, None] & c_mask[None, :]
            sv = tl.load(state_ptr + s_off, mask=s_mask, other=0.0)
            wj = tl.load(w_ptr + c.to(tl.int64) * stride_w_c + j * stride_w_j, mask=c_mask, other=0.0)
            acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wj.to(tl.float32)[None, :]
    else:
        for j in tl.static_range(W):
            pos = t - (W - 1) + j  # >= 0 here
            x_off = (start + pos).to(tl.int64)[:, None] * stride_x_t + c[None, :]
            xv = tl.load(x_ptr + x_off, mask=t_mask[:, None] & c_mask[None, :], other=0.0)
            wj = tl.load(w_ptr + c.to(tl.int64) * stride_w_c + j * stride_w_j, mask=c_mask, other=0.0)
            acc += xv.to(tl.float32) * wj.to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc))  # SiLU
    y_off = (start + t).to(tl.int64)[:, None] * stride_y_t + c[None, :]
    tl.store(y_ptr + y_off, out.to(y_ptr.dtype.element_ty), mask=t_mask[:, None] & c_mask[None, :])
    if FUSE_STATE:
        # causal_conv1d_state_kernel's shift for this program's channels (it owns them: the only token block of its
        # sequence); qlen >= 1 here. Every load of the old state (the conv's above, the window's here) comes before
        # the CTA barrier, every store after it.
        j = tl.arange(0, BLOCK_J)
        live = c_mask[:, None] & (j < W - 1)[None, :]
        spos = qlen - (W - 1) + j  # position in [old state | x]; < 0: old state column qlen + j
        in_x = spos >= 0
        xs = tl.load(x_ptr + (start + spos)[None, :] * stride_x_t + c[:, None].to(tl.int64),
                     mask=live & in_x[None, :], other=0.0)
        base = state_ptr + slot * stride_s_slot + c[:, None].to(tl.int64) * stride_s_c
        ss = tl.load(base + (qlen + j)[None, :] * stride_s_j,
                     mask=live & ((spos < 0) & (spos >= -n_old))[None, :], other=0.0)
        new = tl.where(in_x[None, :], xs.to(tl.float32), ss.to(tl.float32))
        tl.debug_barrier()
        tl.store(base + j[None, :] * stride_s_j, new.to(state_ptr.dtype.element_ty), mask=live)


@triton.jit
def causal_conv1d_state_kernel(
    x_ptr,
    stride_x_t,
    state_ptr,
    stride_s_slot,
    stride_s_c,
    stride_s_j,
    slots_ptr,
    qsl_ptr,
    init_ptr,
    C,
    W: tl.constexpr,
    BLOCK_J: tl.constexpr,  # next power of two >= W - 1
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    ib = tl.program_id(0)
    ic = tl.program_id(1)
    start = tl.load(qsl_ptr + ib).to(tl.int64)
    end = tl.load(qsl_ptr + ib + 1).to(tl.int64)
    qlen = end - start
    slot = tl.load(slots_ptr + ib).to(tl.int64)
    n_old = tl.load(init_ptr + ib).to(tl.int32) * (W - 1)  # usable old-state columns: W-1, or 0 if new
    n_new = tl.minimum(qlen, 1) * (W - 1)  # columns to write: W-1, or 0 for an empty sequence

    c = ic * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_J)
    c_mask = c < C
    live = c_mask[:, None] & (j < n_new)[None, :]
    pos = qlen - (W - 1) + j  # [BLOCK_J] position in [old state | x]; < 0: old state column qlen + j
    in_x = pos >= 0
    x_off = (start + pos)[None, :] * stride_x_t + c[:, None].to(tl.int64)
    xv = tl.load(x_ptr + x_off, mask=live & in_x[None, :], other=0.0)
    base = state_ptr + slot * stride_s_slot + c[:, None].to(tl.int64) * stride_s_c
    old_col = qlen + j
    sv = tl.load(
        base + old_col[None, :] * stride_s_j, mask=live & ((pos < 0) & (pos >= -n_old))[None, :], other=0.0
    )
    new = tl.where(in_x[None, :], xv.to(tl.float32), sv.to(tl.float32))
    tl.debug_barrier()  # every thread's loads of the old state happen before any thread overwrites it
    tl.store(base + j[None, :] * stride_s_j, new.to(state_ptr.dtype.element_ty), mask=live)
