"""Gated DeltaNet chunked prefill through fla-core's ``chunk_gated_delta_rule`` (GPU).

fla-core (``pip install fla-core``, import name ``fla``) is an optional GPU dependency, imported on first
call. Its conventions, checked against fla-core 0.6.0's source (fla/ops/gated_delta_rule/chunk.py,
fla/ops/common/chunk_delta_h.py):

* inputs ``[B, T, H, D]``; varlen batches are flattened to B = 1 with ``cu_seqlens`` (int64, N+1);
* GVA: value head ``i_h`` reads key head ``i_h // (HV // H)`` (same as ours: h // 2);
* state ``[N, HV, K, V]`` (K-first, i.e. our [Hv, Dk, Dv], unless ``state_v_first``), final state fp32; the
  initial state is loaded ``.to(float32)`` in-kernel, but we always hand fla an fp32 one (a bf16 state slot,
  EngineConfig.gdn_state_dtype, is upcast on the way in and the fp32 final state rounded to it on the way out);
* ``use_qk_l2norm_in_kernel`` normalises with ``x / sqrt(sum x^2 + 1e-6)`` (our eps), then q is scaled;
* g is the log decay (natural log, fla rescales by 1/ln 2 internally), beta post-sigmoid;
* inputs are made contiguous by fla's ``input_guard``; ``cu_seqlens``-derived index tensors are cached
  by tensor identity, so a fresh ``cu_seqlens`` is built on every call here.

:func:`gdn_chunk_prefill` runs a batch eagerly (host-side sequence bookkeeping); :func:`gdn_chunk_padded`
runs one sequence padded to a fixed length without host reads, the body of every prefill CUDA graph.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from vibeqwen_kernels.gdn.recurrent import STATE_DTYPES
from vibeqwen_kernels.pdl import pdl_launch

__all__ = ["GRAPH_MIN_TOKENS", "ChunkPrefillGraphs", "bucket_sizes", "fla_available", "gdn_chunk_padded",
           "gdn_chunk_padded_slot", "gdn_chunk_prefill", "gdn_padded_inputs"]


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
    graphs: ChunkPrefillGraphs | None = None,
) -> torch.Tensor:
    """Gated delta rule in chunked form for every sequence of a flattened batch (prefill); updates slots.

    Same contract as :func:`vibeqwen_kernels.gdn.recurrent.gdn_recurrent` (without intermediate states):
    per sequence b, ``gdn_chunk_ref(q, k, v, g, beta, S0)`` on its tokens with
    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (fp32, computed here in torch),
    ``S0 = ssm_states[slots[b]]`` if ``has_initial_state[b]`` else zeros (upcast to fp32: fla gets an fp32
    initial state); final state (fp32 from fla) written back to ``ssm_states[slots[b]]`` in its dtype (bf16:
    rounded to nearest even, once per call). Sequences with no tokens are skipped (slot untouched). Formula: Yang et
    al., arXiv 2412.06464 (chunked WY form); fla-core computes it.

    Args:
        q, k: ``[T, Hk, Dk]`` bf16/fp16 (fp32 works in fla too); strided views allowed (copied).
        v: ``[T, Hv, Dv]``, Hv a multiple of Hk; value head h reads key head h // (Hv // Hk).
        a, b: ``[T, Hv]`` raw gate projections.
        A_log, dt_bias: ``[Hv]`` fp32.
        ssm_states: ``[num_slots, Hv, Dk, Dv]`` fp32 or bf16 (EngineConfig.gdn_state_dtype), updated in place.
        slots: ``[B]`` int32/int64; query_start_loc: ``[B+1]`` int32/int64; has_initial_state: ``[B]`` bool.
        max_query_len: unused (interface symmetry with :func:`gdn_recurrent`).
        query_start_loc_cpu: optional host copy of ``query_start_loc`` (the caller usually has it): saves
            the one device-to-host copy, a sync that stalls the launch queue once per GDN layer.
        graphs: optional :class:`ChunkPrefillGraphs` (needs ``query_start_loc_cpu``; every sequence at
            most ``graphs.max_tokens``): each sequence longer than :data:`GRAPH_MIN_TOKENS` replays a
            captured graph, and runs of consecutive shorter ones (decode tokens batched with a prompt chunk)
            run the recurrent kernel, instead of fla's ~1.5 ms of Python and launches per call.

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
    if ssm_states.dim() != 4 or ssm_states.shape[1:] != (hv, dk, dv) or ssm_states.dtype not in STATE_DTYPES:
        raise ValueError(f"gdn_chunk_prefill: ssm_states must be fp32 or bf16 [num_slots, {hv}, {dk}, {dv}], got "
                         f"{ssm_states.dtype} {tuple(ssm_states.shape)}")
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
    if graphs is not None and query_start_loc_cpu is not None and int(lens.max()) <= graphs.max_tokens:
        _run_with_graphs(graphs, q, k, v, a, b, A_log, dt_bias, ssm_states, slots, has_initial_state, qsl_cpu, out)
        return out
    # the kept sequences' boundaries: empty sequences own no tokens, so the rest stay contiguous
    cu_cpu = torch.cat([qsl_cpu[keep], qsl_cpu[keep[-1] + 1 : keep[-1] + 2]])
    lo, hi = int(cu_cpu[0]), int(cu_cpu[-1])
    cu_cpu = cu_cpu - lo
    # non_blocking: a pageable host tensor is staged at once, without the stream sync a blocking copy makes
    cu = cu_cpu.to(dev, non_blocking=True)  # fresh tensor every call (fla caches index tensors by identity)
    keep_dev = keep.to(dev, non_blocking=True)
    sel_slots = slots.to(dev, torch.int64).index_select(0, keep_dev)
    sel_init = has_initial_state.to(dev).index_select(0, keep_dev)

    h0 = ssm_states.index_select(0, sel_slots).float()  # [N, Hv, Dk, Dv] fp32 copy (.float(): no-op for fp32)
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
    ssm_states.index_copy_(0, sel_slots, ht.to(ssm_states.dtype))  # fp32 from fla; bf16 slots: rounded here
    return out


