"""Triton kernels behind :mod:`vibeqwen_kernels.fp8.linear` (imported on first use).

* ``_fp8_mm_kernel``: tensor-core kernel. One program computes a ``[BLOCK_M, BLOCK_N]`` output tile
  over one K range; the weight tile (float8_e4m3fn) is widened exactly to the activation dtype in
  registers. ``W_AS_A=True`` (decode, BLOCK_M = 16..64, split over N and K): the weight is the MMA's
  wide A operand and ``x^T`` the B operand (computes ``out^T``); ``W_AS_A=False`` (prefill, 128 x 128
  tiles, grouped program order for L2 reuse): the textbook ``x @ w^T`` orientation.
* ``_fp8_gemv_kernel``: CUDA-core kernel for M <= 4 (split over N and K), weight widened to fp32.
* ``_fp8_splitk_reduce_kernel``: sums the fp32 split-K partials in fixed order (deterministic),
  applies the per-row scale, casts to the output dtype.

Split-K launches (SPLIT_K > 1) write unscaled fp32 partials to ``ws[SPLIT_K, M, N]``; SPLIT_K == 1
launches scale and store the output directly. The per-output-row scale is read at ``s_ptr + n *
stride_s`` (``stride_s = 0`` for one per-tensor scale).
"""

from __future__ import annotations

import triton
import triton.language as tl
from vibeqwen_kernels._pdl_kernels import pdl_wait


@triton.jit
def _fp8_mm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_s,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    W_AS_A: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M m-blocks in a row share each weight tile while it sits in L2
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_size
    pid_n = (pid % num_in_group) // group_size

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # out-of-range rows load a valid row (never stored): no masks on the N / M edges
    offs_nl = (offs_n % N).to(tl.int64)
    offs_ml = (offs_m % M).to(tl.int64)
    k_start = pid_k * K_PER_SPLIT
    cdt = x_ptr.dtype.element_ty

    if W_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T tile
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # out tile
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        offs_k = k_start + kk + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + offs_nl[:, None] * stride_wn + offs_k[None, :]
        if W_AS_A:
            x_ptrs = x_ptr + offs_ml[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
        else:
            x_ptrs = x_ptr + offs_ml[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        if EVEN_K:
            w = tl.load(w_ptrs)
            xv = tl.load(x_ptrs)
        else:
            kmask = offs_k < K
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
            if W_AS_A:
                xv = tl.load(x_ptrs, mask=kmask[:, None], other=0.0)
            else:
                xv = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
        wd = w.to(cdt)  # E4M3 -> bf16/fp16/fp32 is exact
        if W_AS_A:
            if DOT_IEEE:
                acc = tl.dot(wd, xv, acc, input_precision="ieee")
            else:
                acc = tl.dot(wd, xv, acc)
        else:
            if DOT_IEEE:
                acc = tl.dot(xv, tl.trans(wd), acc, input_precision="ieee")
            else:
                acc = tl.dot(xv, tl.trans(wd), acc)
    if not W_AS_A:
        acc = tl.trans(acc)  # [BLOCK_N, BLOCK_M] for the common epilogue

    nmask = offs_n < N
    mmask = offs_m < M
    mask = nmask[:, None] & mmask[None, :]
    om = offs_m.to(tl.int64)
    if SPLIT_K == 1:
        scale = tl.load(s_ptr + offs_nl * stride_s)
        y = acc * scale[:, None]
        tl.store(
            out_ptr + om[None, :] * stride_om + offs_n[:, None], y.to(out_ptr.dtype.element_ty), mask=mask
        )
    else:
        base = ws_ptr + pid_k.to(tl.int64) * M * N
        tl.store(base + om[None, :] * N + offs_n[:, None], acc, mask=mask)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_s,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_nl = (offs_n % N).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    k_start = pid_k * K_PER_SPLIT

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # BLOCK_M == 1: reduce over K once at the end
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        offs_k = k_start + kk + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        w_ptrs = w_ptr + offs_nl[:, None] * stride_wn + offs_k[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs).to(tl.float32)
        else:
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            if EVEN_K:
                xv = tl.load(x_ptr + offs_k).to(tl.float32)
            else:
                xv = tl.load(x_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
            acc1 += w * xv[None, :]
        else:
            for mi in tl.static_range(BLOCK_M):
                # rows mi >= M re-read a valid row (their results are never stored)
                xv = tl.load(x_ptr + (mi % M) * stride_xm + offs_k, mask=kmask, other=0.0).to(tl.float32)
                part = tl.sum(w * xv[None, :], axis=1)
                acc += tl.where(offs_m[:, None] == mi, part[None, :], 0.0)
    if BLOCK_M == 1:
        acc = tl.sum(acc1, axis=1)[None, :]

    nmask = offs_n < N
    mask = (offs_m < M)[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        scale = tl.load(s_ptr + offs_nl * stride_s)
        y = acc * scale[None, :]
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
        )
    else:
        base = ws_ptr + pid_k.to(tl.int64) * M * N
        tl.store(base + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _fp8_splitk_reduce_kernel(
    ws_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    stride_s,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs = pid_n * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    row = pid_m.to(tl.int64) * N
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(ws_ptr + s * M * N + row + offs, mask=mask, other=0.0)
    scale = tl.load(s_ptr + offs * stride_s, mask=mask, other=0.0)
    y = acc * scale
    tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
