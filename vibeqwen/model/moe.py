"""Sparse MoE block: top-k routed SwiGLU experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

import torch

from vibeqwen.config import ModelConfig
from vibeqwen.model.weights import Weights
from vibeqwen_kernels import moe_experts_ref, route_topk_ref, swiglu_mlp_ref


class SparseMoE:
    """out = sum_k w_k * expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x).

    Routing: softmax in float32 over `num_experts`, top `num_experts_per_tok`, renormalised.
    """

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str):
        self.top_k = cfg.num_experts_per_tok
        self.router = w.linear(prefix + "gate")
        experts = range(cfg.num_experts)
        # [E, I, H] / [E, H, I] dense expert weights (reference path)
        self.w_gate = torch.stack([w.dense(f"{prefix}experts.{e}.gate_proj") for e in experts])
        self.w_up = torch.stack([w.dense(f"{prefix}experts.{e}.up_proj") for e in experts])
        self.w_down = torch.stack([w.dense(f"{prefix}experts.{e}.down_proj") for e in experts])
        self.shared = [w.dense(prefix + f"shared_expert.{n}") for n in ("gate_proj", "up_proj", "down_proj")]
        self.shared_gate = w.linear(prefix + "shared_expert_gate")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        weights, ids = route_topk_ref(self.router(x), self.top_k)
        routed = moe_experts_ref(x, weights, ids, self.w_gate, self.w_up, self.w_down)
        shared = swiglu_mlp_ref(x, *self.shared) * torch.sigmoid(self.shared_gate(x))
        return routed + shared
