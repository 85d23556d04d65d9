"""Gated DeltaNet, token-by-token (decode / speculative-verify) form over a flattened varlen batch (GPU).

The reference is :func:`vibeqwen_kernels.gdn.naive.gdn_recurrent_ref` (one sequence, precomputed g and
beta); the Triton kernel lives in ``_recurrent_kernels.py`` and is imported on first use, so this module
imports on machines without Triton. CUDA-graph capturable: no host/device sync, the grid is
(B, Hv, Dv // BLOCK_V) and depends only on shapes.
"""

from __future__ import annotations

import os

import torch
from vibeqwen_kernels.pdl import pdl_launch
from vibeqwen_kernels.switches import env_switch

__all__ = ["NORM_TAIL_MAX_SEQS", "STATE_DTYPES", "early_state", "gdn_recurrent", "norm_tail", "norm_tail_counter",
           "pick_block_v"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Storage dtypes of the recurrent state (ssm_states, intermediate_states); the kernel computes in fp32 either way.
STATE_DTYPES = (torch.float32, torch.bfloat16)
_SM_COUNT_GUESS = 132  # H200; only used to pick a block size
#: inside early launch (decode and verification graphs, ``vibeqwen_kernels.pdl``) the kernel requests its state slices
#: before its PDL wait, while the kernel ahead of it still runs; ``VIBEQWEN_GDN_EARLY_STATE=0`` loads them after it
_EARLY_STATE = os.environ.get("VIBEQWEN_GDN_EARLY_STATE", "1") != "0"


def early_state() -> bool:
    """Whether the decode kernels (this one, ``decode_cuda.gdn_recurrent_decode``) read the state slices before their
    PDL wait under early launch (``VIBEQWEN_GDN_EARLY_STATE``, read at import)."""
    return _EARLY_STATE


#: sequences a :func:`norm_tail_counter` covers (a launch of more runs the norm as its own launch)
NORM_TAIL_MAX_SEQS = 1024


def norm_tail() -> bool:
    """Whether the model's GDN layers run the gated RMSNorm as the recurrent kernel's tail (``gdn_recurrent``'s
    ``gated_norm``) instead of its own launch: unless ``VIBEQWEN_GDN_NORM_TAIL=0``. On by default: decode steps of
    one sequence took 2.035 ms against 2.053 with the launch, of eight 4.302 against 4.315 (H100, two interleaved
    runs, bench/results/h200_notes.md, forty-ninth session); from 32 sequences the persistent CUDA kernel runs the
    delta rule and the norm keeps its launch. Read at every call, so a CUDA graph keeps what it was captured with.

    Raises:
        ValueError: a value other than 0 or 1."""
    return env_switch("VIBEQWEN_GDN_NORM_TAIL", "1")


def norm_tail_counter(hv: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 counter ``[NORM_TAIL_MAX_SEQS * hv]`` for ``gdn_recurrent(gated_norm=...)`` (4 bytes a
    (sequence, value head); every launch leaves it zero)."""
    return torch.zeros(NORM_TAIL_MAX_SEQS * hv, dtype=torch.int32, device=device)


def _kernels():
    from vibeqwen_kernels.gdn import _recurrent_kernels

    return _recurrent_kernels


def pick_block_v(batch: int, hv: int, dv: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a launch of ``batch`` sequences: enough programs to cover the SMs a few
    times over (the state slice is the only large traffic), wider slices once they do.

    Heuristic, to be refined with ``bench/kernels/bench_gdn.py --sweep`` on the H200.
    """
    for bv, warps in ((32, 4), (16, 2)):
        if dv % bv == 0 and batch * hv * (dv // bv) >= 4 * _SM_COUNT_GUESS:
            return bv, warps
    bv = 8 if dv % 8 == 0 else dv
    return bv, 1


def _check_2d_rows(name: str, x: torch.Tensor, t: int, h: int) -> None:
    if x.dim() != 2 or x.shape != (t, h) or x.dtype not in _DTYPES:
        raise ValueError(
            f"gdn_recurrent: {name} must be a float [{t}, {h}] tensor, got {x.dtype} {tuple(x.shape)}"
        )


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    max_query_len: int,
    intermediate_states: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    gated_norm: tuple | None = None,
) -> torch.Tensor:
    """Gated delta rule, token by token, for every sequence of a flattened batch; updates the state slots.

    Per sequence b (tokens ``query_start_loc[b] : query_start_loc[b+1]``, slot ``slots[b]``) this equals
    ``gdn_recurrent_ref(q, k, v, g, beta, S0)`` on those tokens with
    ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` (fp32, computed in-kernel),
    ``S0 = ssm_states[slots[b]]`` when ``has_initial_state[b]`` else zeros (whatever the slot holds).
    q and k are L2-normalised in-kernel (``x * rsqrt(sum x^2 + 1e-6)``), q scaled by ``Dk ** -0.5``;
    value head h reads key head ``h // (Hv // Hk)``. Formula: Yang et al., "Gated Delta Networks"
    (arXiv 2412.06464); see kernels/gdn/naive.py. The final state is written back to
    ``ssm_states[slots[b]]`` in place; sequences with q_len 0 are no-ops.

    Args:
        q, k: ``[T, Hk, Dk]`` bf16/fp16/fp32; may be strided views (e.g. of the conv output), last dim
            contiguous. Dk must be a power of two.
        v: ``[T, Hv, Dv]``, same conditions; Hv a multiple of Hk, Dv a multiple of 8.
        a, b: ``[T, Hv]`` raw gate projections (rows may be strided, last dim contiguous).
        A_log, dt_bias: ``[Hv]`` fp32.
        ssm_states: ``[num_slots, Hv, Dk, Dv]`` fp32 or bf16 (EngineConfig.gdn_state_dtype), last dim
            contiguous; read (upcast to fp32) and updated in place (the final state rounded to its dtype).
        slots: ``[B]`` int32/int64 slot per sequence (distinct for sequences with tokens).
        query_start_loc: ``[B+1]`` int32/int64, non-decreasing token offsets.
        has_initial_state: ``[B]`` bool.
        max_query_len: Python int, the largest q_len (kept for interface symmetry; the kernel reads
            each sequence's length from ``query_start_loc``, so it only matters in that 0 launches
            nothing).
        intermediate_states: optional ``[T, Hv, Dk, Dv]`` contiguous, ssm_states' dtype: the state after every
            token is stored there, rounded to that dtype (speculative decoding rolls back to one of them).
        out: optional ``[T, Hv, Dv]`` contiguous output buffer.
        block_v, num_warps: override the launch configuration (see :func:`pick_block_v`).
        gated_norm: optional ``(z, weight, eps, counter)``: also apply the GDN output's gated RMSNorm in the same
            launch and return its result instead of o (``norm_fused.gated_rms_norm(o, z, weight, eps)``, the same
            rounding steps; o then goes to ``out`` or a scratch buffer). z ``[T, Hv, Dv]`` float, last dim
            contiguous (e.g. a column view of the input projection); weight ``[Dv]`` float; counter int32 with at
            least ``B * Hv`` elements, zero (each launch leaves it zero again, so launches in turn may share one,
            two at once may not; the model gives each GDN layer its own). See :func:`norm_tail_counter`.

    Returns:
        ``o`` ``[T, Hv, Dv]`` in v's dtype (or ``out``); with ``gated_norm``, the normed ``y`` (new, contiguous,
        v's dtype). Rows not covered by any sequence are unwritten.

    Raises:
        ValueError: bad ranks, shapes, dtypes or layouts; CPU tensors outside Triton's interpreter.

    Precision: fp32 arithmetic throughout, the running state in fp32 registers for the whole launch; differs from
    the fp32 reference by summation order only, plus the final rounding of o to v's dtype and, with bf16 states,
    one rounding (to nearest even) of every state stored (the final one and each intermediate one); a bf16 initial
    state is read exactly.
    """
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"gdn_recurrent: q, k must be [T, Hk, Dk] and v [T, Hv, Dv], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if any(x.dtype not in _DTYPES for x in (q, k, v)):
        raise ValueError("gdn_recurrent: q, k, v must be bf16/fp16/fp32")
    if hv % hk or dk & (dk - 1) or dv % 8:
        raise ValueError(
            f"gdn_recurrent: need Hv a multiple of Hk, Dk a power of two and Dv a multiple of 8 "
            f"(Hk={hk}, Hv={hv}, Dk={dk}, Dv={dv})"
        )
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("gdn_recurrent: q, k, v need a contiguous last dim")
    _check_2d_rows("a", a, t, hv)
    _check_2d_rows("b", b, t, hv)
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("gdn_recurrent: a, b need a contiguous last dim")
    if (
        A_log.shape != (hv,)
        or dt_bias.shape != (hv,)
        or A_log.dtype != torch.float32
        or dt_bias.dtype != torch.float32
    ):
        raise ValueError(f"gdn_recurrent: A_log and dt_bias must be fp32 [{hv}]")
    if (
        ssm_states.dim() != 4
        or ssm_states.shape[1:] != (hv, dk, dv)
        or ssm_states.dtype not in STATE_DTYPES
        or ssm_states.stride(3) != 1
    ):
        raise ValueError(
            f"gdn_recurrent: ssm_states must be fp32 or bf16 [num_slots, {hv}, {dk}, {dv}] with a contiguous last "
            f"dim, got {ssm_states.dtype} {tuple(ssm_states.shape)}"
        )
    nb = slots.shape[0]
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError("gdn_recurrent: slots must be a 1-D int32/int64 tensor")
    if query_start_loc.shape != (nb + 1,) or query_start_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gdn_recurrent: query_start_loc must be int32 [B+1={nb + 1}]")
    if has_initial_state.shape != (nb,) or has_initial_state.dtype != torch.bool:
        raise ValueError(f"gdn_recurrent: has_initial_state must be bool [B={nb}]")
    if intermediate_states is not None and (
        intermediate_states.shape != (t, hv, dk, dv) or not intermediate_states.is_contiguous()
    ):
        raise ValueError(
            f"gdn_recurrent: intermediate_states must be contiguous [{t}, {hv}, {dk}, {dv}], got "
            f"{tuple(intermediate_states.shape)}"
        )
    if intermediate_states is not None and intermediate_states.dtype != ssm_states.dtype:
        raise ValueError(
            f"gdn_recurrent: intermediate_states ({intermediate_states.dtype}) and ssm_states "
            f"({ssm_states.dtype}) must have one dtype (fp32 or bf16)"
        )
    norm = None if gated_norm is None else _check_gated_norm(gated_norm, t, hv, dv, nb, v.device)
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"gdn_recurrent: needs CUDA tensors (got {q.device}); use gdn_recurrent_ref on the CPU "
            "or set TRITON_INTERPRET=1"
        )
    if out is None:
        out = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    elif out.shape != (t, hv, dv) or not out.is_contiguous():
        raise ValueError(f"gdn_recurrent: out must be a contiguous [{t}, {hv}, {dv}] tensor")
    y = torch.empty_like(out) if norm is not None else None
    if nb == 0 or t == 0 or max_query_len <= 0:
        return out if y is None else y
    bv, warps = pick_block_v(nb, hv, dv)
    if block_v is not None:
        bv = block_v
    if num_warps is not None:
        warps = num_warps
    if dv % bv:
        raise ValueError(f"gdn_recurrent: block_v={bv} must divide Dv={dv}")
    _kernels().gdn_recurrent_kernel[(nb, hv, dv // bv)](
        q,
        q.stride(0),
        q.stride(1),
        k,
        k.stride(0),
        k.stride(1),
        v,
        v.stride(0),
        v.stride(1),
        a,
        a.stride(0),
        b,
        b.stride(0),
        A_log,
        dt_bias,
        ssm_states,
        ssm_states.stride(0),
        ssm_states.stride(1),
        ssm_states.stride(2),
        slots,
        query_start_loc,
        has_initial_state.view(torch.uint8),  # bool as bytes (the interpreter mis-loads i1)
        out,
        intermediate_states if intermediate_states is not None else out,
        *_norm_args(norm, y, out),
        dk**-0.5,
        HV=hv,
        GROUP=hv // hk,
        DK=dk,
        DV=dv,
        BLOCK_V=bv,
        STORE_ALL=intermediate_states is not None,
        NORM=norm is not None,
        EARLY_STATE=_EARLY_STATE,
        num_warps=warps,
        **pdl_launch(q.device),
    )
    return out if y is None else y


def _check_gated_norm(gated_norm, t: int, hv: int, dv: int, nb: int, device: torch.device):
    """:func:`gdn_recurrent`'s ``gated_norm`` checked: ``(z, weight, eps, counter)`` with z float ``[t, hv, dv]`` (last
    dim contiguous), weight float ``[dv]``, counter a contiguous int32 tensor of at least ``nb * hv`` elements, all on
    ``device``. Returns the four (weight contiguous, eps as a float).

    Raises:
        ValueError: a malformed tuple, z / weight / counter of the wrong shape, dtype or device, or ``dv`` not a power
        of two."""
    if not isinstance(gated_norm, tuple) or len(gated_norm) != 4:
        raise ValueError("gdn_recurrent: gated_norm must be a (z, weight, eps, counter) tuple")
    z, weight, eps, counter = gated_norm
    if not isinstance(z, torch.Tensor) or z.shape != (t, hv, dv) or not z.is_floating_point() or z.stride(2) != 1:
        raise ValueError(f"gdn_recurrent: gated_norm's z must be a float [{t}, {hv}, {dv}] tensor with a contiguous "
                         f"last dim, got {getattr(z, 'dtype', z)} {tuple(getattr(z, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or weight.shape != (dv,) or not weight.is_floating_point():
        raise ValueError(f"gdn_recurrent: gated_norm's weight must be a float [{dv}] tensor")
    if dv & (dv - 1):
        raise ValueError(f"gdn_recurrent: gated_norm needs Dv a power of two, got {dv}")
    if (not isinstance(counter, torch.Tensor) or counter.dtype != torch.int32 or not counter.is_contiguous()
            or counter.numel() < nb * hv):
        raise ValueError("gdn_recurrent: gated_norm's counter must be a contiguous int32 tensor of at least "
                         f"B * Hv = {nb * hv} elements")
    if any(x.device != device for x in (z, weight, counter)):
        raise ValueError(f"gdn_recurrent: gated_norm's tensors must be on {device}")
    return z, weight.contiguous(), float(eps), counter


def _norm_args(norm, y: torch.Tensor | None, out: torch.Tensor) -> tuple:
    """The recurrent kernel's norm-tail arguments (z, its token and head strides, weight, y, counter, eps) for a
    checked ``gated_norm`` (:func:`_check_gated_norm`), or placeholders where there is none (NORM off)."""
    if norm is None:
        return out, 0, 0, out, out, out, 0.0
    z, weight, eps, counter = norm
    return z, z.stride(0), z.stride(1), weight, y, counter, eps