#: With graphs, sequences of up to this many tokens take the recurrent kernel (one launch per run of them).
GRAPH_MIN_TOKENS = 16


def _run_with_graphs(graphs, q, k, v, a, b, A_log, dt_bias, ssm_states, slots, has_initial_state, qsl_cpu, out):
    """gdn_chunk_prefill's graph path: per sequence of more than GRAPH_MIN_TOKENS tokens one replay (exact:
    see ChunkPrefillGraphs), per run of consecutive shorter sequences one recurrent-kernel launch on views
    of their rows. Every slot is read and written by its own sequence only, so the order does not matter."""
    qsl = qsl_cpu.tolist()
    n_seq = len(qsl) - 1
    lens = [qsl[i + 1] - qsl[i] for i in range(n_seq)]
    slots64 = slots.to(torch.int64)
    i = 0
    while i < n_seq:
        if lens[i] > GRAPH_MIN_TOKENS:
            s, e = qsl[i], qsl[i + 1]
            graphs.run(q[s:e], k[s:e], v[s:e], a[s:e], b[s:e], A_log, dt_bias, ssm_states, slots64[i : i + 1],
                       has_initial_state[i : i + 1], out[s:e])
            i += 1
            continue
        j = i
        while j < n_seq and lens[j] <= GRAPH_MIN_TOKENS:
            j += 1
        lo, hi = qsl[i], qsl[j]
        if hi > lo:
            sub = torch.tensor([x - lo for x in qsl[i : j + 1]], dtype=torch.int32).to(q.device, non_blocking=True)
            _recurrent(q[lo:hi], k[lo:hi], v[lo:hi], a[lo:hi], b[lo:hi], A_log, dt_bias, ssm_states, slots[i:j], sub,
                       has_initial_state[i:j], max(lens[i:j]), out=out[lo:hi])
        i = j


def _recurrent(*args, **kwargs):
    from vibeqwen_kernels.gdn.recurrent import gdn_recurrent

    return gdn_recurrent(*args, **kwargs)


def bucket_sizes(min_tokens: int, max_tokens: int) -> list[int]:
    """Token buckets of the prefill CUDA graphs: powers of two from min_tokens below max_tokens, then
    max_tokens (at least min_tokens). E.g. (128, 2048) -> [128, 256, 512, 1024, 2048], (128, 3000) -> [128,
    ..., 2048, 3000]."""
    out, b = [], min_tokens
    while b < max_tokens:
        out.append(b)
        b *= 2
    return out + [max(max_tokens, min_tokens)]


