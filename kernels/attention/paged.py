"""Paged causal GQA attention for the gated full-attention layers, on the GPU (Triton).

Public surface: :func:`paged_attention`. The specification is :func:`.naive.attention_ref` applied per
sequence to the keys/values gathered from the paged cache (as ``vibeqwen/model/attention.py`` does).
The Triton kernels live in ``_paged_kernels.py`` and are imported on first use, so this module imports
on machines without Triton.

Two kernels, both CUDA-graph capturable (no host sync; grids depend only on shapes and Python ints):

* split-KV ("flash decoding"), used when ``max_query_len <= SPLIT_MAX_Q`` (decode, and speculative
  verification with a few queries): grid ``(B, Hkv, num_splits)``; each program takes all queries x
  GQA heads of one kv head of one sequence (rows padded to >= 16 for the MMA) over one contiguous
  share of the sequence's keys, the shares computed in-kernel from ``seq_lens``; then a reduce kernel
  (grid ``(max_query_len, B, Hq)``) merges the shares by log-sum-exp.
* prefill/extend, used above that: grid ``(cdiv(max_query_len, BLOCK_Q), B, Hkv)``; each program takes
  BLOCK_Q queries x the GQA heads of one kv head (BLOCK_M = BLOCK_Q * 8 = 128 rows for the model) and
  loops over key tiles up to its causal limit (unmasked up to the first query's position, masked after).

Block sizes come from ``_CONFIGS`` below (first entry that fits the GPU's shared memory; see
``bench/kernels/bench_attention.py --tune`` to re-tune on an H200).
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import torch
from vibeqwen_kernels.pdl import pdl_launch

__all__ = ["SPLIT_MAX_Q", "default_num_splits", "paged_attention"]

#: Largest max_query_len that the split-KV kernel serves under ``kernel="auto"``.
SPLIT_MAX_Q = 16
#: Upper bound on num_splits (the reduce kernel holds all splits of a row at once).
MAX_SPLITS = 64

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Candidate launch configs, tried in order; the first that compiles within the GPU's resources is kept
# (per kernel, head_dim, dtype, BLOCK_M). Keys: BLOCK_N (keys per tile), num_warps, num_stages.
_CONFIGS = {
    # split-KV: memory bound; rows 16 (decode) .. 128 (16 queries x 8 heads)
    "split_small": [  # BLOCK_M <= 32 (H200, bench_decode_attention.py: 2 stages beat 3 at every case, 213.6 -> 149.2
        # us at batch 32 x 8k; the 3-stage config spills: 255 registers, 552-byte stack)
        {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
        {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
    ],
    "split_large": [  # BLOCK_M 64 .. 128
        {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_N": 16, "num_warps": 8, "num_stages": 1},
    ],
    # prefill: BLOCK_Q * GROUP_P = 128 rows
    "prefill": [
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
    ],
}
_chosen: dict[tuple, dict] = {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, device: torch.device | None = None) -> int:
    """The split count :func:`paged_attention` uses when ``num_splits`` is None.

    Enough (batch x kv head x split) programs for about two waves over the GPU's SMs (132 on an
    H200; 132 assumed off-GPU, 4 under Triton's interpreter, which runs the programs one by one), at most
    ``MAX_SPLITS``. Depends only on Python ints, so a CUDA graph
    captured for a batch size is valid for every sequence length. Splits that get no keys (short
    contexts) cost one tiny program each.
    """
    sms = 4 if _interpret() else 132
    if device is not None and device.type == "cuda":
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(MAX_SPLITS, -(-2 * sms // max(1, batch * num_kv_heads))))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    kernel: str = "auto",
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of packed query rows over a paged KV cache.

    Args:
        q: [T, Hq, D] bf16/fp16 (fp32 only under the interpreter); any strides with a unit last stride
            (otherwise copied). Sequence b owns rows [query_start_loc[b], query_start_loc[b+1]).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], unit last stride; block_size a power of
            two (16..128 typical); dtype q's, or anything Triton casts to it (e.g. fp8 e4m3, scale 1).
            Must already hold the new tokens' K/V (see :func:`.rope_norm.qk_norm_rope_store`).
        block_tables: [B, max_blocks] int32: key position p of sequence b is at
            [block_tables[b, p // block_size], p % block_size]. Entries at/after ceil(seq_lens[b] /
            block_size) are never read (may be garbage).
        seq_lens: [B] int32, tokens in the cache for b INCLUDING its new ones (>= q_len_b; 0 for padding).
        query_start_loc: [B+1] int32, non-decreasing; q_len_b = query_start_loc[b+1] - query_start_loc[b].
        scale: softmax scale (the model: D ** -0.5).
        max_query_len: a Python int >= every q_len_b (a promise, not checked: rows past it are not
            computed). Selects the kernel and sizes the grid.
        out: optional [T, Hq, D] output (any strides with unit last stride); rows of no sequence, and
            of sequences with q_len 0, are left untouched.
        num_splits: split-KV only: key shares per (sequence, kv head); None = :func:`default_num_splits`.
            Fixed per call, so one captured graph serves every sequence length.
        kernel: "auto" (split-KV if max_query_len <= SPLIT_MAX_Q else prefill), "split" or "prefill".
        gate: optional [T, Hq, D] (any float dtype and strides with a unit last stride, e.g. the second half
            of the model's q projection): the output is multiplied by sigmoid(gate) in fp32 before its one
            rounding (the model's attention output gate, fused: no extra launches).

    Returns:
        out, [T, Hq, D] in q's dtype (or out's). Query row i of sequence b sits at position
        seq_lens[b] - q_len_b + i and attends to keys 0..that position; softmax(q k^T * scale) v with an
        fp32 softmax and accumulator, P rounded to q's dtype before the P @ V MMA (FlashAttention).

    Raises:
        ValueError: wrong ranks/shapes/dtypes/devices, Hq % Hkv != 0, D not a power of two >= 16,
            block_size not a power of two, bad kernel/num_splits, a gate not shaped like q (or not a float
            tensor on q's device with a unit last stride).
        TypeError: max_query_len not a Python int.

    Source: FlashAttention-2 (Dao, 2023) online softmax; split-KV merge as in Flash-Decoding (Dao et
    al., 2023); reference semantics: ``vibeqwen_kernels.attention.naive.attention_ref``.
    """
    if gate is not None and (gate.shape != q.shape or gate.device != q.device or gate.stride(-1) != 1
                             or not gate.dtype.is_floating_point):
        raise ValueError(
            f"paged_attention: gate must be a float [T, Hq, D] tensor on q's device with unit last stride, got "
            f"{gate.dtype} {tuple(gate.shape)} stride {gate.stride()}"
        )
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len)
    t, hq, d = q.shape
    b = seq_lens.shape[0]
    if out is None:
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.device != q.device or out.stride(-1) != 1 or out.dtype not in _DTYPES:
        raise ValueError(
            f"paged_attention: out must be [T, Hq, D] on q's device with unit last stride, got "
            f"{tuple(out.shape)} {out.dtype} stride {out.stride()}"
        )
    if t == 0 or b == 0 or max_query_len <= 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kernel == "auto":
        kernel = "split" if max_query_len <= SPLIT_MAX_Q else "prefill"
    if kernel == "split":
        if num_splits is None:
            num_splits = default_num_splits(b, k_cache.shape[2], q.device)
        if not (isinstance(num_splits, int) and 1 <= num_splits <= MAX_SPLITS):
            raise ValueError(
                f"paged_attention: num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits}"
            )
        _launch_split(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len,
            out,
            num_splits,
            gate,
        )
    elif kernel == "prefill":
        _launch_prefill(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, out, gate
        )
    else:
        raise ValueError(f"paged_attention: kernel must be 'auto', 'split' or 'prefill', got {kernel!r}")
    return out


