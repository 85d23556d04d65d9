"""Decode-sized attention of the gated full-attention layers with the q/k RMSNorm, the RoPE and the new tokens'
K/V cache store fused into the split-KV kernel (Triton): two launches where
:func:`~vibeqwen_kernels.attention.rope_norm.qk_norm_rope_store` + :func:`~vibeqwen_kernels.attention.paged.paged_attention`
take three.

Public surface: :func:`fused_decode_attention`. Its specification is those two calls in a row (same arguments,
same cache writes; the output equal up to the fp32 order of the split merge). The kernel is
``_split_kv_norm_rope_kernel`` in ``_paged_kernels.py``, the merge ``_split_reduce_kernel``.

Why: at batch 1 on the H200 the separate q/k norm + RoPE launch takes ~7 us of a ~17 us attention block, most of it
a dependent launch's latency rather than work; here the split-KV programs each redo the norm of their q rows
(GROUP heads x q_len queries, a few KB from L2) and one extra program per (sequence, kv head) takes the new keys.
Status: experimental, off in the model unless ``VIBEQWEN_FUSED_ATTENTION=1``: slower than the three launches on the
H200 (``bench/kernels/bench_decode_attention.py``). Version 1 (64-key tiles, rotary tables per row; ptxas: 255
registers, a 1000-byte spill stack) took 45.7 against 16.3 us at batch 1; this one (per-query rotary tables,
32-key tiles) 30.3 against 16.4 us at batch 1 and 38.4-48.4 against 23.3 at batch 8, decode step b1 2.401 against
2.142 ms. What is left to try: the rotary tables once per step instead of per program, and the q norm done once
per (sequence, kv head) rather than in every split.
"""

from __future__ import annotations

import math

import torch
from vibeqwen_kernels.pdl import pdl_launch

__all__ = ["fused_decode_attention"]

