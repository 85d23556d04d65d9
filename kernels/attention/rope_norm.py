"""Fused q/k RMSNorm + partial RoPE + paged K/V cache store for the gated full-attention layers (Triton).

Public surface: :func:`qk_norm_rope_store`, and :func:`qk_norm_rope_store_ref` (plain PyTorch, the
specification, runs anywhere). The kernel is in ``_paged_kernels.py`` (imported on first use).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
from vibeqwen_kernels.pdl import pdl_launch

__all__ = ["check_norm_rope_args", "qk_norm_rope_store", "qk_norm_rope_store_ref"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@lru_cache(maxsize=16)
def _inv_freq(rotary_dim: int, theta: float, device: str) -> torch.Tensor:
    # the same fp32 expression as vibeqwen.model.layers.rotary_cos_sin, so the angles pos * inv_freq match
    # the reference bit for bit (the kernel forms the product in fp32 too)
    ar = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device)
    return 1.0 / (theta ** (ar / rotary_dim))


def qk_norm_rope_store(
    qg: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    rotary_dim: int,
    theta: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalise and rotate q and k, store k and v in the paged cache; one kernel, grid (T,).

    For every token t, query head h and kv head j (all math in fp32, one rounding at each store):
        q_out[t, h] = rope(rmsnorm(qg[t, h, :D], q_norm_w), positions[t])
        k_cache[slot // bs, slot % bs, j] = rope(rmsnorm(k[t, j], k_norm_w), positions[t])
        v_cache[slot // bs, slot % bs, j] = v[t, j]              (slot = slot_mapping[t]; skipped if < 0)
    rmsnorm(x, w) = x * rsqrt(mean(x^2) + eps) * (1 + w) (zero-centred, ``vibeqwen_kernels.norm.rms_norm_ref``);
    rope = rotate-half on the first rotary_dim dims, angle pos * inv_freq_i, inv_freq_i =
    theta^(-2i/rotary_dim) (``vibeqwen.model.layers.rotary_cos_sin`` / ``apply_rotary``; Qwen3.6 text M-RoPE
    reduces to it). The gate half qg[..., D:] is neither read nor written.

    Difference from the reference: the reference rounds the normed x, cos and sin to the activation dtype
    and rotates in that dtype; this kernel keeps them in fp32 (more accurate; for bf16 the outputs differ
    by about one bf16 ulp). inv_freq and the angle are formed as the reference does (fp32), cos/sin with
    Triton's fp32 cos/sin.

    Args:
        qg: [T, Hq, 2D] (per head [query | gate], e.g. q_proj's output viewed), unit last stride.
        k, v: [T, Hkv, D], unit last stride (strided views allowed).
        q_norm_w, k_norm_w: [D] contiguous.
        eps: RMSNorm epsilon.
        positions: [T] int64 (or int32) absolute positions.
        rotary_dim: even, 2..D (the model: 64). theta: RoPE base (the model: 1e7).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], unit last stride (dtype: any Triton stores to).
        slot_mapping: [T] int64 (or int32), flat slot = block * block_size + offset; < 0 = do not store.
        q_out: optional [T, Hq, D] output (unit last stride); default a new contiguous tensor.

    Returns:
        q_out [T, Hq, D] in qg's dtype (or q_out's).

    Raises:
        ValueError: on shape, dtype, stride or device mismatches (values are not checked: slots must lie
            inside the cache).
    """
    t, hq, d, hkv = check_norm_rope_args("qk_norm_rope_store", qg, k, v, q_norm_w, k_norm_w, positions, rotary_dim,
                                         k_cache, v_cache, slot_mapping)
    page = k_cache.shape[1]
    if q_out is None:
        q_out = torch.empty(t, hq, d, dtype=qg.dtype, device=qg.device)
    elif q_out.shape != (t, hq, d) or q_out.stride(-1) != 1:
        raise ValueError(f"qk_norm_rope_store: q_out must be [{t}, {hq}, {d}] with a unit last stride")
    tensors = (qg, k, v, q_norm_w, k_norm_w, positions, k_cache, v_cache, slot_mapping, q_out)
    if len({x.device for x in tensors}) != 1:
        raise ValueError("qk_norm_rope_store: tensors on several devices")
    if qg.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"qk_norm_rope_store: needs CUDA tensors (got {qg.device}); use qk_norm_rope_store_ref "
            "or set TRITON_INTERPRET=1"
        )
    if t == 0:
        return q_out
    q_norm_w = q_norm_w.contiguous()
    k_norm_w = k_norm_w.contiguous()
    inv_freq = _inv_freq(rotary_dim, float(theta), str(qg.device))
    from vibeqwen_kernels.attention import _paged_kernels as kern

    block_d = 1 << (d - 1).bit_length()
    hq_p = 1 << (hq - 1).bit_length()
    # decode-sized T: 4 q heads a program and one for K/V (H200, batch 1: one program a token took 7.3 us of
    # serial work a layer); prefill-sized T: one program a token (enough programs; the rotary angles once)
    hq_b = min(4, hq_p) if t <= _SPLIT_MAX_T else hq_p
    kv_prog = hq_p // hq_b if hq_b < hq_p else 0
    kern._qk_norm_rope_store_kernel[(t, kv_prog + 1)](
        qg,
        k,
        v,
        q_norm_w,
        k_norm_w,
        positions,
        inv_freq,
        k_cache,
        v_cache,
        slot_mapping,
        q_out,
        float(eps),
        qg.stride(0),
        qg.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        q_out.stride(0),
        q_out.stride(1),
        HQ=hq,
        HKV=hkv,
        HQ_P=hq_p,
        HKV_P=1 << (hkv - 1).bit_length(),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        ROT=rotary_dim,
        PAGE=page,
        HQ_B=hq_b,
        KV_PROG=kv_prog,
        num_warps=4,
        **pdl_launch(qg.device),
    )
    return q_out