def _check(q, k_cache, v_cache, block_tables, seq_lens, qsl, max_query_len) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"paged_attention: need q [T, Hq, D] and k/v_cache [blocks, block_size, Hkv, D], got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    _, hq, d = q.shape
    _, page, hkv, dk = k_cache.shape
    if dk != d or hq % hkv:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"paged_attention: head_dim must be a power of two >= 16, got {d}")
    if page < 1 or page & (page - 1):
        raise ValueError(f"paged_attention: block_size must be a power of two, got {page}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"paged_attention: q dtype {q.dtype} not supported")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention: k_cache/v_cache need a unit last stride")
    b = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or qsl.shape != (b + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(
            f"paged_attention: need seq_lens [B], query_start_loc [B+1], block_tables [B, n], got "
            f"{tuple(seq_lens.shape)}, {tuple(qsl.shape)}, {tuple(block_tables.shape)}"
        )
    for name, x in (("seq_lens", seq_lens), ("query_start_loc", qsl), ("block_tables", block_tables)):
        if x.dtype != torch.int32:
            raise ValueError(f"paged_attention: {name} must be int32, got {x.dtype}")
    if seq_lens.stride(0) != 1 or qsl.stride(0) != 1 or block_tables.stride(1) != 1:
        raise ValueError(
            "paged_attention: seq_lens, query_start_loc and block_tables rows must be contiguous"
        )
    devs = {x.device for x in (q, k_cache, v_cache, block_tables, seq_lens, qsl)}
    if len(devs) != 1:
        raise ValueError(f"paged_attention: tensors on several devices {devs}")
    if q.device.type != "cuda" and not _interpret():
        raise ValueError(
            f"paged_attention: needs CUDA tensors (got {q.device}); use attention_ref on the CPU "
            "or set TRITON_INTERPRET=1"
        )
    if not isinstance(max_query_len, int):
        raise TypeError(f"paged_attention: max_query_len must be a Python int, got {type(max_query_len)}")


def _kernels():
    from vibeqwen_kernels.attention import _paged_kernels

    return _paged_kernels


def _run_configs(key: tuple, candidates: list[dict], launch) -> None:
    """Launch with the cached config for `key`, else the first candidate that fits the GPU's resources."""
    from triton.runtime.errors import OutOfResources

    if key in _chosen:
        launch(_chosen[key])
        return
    last = None
    for cfg in candidates:
        try:
            launch(cfg)
        except OutOfResources as e:  # too much shared memory / registers: try a smaller tile
            last = e
            continue
        _chosen[key] = cfg
        return
    raise last


def _group(hq: int, hkv: int) -> tuple[int, int]:
    g = hq // hkv
    return g, _next_pow2(g)


def _gate_args(gate: torch.Tensor | None, out: torch.Tensor) -> tuple:
    """The kernels' (gate pointer, token stride, head stride) and HAS_GATE; without a gate, out stands in (never
    read)."""
    g = gate if gate is not None else out
    return g, g.stride(0), g.stride(1), gate is not None


def _launch_split(q, k_cache, v_cache, bt, seq_lens, qsl, scale, max_q, out, num_splits, gate=None) -> None:
    kern = _kernels()
    t, hq, d = q.shape
    b = seq_lens.shape[0]
    hkv = k_cache.shape[2]
    group, group_p = _group(hq, hkv)
    block_q = max(_next_pow2(max_q), max(1, 16 // group_p))
    block_m = block_q * group_p
    part_o, part_lse = split_partials(t, hq, d, num_splits, q.device)
    sm_scale_log2 = float(scale) * math.log2(math.e)

    def launch(cfg):
        kern._split_kv_kernel[(b, hkv, num_splits)](
            q,
            k_cache,
            v_cache,
            bt,
            seq_lens,
            qsl,
            part_o,
            part_lse,
            sm_scale_log2,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            bt.stride(0),
            part_o.stride(0),
            part_o.stride(1),
            part_o.stride(2),
            GROUP=group,
            GROUP_P=group_p,
            BLOCK_Q=block_q,
            HEAD_DIM=d,
            PAGE=k_cache.shape[1],
            BLOCK_N=cfg["BLOCK_N"],
            NUM_SPLITS=num_splits,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **pdl_launch(q.device),
        )

    kind = "split_small" if block_m <= 32 else "split_large"
    _run_configs((kind, d, q.dtype, k_cache.dtype, block_m, k_cache.shape[1]), _CONFIGS[kind], launch)
    launch_split_reduce(part_o, part_lse, qsl, out, gate, max_q)


def split_partials(t: int, hq: int, d: int, num_splits: int, device: torch.device):
    """New split-KV partials: o fp32 [T, Hq, S, D] and lse fp32 [T, Hq, S], both contiguous (the kernels address
    the lse of a row by its o offset // D)."""
    return (torch.empty(t, hq, num_splits, d, dtype=torch.float32, device=device),
            torch.empty(t, hq, num_splits, dtype=torch.float32, device=device))


def launch_split_reduce(part_o, part_lse, qsl, out, gate, max_q: int) -> None:
    """The log-sum-exp merge of split partials (``split_partials``'s layout; S = part_o.shape[2]) into out
    [T, Hq, D], times sigmoid(gate) if given (``_split_reduce_kernel``; grid (max_q, B, Hq))."""
    kern = _kernels()
    _, hq, num_splits, d = part_o.shape
    g, g_st, g_sh, has_gate = _gate_args(gate, out)
    kern._split_reduce_kernel[(max_q, qsl.shape[0] - 1, hq)](
        part_o,
        part_lse,
        qsl,
        out,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        out.stride(0),
        out.stride(1),
        g, g_st, g_sh,
        HEAD_DIM=d,
        NUM_SPLITS=num_splits,
        SPLITS_P=_next_pow2(num_splits),
        HAS_GATE=has_gate,
        num_warps=4 if d >= 128 else 1,
        **pdl_launch(part_o.device),
    )


def _launch_prefill(q, k_cache, v_cache, bt, seq_lens, qsl, scale, max_q, out, gate=None) -> None:
    kern = _kernels()
    hq, d = q.shape[1], q.shape[2]
    b = seq_lens.shape[0]
    hkv = k_cache.shape[2]
    group, group_p = _group(hq, hkv)
    sm_scale_log2 = float(scale) * math.log2(math.e)
    g, g_st, g_sh, has_gate = _gate_args(gate, out)

    def launch(cfg):
        # BLOCK_Q queries x GROUP_P heads = BLOCK_M rows, >= 16 rows, no more queries than needed
        block_q = max(1, cfg["BLOCK_M"] // group_p, 16 // group_p)
        block_q = max(min(block_q, _next_pow2(max_q)), max(1, 16 // group_p))
        kern._prefill_kernel[(_cdiv(max_q, block_q), b, hkv)](
            q,
            k_cache,
            v_cache,
            bt,
            seq_lens,
            qsl,
            out,
            sm_scale_log2,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            bt.stride(0),
            out.stride(0),
            out.stride(1),
            g, g_st, g_sh,
            GROUP=group,
            GROUP_P=group_p,
            BLOCK_Q=block_q,
            HEAD_DIM=d,
            PAGE=k_cache.shape[1],
            BLOCK_N=cfg["BLOCK_N"],
            HAS_GATE=has_gate,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **pdl_launch(q.device),
        )

    _run_configs(
        ("prefill", d, q.dtype, k_cache.dtype, group_p, k_cache.shape[1], min(_next_pow2(max_q), 256)),
        _CONFIGS["prefill"],
        launch,
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
