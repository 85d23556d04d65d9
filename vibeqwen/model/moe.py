"""Sparse MoE block: top-k routed SwiGLU experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

import torch

from vibeqwen.checkpoint.layout import Precision
from vibeqwen.config import ModelConfig
from vibeqwen.model.quant_linear import DenseLinear
from vibeqwen.model.weights import Weights
from vibeqwen_kernels import moe_experts_ref, route_topk_ref, swiglu_mlp_ref


class SparseMoE:
    """out = sum_k w_k * expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x).

    Routing: softmax in float32 over `num_experts`, top `num_experts_per_tok`, renormalised.
    """

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str):
        self.top_k = cfg.num_experts_per_tok
        self.fast = w.fast and _all_nvfp4(cfg, w, prefix)
        if self.fast:
            self._build_gpu(cfg, w, prefix)
            return
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
        if self.fast:
            return self.forward_gpu(x)
        weights, ids = route_topk_ref(self.router(x), self.top_k)
        routed = moe_experts_ref(x, weights, ids, self.w_gate, self.w_up, self.w_down)
        shared = swiglu_mlp_ref(x, *self.shared) * torch.sigmoid(self.shared_gate(x))
        return routed + shared

    def _build_gpu(self, cfg: ModelConfig, w: Weights, prefix: str) -> None:
        from vibeqwen_kernels.moe.fused import prepack_moe_nvfp4

        # router logits and the shared expert's gate logit from one GEMM: [E + 1, H], padded with zero rows to
        # a multiple of 8 (257 output columns select cuBLAS's unaligned sm75 kernels: 3-4x slower at b32)
        rows = torch.cat([w.param(prefix + "gate.weight"), w.param(prefix + "shared_expert_gate.weight")])
        self.router_cols = rows.shape[0]
        pad = -self.router_cols % 8
        self.router_gate = DenseLinear(torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]).contiguous())
        names = [f"{prefix}experts.{e}." for e in range(cfg.num_experts)] + [prefix + "shared_expert."]

        def parts(proj: str):
            return [tuple(w.tensors[f"{n}{proj}.{leaf}"].to(w.device) for leaf in ("weight", "weight_scale",
                                                                                     "weight_scale_2"))
                    for n in names]

        # the shared expert is expert number E, gated by sigmoid(shared_expert_gate(x))
        self.experts = prepack_moe_nvfp4(parts("gate_proj"), parts("up_proj"), parts("down_proj"), w.device)
        # decode batches (1-64 tokens, route_cuda.route_model_max_t): router GEMM, routing and alignment in one CUDA
        # launch, where it builds and takes these shapes (decided once, here; forward_gpu checks only the batch's size
        # and dtype)
        self.route = None
        if w.device.type == "cuda":
            from vibeqwen_kernels.moe import route_cuda

            if route_cuda.route_enabled(w.device):
                # the same shuffled rows as router_gate's MMA copy (E + 1 rows, zero rows up to a multiple of 16)
                mma = self.router_gate.mma
                route = route_cuda.prepack_router(w.param(prefix + "gate.weight"),
                                                  w.param(prefix + "shared_expert_gate.weight"),
                                                  packed=mma.packed if mma is not None else None)
                if route_cuda.route_supported(route, 1, self.top_k, w.device):
                    self.route = route
        # decode batches of up to decode_cuda.MODEL_MAX_T tokens (1 by default): the whole block in one CUDA launch
        # (router, shared expert, routed experts, slot sum; the same routing as the route + fused_moe launches, their
        # fp32 sums in another order), with its own persistent scratch
        self.decode_ws, self.decode_max_t = None, 0
        if self.route is not None:
            from vibeqwen_kernels.moe import decode_cuda

            while self.decode_max_t < decode_cuda.MODEL_MAX_T and decode_cuda.decode_supported(
                    self.route, self.experts, self.decode_max_t + 1, self.top_k, w.device):
                self.decode_max_t += 1
            if self.decode_max_t:
                self.decode_ws = decode_cuda.make_workspace(self.route.tiles, self.top_k, self.experts.intermediate,
                                                            w.device)

    def forward_gpu(self, x: torch.Tensor) -> torch.Tensor:
        """Fused router (softmax, top-k, renormalise, shared-expert gate) and the grouped NVFP4 expert GEMMs
        (`vibeqwen_kernels.moe.fused`), or for up to ``decode_max_t`` tokens all of it in one launch (`vibeqwen_kernels.moe.decode_cuda`).
        x: [T, H] -> [T, H]."""
        from vibeqwen_kernels.moe import decode_cuda
        from vibeqwen_kernels.moe.fused import fused_moe, fused_router, pick_moe_config
        from vibeqwen_kernels.moe.route_cuda import fused_route, route_model_max_t

        t = x.shape[0]
        if 1 <= t <= self.decode_max_t and x.dtype == torch.bfloat16:
            return decode_cuda.moe_decode(x, self.route, self.experts, self.top_k, self.decode_ws)
        if self.route is not None and 1 <= t <= route_model_max_t() and x.dtype == torch.bfloat16:
            e = self.experts
            cfg = pick_moe_config(t, self.top_k + 1, e.num_experts, hidden=e.hidden, intermediate=e.intermediate)
            weights, ids, sorted_ids, block_expert, _ = fused_route(x, self.route, self.top_k, cfg["BLOCK_M"])
            return fused_moe(x, weights, ids, e, cfg, align=(sorted_ids, block_expert, cfg["BLOCK_M"]))
        weights, ids = fused_router(self.router_gate(x)[:, : self.router_cols], self.top_k)
        return fused_moe(x, weights, ids, self.experts)


def _all_nvfp4(cfg: ModelConfig, w: Weights, prefix: str) -> bool:
    """The fused MoE reads NVFP4 experts; other precisions keep the reference experts."""
    paths = [f"{prefix}experts.{e}.{p}" for e in range(cfg.num_experts) for p in ("gate_proj", "up_proj", "down_proj")]
    paths += [f"{prefix}shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    return all(w.precisions.get(p) == Precision.NVFP4 for p in paths)