def check_norm_rope_args(fn, qg, k, v, q_norm_w, k_norm_w, positions, rotary_dim, k_cache, v_cache, slot_mapping):
    """The argument checks of :func:`qk_norm_rope_store` (shared by the fused decode attention); fn names the
    caller in the messages. Returns (T, Hq, D, Hkv). Raises ValueError (see qk_norm_rope_store)."""
    if (
        qg.dim() != 3
        or k.dim() != 3
        or v.shape != k.shape
        or k_cache.dim() != 4
        or v_cache.shape != k_cache.shape
    ):
        raise ValueError(
            f"{fn}: bad ranks qg {tuple(qg.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
            f"cache {tuple(k_cache.shape)}/{tuple(v_cache.shape)}"
        )
    t, hq, d2 = qg.shape
    d = d2 // 2
    hkv = k.shape[1]
    if d2 % 2 or k.shape != (t, hkv, d) or k_cache.shape[2:] != (hkv, d):
        raise ValueError(
            f"{fn}: shapes do not fit: qg {tuple(qg.shape)} k {tuple(k.shape)} "
            f"cache {tuple(k_cache.shape)}"
        )
    if q_norm_w.shape != (d,) or k_norm_w.shape != (d,):
        raise ValueError(f"{fn}: norm weights must be [{d}]")
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"{fn}: positions and slot_mapping must be [{t}]")
    if positions.dtype not in (torch.int64, torch.int32) or slot_mapping.dtype not in (
        torch.int64,
        torch.int32,
    ):
        raise ValueError(f"{fn}: positions and slot_mapping must be int64 or int32")
    if not (isinstance(rotary_dim, int) and 2 <= rotary_dim <= d and rotary_dim % 2 == 0):
        raise ValueError(f"{fn}: rotary_dim must be an even int in [2, {d}], got {rotary_dim}")
    if qg.dtype not in _DTYPES or k.dtype not in _DTYPES or v.dtype not in _DTYPES:
        raise ValueError(f"{fn}: unsupported dtypes {qg.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("qg", qg), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} needs a unit last stride")
    return t, hq, d, hkv


#: tokens up to which qk_norm_rope_store splits a token's heads over several programs
_SPLIT_MAX_T = 64


def qk_norm_rope_store_ref(
    qg, k, v, q_norm_w, k_norm_w, eps, positions, rotary_dim, theta, k_cache, v_cache, slot_mapping
) -> torch.Tensor:
    """The specification of :func:`qk_norm_rope_store` in PyTorch, composed from the model's reference ops
    (``rms_norm_ref``, ``rotary_cos_sin``, ``apply_rotary``; so cos/sin and the rotation are in the
    activation dtype). Same arguments and effects (writes k_cache/v_cache); returns q [T, Hq, D]."""
    from vibeqwen_kernels.norm import rms_norm_ref

    from vibeqwen.model.layers import apply_rotary, rotary_cos_sin

    d = qg.shape[2] // 2
    cos, sin = rotary_cos_sin(positions, rotary_dim, theta, qg.dtype)
    q = apply_rotary(rms_norm_ref(qg[..., :d], q_norm_w, eps), cos, sin)
    kk = apply_rotary(rms_norm_ref(k, k_norm_w, eps), cos.to(k.dtype), sin.to(k.dtype))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    hkv = k.shape[1]
    k_cache.view(-1, hkv, d)[slots] = kk[keep].to(k_cache.dtype)
    v_cache.view(-1, hkv, d)[slots] = v[keep].to(v_cache.dtype)
    return q.contiguous()
