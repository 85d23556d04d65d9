"""Triton kernel behind :func:`vibeqwen_kernels.gdn.recurrent.gdn_recurrent` (private: call the wrapper).

Grid (B, Hv, Dv // BLOCK_V). A program owns the [Dk, BLOCK_V] slice of one value head's state S for one
sequence, keeps it in registers in fp32 (loaded from the slot's dtype, fp32 or bf16, and upcast), and walks the
sequence's tokens (a runtime loop bound read from query_start_loc). Per token, with q, k of key head hv // (Hv / Hk):

    g    = -exp(A_log) * softplus(a + dt_bias)        (softplus(x) = x for x > 20, as torch)
    beta = sigmoid(b)
    q    = q * rsqrt(|q|^2 + 1e-6) * scale;  k = k * rsqrt(|k|^2 + 1e-6)
    S    = exp(g) * S
    u    = beta * (v - S^T k)                          ([BLOCK_V]: a reduction over Dk)
    S    = S + k u^T
    o    = S^T q

(Yang et al., arXiv 2412.06464; HF ``torch_recurrent_gated_delta_rule``; kernels/gdn/naive.py.)
The state slice is loaded once (zeros for a new sequence) and stored once at the end (nothing is
stored for a sequence with no tokens); with STORE_ALL the state after every token also goes to
``inter[token, hv]``. Stores cast the fp32 state to the pointer's element type (fp32: none; bf16: round to
nearest even); the running state itself is never rounded within a launch.

NORM (the gated RMSNorm tail): y = gated_rms_norm(o, z, w, eps) per (token, value head), from the same launch.
The Dv // BLOCK_V programs of a (sequence, value head) each add 1 to its counter ``cnt[b * Hv + hv]`` (int32,
zero before the launch) once their o slices are stored; the one that reads Dv // BLOCK_V - 1 zeroes the counter
and norms the head's Dv outputs of every token from o (rounded, as the norm kernel reads them), with
``_norm_kernels.gated_norm_rows``: the norm kernel's rounding steps. (The last-block pattern of a split
reduction: one launch fewer per GDN layer, no program waits for another.)
"""

from __future__ import annotations

import triton
import triton.language as tl
from vibeqwen_kernels._norm_kernels import gated_norm_rows
from vibeqwen_kernels._pdl_kernels import pdl_wait