def _l2norm_heads(x: torch.Tensor) -> torch.Tensor:
    """x ``[..., D]`` / sqrt(sum x^2 + 1e-6) over D in fp32, back in x's dtype (fla's l2norm)."""
    xf = x.float()
    return (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _head_rows(x: torch.Tensor) -> torch.Tensor:
    """x ``[B, H, D]`` whose rows (H x D values) are contiguous, copying only when they are not."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def gdn_padded_inputs(q, k, v, a, b, A_log, dt_bias, n, ssm_states=None, slot=None, has_initial_state=None,
                      l2norm_qk: bool = False):
    """fla's inputs for ONE sequence of B rows of which the first n are real: contiguous q, k, v with rows >= n
    zeroed (with ``l2norm_qk``, q and k L2-normalised per head as fla's ``use_qk_l2norm_in_kernel`` does it:
    fp32, ``x / sqrt(sum x^2 + 1e-6)``, rounded once to their dtype; then call fla without it), the gates
    g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) (fp32 ``[B, Hv]``, zero for rows >= n) and,
    given a state slot, h0 = ``ssm_states[slot]`` upcast to fp32 (zeros unless ``has_initial_state``).

    On CUDA (and under Triton's interpreter) one launch of ``_gdn_padded_inputs_kernel`` instead of ~12 torch
    ops (three masked copies of q, k, v, the gate arithmetic, the state copy and its mask: 15 launches per GDN
    layer of a prefill graph); elsewhere the same in torch. Device ops only (CUDA-graph capturable).

    Args:
        q, k: ``[B, Hk, Dk]``; v: ``[B, Hv, Dv]`` (bf16 or any float; rows may be strided, e.g. views of the
            conv output); a, b: ``[B, Hv]`` raw gate projections; A_log, dt_bias: fp32 ``[Hv]``;
        n: integer tensor ``[1]`` on q's device (0 <= n <= B).
        ssm_states: fp32 or bf16 ``[num_slots, Hv, Dk, Dv]``, slot: int64 ``[1]``, has_initial_state: bool
            ``[1]``; all three or none.
        l2norm_qk: L2-normalise q and k per head (fp32, eps 1e-6 under the root) on the way: the caller then runs
            fla with ``use_qk_l2norm_in_kernel=False``.

    Returns:
        ``(q, k, v, g, beta, h0)``: q, k, v contiguous in their dtype, g and beta fp32 ``[B, Hv]``, h0 fp32
        ``[Hv, Dk, Dv]`` or None (no slot given).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit the above (checked before any kernel runs).
    """
    _check_padded_inputs(q, k, v, a, b, A_log, dt_bias, n, ssm_states, slot, has_initial_state)
    bsz, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    with_h0 = ssm_states is not None
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        pad = torch.arange(bsz, device=q.device) >= n  # [B]
        g = (-A_log.float().exp() * F.softplus(a.float() + dt_bias.float())).masked_fill(pad[:, None], 0.0)
        beta = torch.sigmoid(b.float()).masked_fill(pad[:, None], 0.0)
        if l2norm_qk:
            q, k = (_l2norm_heads(x) for x in (q, k))
        q, k, v = (x.masked_fill(pad[:, None, None], 0).contiguous() for x in (q, k, v))
        h0 = None
        if with_h0:
            h0 = ssm_states.index_select(0, slot)[0].float().masked_fill(~has_initial_state.view(1, 1, 1), 0.0)
        return q, k, v, g, beta, h0
    from vibeqwen_kernels.gdn._padded_kernels import _gdn_padded_inputs_kernel

    q, k, v = _head_rows(q), _head_rows(k), _head_rows(v)
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    qo, ko, vo = torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format), \
        torch.empty_like(v, memory_format=torch.contiguous_format)
    g = torch.empty((bsz, hv), dtype=torch.float32, device=q.device)
    beta = torch.empty_like(g)
    sd = hv * dk * dv
    block_s = 4096
    h0 = torch.empty((hv, dk, dv), dtype=torch.float32, device=q.device) if with_h0 else None
    grid = (bsz + (_cdiv(sd, block_s) if with_h0 else 0),)
    _gdn_padded_inputs_kernel[grid](
        q, k, v, q.stride(0), k.stride(0), v.stride(0),
        a, b, a.stride(0), b.stride(0), A_log.float(), dt_bias.float(),
        qo, ko, vo, g, beta,
        n, ssm_states if with_h0 else g, slot if with_h0 else n,
        has_initial_state.view(torch.uint8) if with_h0 else n, h0 if with_h0 else g,
        bsz, QD=hk * dk, VD=hv * dv, HV=hv, SD=sd, BLOCK=1024, BLOCK_H=_next_pow2(hv), BLOCK_S=block_s,
        HAS_H0=with_h0, L2NORM=bool(l2norm_qk), HK=hk, DK=dk, BLOCK_HK=_next_pow2(hk), BLOCK_DK=_next_pow2(dk),
        num_warps=4,
        **pdl_launch(q.device),
    )
    return qo, ko, vo, g, beta, h0


def _check_padded_inputs(q, k, v, a, b, A_log, dt_bias, n, ssm_states, slot, has_initial_state) -> None:
    """gdn_padded_inputs' argument checks (its kernel reads by the shapes it is given: a mismatch would read or
    write out of bounds)."""
    if q.dim() != 3 or tuple(k.shape) != tuple(q.shape) or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"gdn_padded_inputs: q, k must be [B, Hk, Dk] and v [B, Hv, Dv], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    bsz, hv = q.shape[0], v.shape[1]
    if tuple(a.shape) != (bsz, hv) or tuple(b.shape) != (bsz, hv):
        raise ValueError(f"gdn_padded_inputs: a and b must be [{bsz}, {hv}], got {tuple(a.shape)}, {tuple(b.shape)}")
    if tuple(A_log.shape) != (hv,) or tuple(dt_bias.shape) != (hv,):
        raise ValueError(f"gdn_padded_inputs: A_log and dt_bias must be [{hv}]")
    if not isinstance(n, torch.Tensor) or n.numel() != 1 or n.dtype.is_floating_point:
        raise ValueError("gdn_padded_inputs: n must be an integer tensor [1] (on q's device)")
    state = (ssm_states, slot, has_initial_state)
    if any(x is None for x in state) and any(x is not None for x in state):
        raise ValueError("gdn_padded_inputs: give ssm_states, slot and has_initial_state together, or none")
    if ssm_states is not None:
        want = (hv, q.shape[2], v.shape[2])
        if ssm_states.dim() != 4 or tuple(ssm_states.shape[1:]) != want or ssm_states.dtype not in STATE_DTYPES:
            raise ValueError(f"gdn_padded_inputs: ssm_states must be fp32 or bf16 [num_slots, {want[0]}, {want[1]}, "
                             f"{want[2]}]")
        if slot.numel() != 1 or has_initial_state.numel() != 1 or has_initial_state.dtype != torch.bool:
            raise ValueError("gdn_padded_inputs: slot must be an integer tensor [1], has_initial_state bool [1]")
    for x in (k, v, a, b, A_log, dt_bias, n, *(x for x in state if x is not None)):
        if x.device != q.device:
            raise ValueError(f"gdn_padded_inputs: every tensor must be on {q.device}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def gdn_chunk_padded(q, k, v, a, b, A_log, dt_bias, h0, n) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ONE sequence of B rows of which the first n are real, the rest padding;
    fla-core's chunked kernel on all B rows. CUDA-graph capturable: n is read on the device only, every
    shape is B's (one captured graph serves every n <= B).

    Exact padding: rows >= n get decay g = 0, beta = 0 and zero q, k, v. Such a token leaves the state
    unchanged (S <- exp(g) S + beta k (v - S^T k)^T = S) and, as padding follows every real token, no real
    token's output depends on it: rows < n equal the unpadded computation, and the final state is the state
    after token n. (Whatever the padding rows held, NaN included, is replaced, not multiplied.)

    Args:
        q, k: ``[B, Hk, Dk]``; v: ``[B, Hv, Dv]`` (bf16; strided views allowed).
        a, b: ``[B, Hv]`` raw gate projections (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)).
        A_log, dt_bias: ``[Hv]`` fp32.
        h0: ``[Hv, Dk, Dv]`` fp32 initial state (zeros for a sequence's first chunk).
        n: integer tensor ``[1]`` on q's device, 0 <= n <= B.

    Returns:
        ``(o [B, Hv, Dv] in fla's output dtype (v's), ht [Hv, Dk, Dv] fp32)``; o's rows >= n are
        unspecified (zero in exact arithmetic).

    Shared by :class:`ChunkPrefillGraphs` (static buffers, one graph per bucket) and the whole-chunk prefill
    graphs of the model (``vibeqwen.model.prefill_graphs``, through :func:`gdn_chunk_padded_slot`).
    """
    q, k, v, g, beta, _ = gdn_padded_inputs(q, k, v, a, b, A_log, dt_bias, n, l2norm_qk=True)
    return _chunk_one(q, k, v, g, beta, h0)


