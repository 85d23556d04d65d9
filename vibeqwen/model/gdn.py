"""Gated DeltaNet token mixer (the 3-of-4 linear-attention layers of Qwen3.6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vibeqwen.config import ModelConfig
from vibeqwen.model.state import ForwardBatch
from vibeqwen.model.weights import Weights
from vibeqwen_kernels import causal_conv1d_ref, gated_rms_norm_ref, gdn_chunk_ref, gdn_recurrent_ref


class GatedDeltaNet:
    """in_proj_qkv -> causal conv1d + SiLU -> gated delta rule -> gated RMSNorm(z) -> out_proj.

    g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) (DESIGN.md section 1). Prefill chunks use
    the chunked form, single-token decodes the recurrent form; both read and write the sequence's GDN
    state slot in `batch.cache`.
    """

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, layer: int):
        self.cfg, self.layer = cfg, layer
        self.in_proj_qkv = w.linear(prefix + "in_proj_qkv")
        self.in_proj_z = w.linear(prefix + "in_proj_z")
        self.in_proj_b = w.linear(prefix + "in_proj_b")
        self.in_proj_a = w.linear(prefix + "in_proj_a")
        self.conv_weight = w.param(prefix + "conv1d.weight").squeeze(1)  # [C, W]
        self.A_log = w.param(prefix + "A_log", torch.float32)
        self.dt_bias = w.param(prefix + "dt_bias", torch.float32)
        self.norm_weight = w.param(prefix + "norm.weight")
        self.out_proj = w.linear(prefix + "out_proj")

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        cfg = self.cfg
        t = x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        mixed = self.in_proj_qkv(x)  # [T, C]
        z = self.in_proj_z(x).view(t, hv, dv)
        beta = torch.sigmoid(self.in_proj_b(x).float())  # [T, Hv]
        g = -self.A_log.exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [T, Hv]
        core = torch.empty(t, hv, dv, dtype=x.dtype, device=x.device)
        conv_states, ssm_states = batch.cache.conv[self.layer], batch.cache.ssm[self.layer]
        for i, sl, ctx in batch.sequences():
            slot = batch.gdn_slots[i]
            # a sequence's first chunk starts from zero state, whatever a previous owner left in the slot
            conv0, ssm0 = (None, None) if ctx == 0 else (conv_states[slot].clone(), ssm_states[slot].clone())
            conv_out, conv_states[slot] = causal_conv1d_ref(mixed[sl], self.conv_weight, conv0)
            q, k, v = torch.split(conv_out, [cfg.gdn_key_dim, cfg.gdn_key_dim, cfg.gdn_value_dim], dim=-1)
            n = q.shape[0]
            args = (q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g[sl], beta[sl], ssm0)
            if batch.keep_states[i]:
                # speculative verification: keep the state after every token so the engine can roll back
                o, all_ssm = gdn_recurrent_ref(*args, output_all_states=True)
                ssm_states[slot] = all_ssm[-1]
                w = self.conv_weight.shape[-1]
                window = torch.cat([conv0 if conv0 is not None else mixed.new_zeros(mixed.shape[1], w - 1),
                                    mixed[sl].t().to(conv_states.dtype)], dim=1)  # [C, W-1+n]
                all_conv = window.unfold(1, w - 1, 1)[:, 1:].permute(1, 0, 2)  # [n, C, W-1]
                batch.gdn_history[(self.layer, i)] = (all_conv, all_ssm)
            else:
                o, ssm_states[slot] = gdn_recurrent_ref(*args) if n == 1 else gdn_chunk_ref(*args)
            core[sl] = o
        out = gated_rms_norm_ref(core, z, self.norm_weight, cfg.rms_norm_eps)
        return self.out_proj(out.reshape(t, hv * dv))