@triton.jit
def gdn_recurrent_kernel(
    q_ptr,
    stride_q_t,
    stride_q_h,
    k_ptr,
    stride_k_t,
    stride_k_h,
    v_ptr,
    stride_v_t,
    stride_v_h,
    a_ptr,
    stride_a_t,
    b_ptr,
    stride_b_t,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    stride_s_slot,
    stride_s_h,
    stride_s_k,
    slots_ptr,
    qsl_ptr,
    init_ptr,
    o_ptr,
    inter_ptr,
    z_ptr,
    stride_z_t,
    stride_z_h,
    nw_ptr,
    y_ptr,
    cnt_ptr,
    eps,
    scale,
    HV: tl.constexpr,
    GROUP: tl.constexpr,  # Hv // Hk: value heads per key head
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_V: tl.constexpr,
    STORE_ALL: tl.constexpr,
    NORM: tl.constexpr,  # the gated RMSNorm tail (module docstring)
    EARLY_STATE: tl.constexpr,  # load the state slice before the PDL wait (only with PDL 2: see below)
    PDL: tl.constexpr,
):
    if not (EARLY_STATE and PDL == 2):
        pdl_wait(PDL)
    ib = tl.program_id(0)
    ih = tl.program_id(1)
    iv = tl.program_id(2)
    start = tl.load(qsl_ptr + ib).to(tl.int64)
    end = tl.load(qsl_ptr + ib + 1).to(tl.int64)
    qlen = end - start
    slot = tl.load(slots_ptr + ib).to(tl.int64)
    # scalar conditions folded into integer bounds (Triton's interpreter mis-handles tensor & scalar-bool)
    nonempty = tl.minimum(qlen, 1).to(tl.int32)  # 0 for a padding sequence: nothing is read or written
    k_load = DK * nonempty * tl.load(init_ptr + ib).to(tl.int32)  # rows of the old state to load: DK or 0
    ihk = ih // GROUP

    ok = tl.arange(0, DK)
    ov = iv * BLOCK_V + tl.arange(0, BLOCK_V)
    s_ptrs = state_ptr + slot * stride_s_slot + ih * stride_s_h + ok[:, None] * stride_s_k + ov[None, :]
    s_mask = (ok[:, None] < k_load) & (ov[None, :] < DV)
    if EARLY_STATE and PDL == 2:
        # early launch (decode and verification graphs): the slice is requested before the wait, while the kernel
        # ahead (the input projection, a copy or the conv1d) still runs. Nothing that kernel writes is read here: the
        # slot was last written two or more launches back (this kernel in an earlier pass, or the commit / prefill
        # kernels before the replay) and the wait is transitive; the metadata above (qsl, slots, init) was written by
        # host copies before the replay, and every kernel of the replay reads the same values. The state is read
        # through L2 only (.cg): no L1 line of an earlier pass can serve it.
        h = tl.load(s_ptrs, mask=s_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        pdl_wait(PDL)
    else:
        h = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)

    neg_a = -tl.exp(tl.load(a_log_ptr + ih).to(tl.float32))
    dtb = tl.load(dt_bias_ptr + ih).to(tl.float32)
    q_base = q_ptr + ihk * stride_q_h + ok
    k_base = k_ptr + ihk * stride_k_h + ok
    v_base = v_ptr + ih * stride_v_h + ov
    for i in range(qlen):
        tok = start + i
        bq = tl.load(q_base + tok * stride_q_t).to(tl.float32)
        bk = tl.load(k_base + tok * stride_k_t).to(tl.float32)
        bv = tl.load(v_base + tok * stride_v_t).to(tl.float32)
        ba = tl.load(a_ptr + tok * stride_a_t + ih).to(tl.float32) + dtb
        bb = tl.load(b_ptr + tok * stride_b_t + ih).to(tl.float32)
        bq = bq * (scale / tl.sqrt(tl.sum(bq * bq, axis=0) + 1e-6))
        bk = bk * (1.0 / tl.sqrt(tl.sum(bk * bk, axis=0) + 1e-6))
        softplus = tl.where(ba > 20.0, ba, tl.log(1.0 + tl.exp(tl.minimum(ba, 20.0))))
        decay = tl.exp(neg_a * softplus)
        beta = 1.0 / (1.0 + tl.exp(-bb))
        h = h * decay
        kv = tl.sum(h * bk[:, None], axis=0)  # [BLOCK_V]
        u = beta * (bv - kv)
        h = h + bk[:, None] * u[None, :]
        o = tl.sum(h * bq[:, None], axis=0)
        o_off = (tok * HV + ih) * DV + ov
        tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty))
        if STORE_ALL:
            i_off = (tok * HV + ih) * (DK * DV) + ok[:, None] * DV + ov[None, :]
            tl.store(inter_ptr + i_off, h.to(inter_ptr.dtype.element_ty))
    tl.store(
        s_ptrs, h.to(state_ptr.dtype.element_ty), mask=(ok[:, None] < DK * nonempty) & (ov[None, :] < DV)
    )
    if NORM:
        # every program stores its o slices before it counts itself in; the barrier orders the other threads'
        # stores before the counting thread's release (cumulative at GPU scope), the last program's acquire
        # orders them before its reads (through L2: .cg)
        tl.debug_barrier()
        c_ptr = cnt_ptr + ib * HV + ih
        seen = tl.atomic_add(c_ptr, 1, sem="acq_rel", scope="gpu")
        if seen == DV // BLOCK_V - 1:
            tl.atomic_xchg(c_ptr, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
            od = tl.arange(0, DV)
            nw = tl.load(nw_ptr + od)
            for i in range(qlen):
                tok = start + i
                row = (tok * HV + ih) * DV + od
                x = tl.load(o_ptr + row[None, :], cache_modifier=".cg")
                zg = tl.load(z_ptr + tok * stride_z_t + ih * stride_z_h + od[None, :])
                tl.store(y_ptr + row[None, :], gated_norm_rows(x, zg, nw, eps, DV))
