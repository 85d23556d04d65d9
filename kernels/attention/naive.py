"""Causal grouped-query attention over a sequence's cached keys and values, reference implementation."""

from __future__ import annotations

import torch


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA for one sequence whose Tq newest tokens are the queries.

    q: [Tq, Hq, D]; k, v: [Tk, Hkv, D] with Tk >= Tq (the whole context, queries last); Hq % Hkv == 0,
    query head h reads kv head h // (Hq / Hkv). Query i (absolute position Tk - Tq + i) sees keys 0..Tk-Tq+i.
    Softmax in float32. Returns [Tq, Hq, D] in q's dtype.
    """
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    if tk < tq or hq % hkv:
        raise ValueError(f"bad attention shapes q={tuple(q.shape)} k={tuple(k.shape)}")
    rep = hq // hkv
    kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vf = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    scores = qf @ kf.transpose(1, 2) * scale  # [Hq, Tq, Tk]
    qpos = torch.arange(tk - tq, tk, device=q.device)[:, None]
    kpos = torch.arange(tk, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf  # [Hq, Tq, D]
    return out.transpose(0, 1).to(q.dtype)