#: Launch configs of the fused split-KV kernel, tried in order (the first that fits the GPU is kept; see
#: ``bench/kernels/bench_decode_attention.py``, which times each). It holds more live state than the plain split-KV
#: kernel (the q norm's rows, the new keys' branch): 32-key tiles keep it from spilling at D 256.
CONFIGS = {
    "small": [  # BLOCK_M <= 32
        {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2},
    ],
    "large": [  # BLOCK_M 64 .. 128
        {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_N": 16, "num_warps": 8, "num_stages": 1},
    ],
}


def fused_decode_attention(
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
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """q/k RMSNorm + RoPE, the new tokens' K/V into the paged cache, and causal GQA attention, in two launches.

    Equivalent to ``q = qk_norm_rope_store(qg, k, v, q_norm_w, k_norm_w, eps, positions, rotary_dim, theta,
    k_cache, v_cache, slot_mapping)`` then ``paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
    query_start_loc, scale, max_query_len, out, num_splits, kernel="split", gate=gate)`` (see both for the
    formulas: zero-centred RMSNorm, rotate-half RoPE on the first rotary_dim dims, FlashAttention-2 online softmax,
    Flash-Decoding split merge). The new tokens' keys and values are attended to as the cache stores them
    (rounded to its dtype), q rounded to qg's dtype, as the two calls do. The split boundaries differ (the cached
    keys [0, ctx) are split, the new ones get their own program), so the output matches to the fp32 merge order,
    not bit for bit.

    Args:
        qg: [T, Hq, 2D] (per head [query | gate], q_proj's output viewed), unit last stride; bf16/fp16 (fp32 only
            under the Triton interpreter). D a power of two >= 16.
        k, v: [T, Hkv, D] raw projection rows (strided views allowed, unit last stride).
        q_norm_w, k_norm_w: [D]. eps: RMSNorm epsilon.
        positions: [T] int64/int32 absolute positions; for each sequence they must be ctx .. seq_len - 1 of its
            rows (ctx = seq_len - q_len), as the engine makes them (not checked).
        rotary_dim: even, 2..D. theta: RoPE base.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], unit last stride, block_size a power of two.
        slot_mapping: [T] int64/int32 flat cache slots of the new tokens (< 0: not stored).
        block_tables, seq_lens, query_start_loc: as :func:`~vibeqwen_kernels.attention.paged.paged_attention`
            (int32; seq_lens includes the new tokens).
        scale: softmax scale. max_query_len: a Python int in [1, SPLIT_MAX_Q] >= every q_len.
        out: optional [T, Hq, D] output (unit last stride). num_splits: splits of the cached keys (None:
            ``default_num_splits``); one more program per (sequence, kv head) takes the new keys.
        gate: optional [T, Hq, D] (e.g. ``qg[..., D:]``): the output times sigmoid(gate) before its rounding.

    Returns:
        out [T, Hq, D] in qg's dtype (or out's).

    Raises:
        ValueError: the checks of both specification calls (shapes, dtypes, strides, devices), max_query_len
            outside [1, SPLIT_MAX_Q], num_splits outside [1, MAX_SPLITS - 1].
        TypeError: max_query_len not a Python int.
    """
    from vibeqwen_kernels.attention import paged as P
    from vibeqwen_kernels.attention.rope_norm import _inv_freq, check_norm_rope_args

    fn = "fused_decode_attention"
    t, hq, d, hkv = check_norm_rope_args(fn, qg, k, v, q_norm_w, k_norm_w, positions, rotary_dim, k_cache, v_cache,
                                         slot_mapping)
    q_view = qg[..., :d]
    P._check(q_view, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len)
    if not 1 <= max_query_len <= P.SPLIT_MAX_Q:
        raise ValueError(f"{fn}: max_query_len must be in [1, {P.SPLIT_MAX_Q}], got {max_query_len}")
    if gate is not None and (gate.shape != q_view.shape or gate.device != qg.device or gate.stride(-1) != 1
                             or not gate.dtype.is_floating_point):
        raise ValueError(f"{fn}: gate must be a float [T, Hq, D] tensor on qg's device with unit last stride, got "
                         f"{gate.dtype} {tuple(gate.shape)} stride {gate.stride()}")
    for name, x in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w), ("positions", positions),
                    ("slot_mapping", slot_mapping)):
        if x.device != qg.device:
            raise ValueError(f"{fn}: {name} is on {x.device}, qg on {qg.device}")
    b = seq_lens.shape[0]
    if out is None:
        out = torch.empty(t, hq, d, dtype=qg.dtype, device=qg.device)
    elif out.shape != (t, hq, d) or out.device != qg.device or out.stride(-1) != 1 or out.dtype not in P._DTYPES:
        raise ValueError(f"{fn}: out must be [{t}, {hq}, {d}] on qg's device with unit last stride, got "
                         f"{tuple(out.shape)} {out.dtype} stride {out.stride()}")
    if num_splits is None:
        num_splits = min(P.default_num_splits(b, hkv, qg.device), P.MAX_SPLITS - 1)
    if not (isinstance(num_splits, int) and 1 <= num_splits <= P.MAX_SPLITS - 1):
        raise ValueError(f"{fn}: num_splits must be an int in [1, {P.MAX_SPLITS - 1}], got {num_splits}")
    if t == 0 or b == 0:
        return out
    kern = P._kernels()
    group, group_p = P._group(hq, hkv)
    block_q = max(P._next_pow2(max_query_len), max(1, 16 // group_p))
    block_m = block_q * group_p
    part_o, part_lse = P.split_partials(t, hq, d, num_splits + 1, qg.device)
    inv_freq = _inv_freq(rotary_dim, float(theta), str(qg.device))
    q_norm_w, k_norm_w = q_norm_w.contiguous(), k_norm_w.contiguous()

    def launch(cfg):
        kern._split_kv_norm_rope_kernel[(b, hkv, num_splits + 1)](
            qg, k, v, q_norm_w, k_norm_w, positions, inv_freq, slot_mapping, k_cache, v_cache, block_tables,
            seq_lens, query_start_loc, part_o, part_lse,
            float(eps), float(scale) * math.log2(math.e),
            qg.stride(0), qg.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
            GROUP=group,
            GROUP_P=group_p,
            BLOCK_Q=block_q,
            HEAD_DIM=d,
            ROT=rotary_dim,
            PAGE=k_cache.shape[1],
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_NEW=max(16, block_q),
            NUM_SPLITS=num_splits,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **pdl_launch(qg.device),
        )

    kind = "small" if block_m <= 32 else "large"
    P._run_configs(("norm_rope_" + kind, d, qg.dtype, k_cache.dtype, block_m, k_cache.shape[1]), CONFIGS[kind], launch)
    P.launch_split_reduce(part_o, part_lse, query_start_loc, out, gate, max_query_len)
    return out
