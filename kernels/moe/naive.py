"""Mixture-of-experts routing and expert evaluation, reference implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_topk_ref(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (float32) over experts, top-k, renormalise the k weights to sum to 1.

    router_logits: [T, E]. Returns (weights [T, k] float32, expert ids [T, k] int64), weights sorted
    descending. Source: Qwen3.5/3.6 `TopKRouter` (HF `Qwen3_5MoeTopKRouter`).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def swiglu_mlp_ref(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)). x: [T, H]; w_gate, w_up: [I, H]; w_down: [H, I]. Returns [T, H]."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def moe_experts_ref(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * SwiGLU expert(x).

    x: [T, H]; weights: [T, k] float32; ids: [T, k]; w_gate, w_up: [E, I, H]; w_down: [E, H, I] (dense,
    x's dtype). Returns [T, H] in x's dtype. Loops over the experts that received tokens.
    """
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        y = swiglu_mlp_ref(x[tok], w_gate[e], w_up[e], w_down[e])
        # a token picks an expert at most once, so `tok` has no repeats
        out[tok] += (y * weights[tok, slot, None].to(y.dtype)).to(x.dtype)
    return out
