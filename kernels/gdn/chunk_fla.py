"""Gated DeltaNet chunked prefill through fla-core's ``chunk_gated_delta_rule`` (GPU, not graph-captured).

fla-core (``pip install fla-core``, import name ``fla``) is an optional GPU dependency, imported on first
call. Its conventions, checked against fla-core 0.6.0's source (fla/ops/gated_delta_rule/chunk.py,
fla/ops/common/chunk_delta_h.py):

* inputs ``[B, T, H, D]``; varlen batches are flattened to B = 1 with ``cu_seqlens`` (int64, N+1);
* GVA: value head ``i_h`` reads key head ``i_h // (HV // H)`` (same as ours: h // 2);
* state ``[N, HV, K, V]`` (K-first, i.e. our [Hv, Dk, Dv], unless ``state_v_first``), final state fp32;
* ``use_qk_l2norm_in_kernel`` normalises with ``x / sqrt(sum x^2 + 1e-6)`` (our eps), then q is scaled;
* g is the log decay (natural log, fla rescales by 1/ln 2 internally), beta post-sigmoid;
* inputs are made contiguous by fla's ``input_guard``; ``cu_seqlens``-derived index tensors are cached
  by tensor identity, so a fresh ``cu_seqlens`` is built on every call here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fla_available", "gdn_chunk_prefill"]


def _fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:  # pragma: no cover - depends on the host
        raise ImportError(
            "gdn_chunk_prefill needs fla-core (flash-linear-attention's kernels, import name `fla`): "
            "pip install fla-core (GPU hosts; see pyproject's [gpu] extra)"
        ) from e
    return chunk_gated_delta_rule


def fla_available() -> bool:
    """True when fla-core's gated delta rule imports (it also needs Triton and a working torch)."""
    try:
        _fla_chunk()
    except ImportError:
        return False
    return True


@torch.no_grad()
def gdn_chunk_prefill(
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
    query_start_loc_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated delta rule in chunked form for every sequence of a flattened batch (prefill); updates slots.

    Same contract as :func:`vibeqwen_kernels.gdn.recurrent.gdn_recurrent` (without intermediate states):
    per sequence b, ``gdn_chunk_ref(q, k, v, g, beta, S0)`` on its tokens with
    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (fp32, computed here in torch),
    ``S0 = ssm_states[slots[b]]`` if ``has_initial_state[b]`` else zeros; final state written back to
    ``ssm_states[slots[b]]``. Sequences with no tokens are skipped (slot untouched). Formula: Yang et
    al., arXiv 2412.06464 (chunked WY form); fla-core computes it.

    Args:
        q, k: ``[T, Hk, Dk]`` bf16/fp16 (fp32 works in fla too); strided views allowed (copied).
        v: ``[T, Hv, Dv]``, Hv a multiple of Hk; value head h reads key head h // (Hv // Hk).
        a, b: ``[T, Hv]`` raw gate projections.
        A_log, dt_bias: ``[Hv]`` fp32.
        ssm_states: ``[num_slots, Hv, Dk, Dv]`` fp32, updated in place.
        slots: ``[B]`` int32/int64; query_start_loc: ``[B+1]`` int32/int64; has_initial_state: ``[B]`` bool.
        max_query_len: unused (interface symmetry with :func:`gdn_recurrent`).
        query_start_loc_cpu: optional host copy of ``query_start_loc`` (the caller usually has it): saves
            the one device-to-host copy, a sync that stalls the launch queue once per GDN layer.

    Returns:
        ``o`` ``[T, Hv, Dv]`` in v's dtype. Rows not covered by any sequence are unspecified.

    Raises:
        ImportError: fla-core is not installed. ValueError: bad shapes or dtypes.

    Not CUDA-graph capturable: it reads the sequence lengths on the host (a sync unless
    ``query_start_loc_cpu`` is given) and fla allocates.
    """
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"gdn_chunk_prefill: q, k must be [T, Hk, Dk] and v [T, Hv, Dv], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if hv % hk:
        raise ValueError(f"gdn_chunk_prefill: Hv={hv} must be a multiple of Hk={hk}")
    if a.shape != (t, hv) or b.shape != (t, hv) or A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError("gdn_chunk_prefill: a, b must be [T, Hv] and A_log, dt_bias [Hv]")
    if ssm_states.dim() != 4 or ssm_states.shape[1:] != (hv, dk, dv) or ssm_states.dtype != torch.float32:
        raise ValueError(f"gdn_chunk_prefill: ssm_states must be fp32 [num_slots, {hv}, {dk}, {dv}]")
    nb = slots.shape[0]
    if query_start_loc.shape != (nb + 1,) or has_initial_state.shape != (nb,):
        raise ValueError("gdn_chunk_prefill: query_start_loc must be [B+1] and has_initial_state [B]")
    chunk = _fla_chunk()
    out = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    if nb == 0 or t == 0:
        return out

    dev = v.device
    if query_start_loc_cpu is not None:
        if tuple(query_start_loc_cpu.shape) != (nb + 1,) or query_start_loc_cpu.device.type != "cpu":
            raise ValueError("gdn_chunk_prefill: query_start_loc_cpu must be a CPU tensor [B+1]")
        qsl_cpu = query_start_loc_cpu.to(torch.int64)
    else:
        qsl_cpu = query_start_loc.to("cpu", torch.int64)  # a host sync
    lens = qsl_cpu[1:] - qsl_cpu[:-1]
    keep = torch.nonzero(lens > 0).flatten()
    if keep.numel() == 0:
        return out
    # the kept sequences' boundaries: empty sequences own no tokens, so the rest stay contiguous
    cu_cpu = torch.cat([qsl_cpu[keep], qsl_cpu[keep[-1] + 1 : keep[-1] + 2]])
    lo, hi = int(cu_cpu[0]), int(cu_cpu[-1])
    cu_cpu = cu_cpu - lo
    cu = cu_cpu.to(dev)  # fresh tensor every call (fla caches index tensors by identity)
    keep_dev = keep.to(dev)
    sel_slots = slots.to(dev, torch.int64).index_select(0, keep_dev)
    sel_init = has_initial_state.to(dev).index_select(0, keep_dev)

    h0 = ssm_states.index_select(0, sel_slots)  # [N, Hv, Dk, Dv] copy
    h0 = torch.where(sel_init[:, None, None, None], h0, torch.zeros((), device=dev, dtype=h0.dtype))

    g = -A_log.float().exp() * F.softplus(a[lo:hi].float() + dt_bias.float())  # [T', Hv] fp32
    beta = torch.sigmoid(b[lo:hi].float())
    q4 = q[lo:hi].contiguous().unsqueeze(0)
    k4 = k[lo:hi].contiguous().unsqueeze(0)
    v4 = v[lo:hi].contiguous().unsqueeze(0)
    o, ht = chunk(
        q4,
        k4,
        v4,
        g.unsqueeze(0),
        beta.unsqueeze(0),
        scale=dk**-0.5,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
    )
    out[lo:hi] = o[0].to(v.dtype)
    ssm_states.index_copy_(0, sel_slots, ht.to(torch.float32))
    return out