def _chunk_one(q, k, v, g, beta, h0) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked kernel over one sequence of prepared inputs (:func:`gdn_padded_inputs` with ``l2norm_qk``:
    q and k already normalised, which saves fla's two l2norm launches a layer): (o, ht)."""
    o, ht = _fla_chunk()(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                         scale=q.shape[-1] ** -0.5, initial_state=h0.unsqueeze(0), output_final_state=True,
                         use_qk_l2norm_in_kernel=False)
    return o[0], ht[0]


def gdn_chunk_padded_slot(q, k, v, a, b, A_log, dt_bias, ssm_states, slot, has_initial_state, n) -> torch.Tensor:
    """:func:`gdn_chunk_padded` reading and writing a state slot: the initial state is ``ssm_states[slot]``
    upcast to fp32 (zeros unless ``has_initial_state[0]``), the final state (after token n, fp32) replaces it,
    rounded to the slot's dtype. Device ops only (CUDA-graph capturable).

    ssm_states: fp32 or bf16 ``[num_slots, Hv, Dk, Dv]``; slot: int64 ``[1]``; has_initial_state: bool ``[1]``;
    other arguments as :func:`gdn_chunk_padded`. Returns o ``[B, Hv, Dv]`` (rows >= n unspecified)."""
    q, k, v, g, beta, h0 = gdn_padded_inputs(q, k, v, a, b, A_log, dt_bias, n, ssm_states, slot, has_initial_state,
                                             l2norm_qk=True)
    o, ht = _chunk_one(q, k, v, g, beta, h0)
    ssm_states.index_copy_(0, slot, ht.unsqueeze(0).to(ssm_states.dtype))
    return o


class ChunkPrefillGraphs:
    """CUDA graphs of fla's chunked gated delta rule for one sequence, one per bucket of tokens (powers of
    two from ``min_tokens``, and ``max_tokens``), captured by :meth:`capture_all` (or on first use) and shared
    by every GDN layer.

    Why: fla's Python (autograd Function, input guards, autotuner lookups, ~10 Triton launches) costs
    ~1.5 ms of host time per call, 30 calls per prefill pass: more than the GPU work of a 1k-token prefill.
    A replay costs one launch; the inputs are copied into the graph's static buffers.

    On a CPU device nothing is captured: the same padded computation runs eagerly (tests).

    Padding is exact: a sequence of n tokens runs in the bucket of B >= n tokens, the graph's body being
    :func:`gdn_chunk_padded` (padding tokens get g = 0, beta = 0, zero q, k, v: see there).

    Args:
        hk, hv, dk, dv: key / value heads and head dims. dtype: q, k, v dtype (bf16).
        max_tokens: the largest bucket (longer sequences take the eager path). min_tokens: the smallest.
    """

    def __init__(self, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, device: torch.device | str,
                 max_tokens: int, min_tokens: int = 128):
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.dtype, self.device = dtype, torch.device(device)
        self.min_tokens = min_tokens
        self.max_tokens = max(max_tokens, min_tokens)
        self.graphs: dict[int, dict] = {}
        self.pool = None

    def sizes(self) -> list[int]:
        """Every bucket: powers of two from min_tokens, and max_tokens (:func:`bucket_sizes`)."""
        return bucket_sizes(self.min_tokens, self.max_tokens)

    def capture_all(self) -> None:
        """Capture every bucket now (engine start: no capture, compile or sync in the middle of serving, and
        a failure shows before the first request). Raises what the capture raises."""
        for size in self.sizes():
            if size not in self.graphs:
                self.graphs[size] = self._capture(size)

    def bucket(self, n: int) -> int:
        """The smallest captured size holding n tokens (a power of two >= min_tokens, capped at max_tokens)."""
        b = self.min_tokens
        while b < n:
            b *= 2
        return min(b, self.max_tokens) if n <= self.max_tokens else b

    def _capture(self, size: int) -> dict:
        dev = self.device
        st = {
            "q": torch.zeros(size, self.hk, self.dk, dtype=self.dtype, device=dev),
            "k": torch.zeros(size, self.hk, self.dk, dtype=self.dtype, device=dev),
            "v": torch.zeros(size, self.hv, self.dv, dtype=self.dtype, device=dev),
            "a": torch.zeros(size, self.hv, dtype=self.dtype, device=dev),
            "b": torch.zeros(size, self.hv, dtype=self.dtype, device=dev),
            "A_log": torch.zeros(self.hv, dtype=torch.float32, device=dev),
            "dt_bias": torch.zeros(self.hv, dtype=torch.float32, device=dev),
            "h0": torch.zeros(self.hv, self.dk, self.dv, dtype=torch.float32, device=dev),
            "n": torch.zeros(1, dtype=torch.int64, device=dev),
            "o": torch.zeros(size, self.hv, self.dv, dtype=self.dtype, device=dev),
            "ht": torch.zeros(self.hv, self.dk, self.dv, dtype=torch.float32, device=dev),
        }
        st["n"].fill_(size)
        _fla_chunk()  # fail here, not inside a capture, when fla-core is missing

        def body():  # every tensor the graph reads is a static buffer of st (the graph keeps addresses)
            o, ht = gdn_chunk_padded(st["q"], st["k"], st["v"], st["a"], st["b"], st["A_log"], st["dt_bias"],
                                     st["h0"], st["n"])
            st["o"].copy_(o)
            st["ht"].copy_(ht)

        st["body"] = body
        if dev.type != "cuda":  # no capture (tests on the CPU): run() calls the body on the padded buffers
            st["graph"] = None
            return st
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and autotune outside the capture
                body()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            body()
        self.pool = graph.pool()  # captures share one pool: only static buffers outlive a replay
        st["graph"] = graph
        return st

    def run(self, q, k, v, a, b, A_log, dt_bias, ssm_states, slot, has_initial_state, out) -> None:
        """One sequence of n tokens (1 <= n <= max_tokens): q, k [n, Hk, Dk] and v [n, Hv, Dv] in the graphs'
        dtype, a, b [n, Hv] raw gate projections (strided views allowed), A_log, dt_bias [Hv] fp32; its state
        ssm_states[slot] (fp32 or bf16 [num_slots, Hv, Dk, Dv]; slot int64 [1]; zeros unless has_initial_state[0],
        bool [1]) is read (upcast into the graph's fp32 h0) and replaced by the final state (rounded to its dtype);
        out [n, Hv, Dv] gets the output. Shapes are not checked here (gdn_chunk_prefill checks them); a first use
        of a bucket captures it, which raises what the capture raises (e.g. torch.cuda.OutOfMemoryError)."""
        n = q.shape[0]
        size = self.bucket(n)
        st = self.graphs.get(size)
        if st is None:
            st = self.graphs[size] = self._capture(size)
        st["q"][:n].copy_(q)
        st["k"][:n].copy_(k)
        st["v"][:n].copy_(v)
        st["a"][:n].copy_(a)
        st["b"][:n].copy_(b)
        st["A_log"].copy_(A_log)  # each GDN layer has its own gate parameters
        st["dt_bias"].copy_(dt_bias)
        st["n"].fill_(n)
        if ssm_states.dtype == torch.float32:
            torch.index_select(ssm_states, 0, slot, out=st["h0"].unsqueeze(0))
        else:  # a bf16 state slot (EngineConfig.gdn_state_dtype): upcast into the fp32 static buffer
            st["h0"].copy_(ssm_states.index_select(0, slot)[0])
        st["h0"].masked_fill_(~has_initial_state.view(1, 1, 1), 0.0)
        if st["graph"] is not None:
            st["graph"].replay()
        else:
            st["body"]()
        out.copy_(st["o"][:n])
        ssm_states.index_copy_(0, slot, st["ht"].unsqueeze(0).to(ssm_states.dtype))
