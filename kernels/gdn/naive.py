"""Gated DeltaNet (gated delta rule), reference implementations: token-by-token and chunked.

Per value head, with state S [Dk, Dv] (float32 arithmetic; a bfloat16 input state is upcast) and per token t:
    S <- exp(g_t) * S
    u_t = beta_t * (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = S^T q_t
q and k are L2-normalised (eps 1e-6 inside the rsqrt, as fla and the HF oracle do) and q is scaled by
1/sqrt(Dk). Value head j reads key head j // (Hv / Hk). Source: Yang et al., "Gated Delta Networks"
(arXiv 2412.06464), and HF `torch_recurrent_gated_delta_rule`.
"""

from __future__ import annotations

import torch


def _prepare(q, k, v, g, beta, state):
    t, hk, dk = k.shape
    hv = v.shape[1]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    rep = hv // hk
    q = q.float().repeat_interleave(rep, dim=1)  # [T, Hv, Dk]
    k = k.float().repeat_interleave(rep, dim=1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if state is None:
        state = q.new_zeros(hv, dk, v.shape[-1])
    return q, k, v.float(), g.float(), beta.float(), state.float()


def gdn_recurrent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    output_all_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, one token at a time (the decode form), for one sequence.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay, <= 0): [T, Hv]; beta in (0, 1): [T, Hv];
    state: [Hv, Dk, Dv] float32 or bfloat16 (upcast) or None (zeros). Returns (o [T, Hv, Dv] in v's dtype, final
    state [Hv, Dk, Dv] float32), or with output_all_states the state after every token [T, Hv, Dk, Dv] float32
    (what speculative decoding rolls back to). The input state is not modified. The running state is never
    rounded: a caller storing into a bfloat16 state (EngineConfig.gdn_state_dtype) rounds what it stores
    (`.to(torch.bfloat16)`, round to nearest even), as the kernels do.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state)
    out = torch.empty_like(v)
    states = []
    for t in range(v.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv = torch.einsum("hkv,hk->hv", s, k[t])
        u = beta[t][:, None] * (v[t] - kv)
        s = s + k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
        if output_all_states:
            states.append(s)
    return out.to(out_dtype), torch.stack(states) if output_all_states else s


def gdn_chunk_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule in chunked (prefill) form; same arguments and results as `gdn_recurrent_ref`.

    Within a chunk with cumulative log decay c_t = sum_{s<=t} g_s and initial state S0, the updates
    U = [u_1..u_C] solve the unit lower-triangular system (I + A) U = beta*V - beta*exp(c)*K S0 with
    A[t, s] = beta_t exp(c_t - c_s) k_t.k_s (s < t); then
    o_t = exp(c_t) S0^T q_t + sum_{s<=t} exp(c_t - c_s) (k_s.q_t) u_s and
    S_C = exp(c_C) S0 + sum_s exp(c_C - c_s) k_s u_s^T.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state)
    t_total = v.shape[0]
    out = torch.empty_like(v)
    # heads first: [Hv, T, D]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    g, beta = g.t(), beta.t()  # [Hv, T]
    for start in range(0, t_total, chunk_size):
        end = min(start + chunk_size, t_total)
        qc, kc, vc = q[:, start:end], k[:, start:end], v[:, start:end]
        bc = beta[:, start:end, None]  # [Hv, C, 1]
        c = g[:, start:end].cumsum(-1)  # [Hv, C]
        n = end - start
        decay = (c[:, :, None] - c[:, None, :])  # [Hv, C, C]: c_t - c_s
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        a = torch.where(lower, (bc * kc) @ kc.transpose(1, 2) * decay.exp(), 0.0)
        eye = torch.eye(n, device=q.device).expand_as(a)
        rhs = bc * vc - (bc * c.exp()[..., None] * kc) @ s  # [Hv, C, Dv]
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        attn = torch.where(causal, qc @ kc.transpose(1, 2) * torch.where(causal, decay, 0.0).exp(), 0.0)
        o = c.exp()[..., None] * (qc @ s) + attn @ u
        out[start:end] = o.transpose(0, 1)
        last = c[:, -1:]  # [Hv, 1]
        s = last.exp()[..., None] * s + (kc * (last - c).exp()[..., None]).transpose(1, 2) @ u
    return out.to(out_dtype), s
