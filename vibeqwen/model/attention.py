"""Gated full attention (every 4th layer of Qwen3.6): q/k RMSNorm, partial RoPE, GQA, sigmoid output gate."""

from __future__ import annotations

import os

import torch
from vibeqwen_kernels import attention_ref, rms_norm_ref

from vibeqwen.config import ModelConfig
from vibeqwen.model.layers import apply_rotary
from vibeqwen.model.quant_linear import fused_linear, gpu_linear
from vibeqwen.model.state import ForwardBatch
from vibeqwen.model.weights import Weights


class GatedAttention:
    """q_proj yields per head [query | gate]; out = o_proj(attention(q, k, v) * sigmoid(gate))."""

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, layer: int):
        self.cfg, self.layer = cfg, layer
        self.fast = w.fast
        self.q_norm = w.param(prefix + "q_norm.weight")
        self.k_norm = w.param(prefix + "k_norm.weight")
        if self.fast:
            # decode-sized batches: the norm, RoPE and cache store inside the split-KV kernel (opt-in, see forward_gpu)
            self.fused_decode = os.environ.get("VIBEQWEN_FUSED_ATTENTION", "0") == "1"
            # q_proj | k_proj | v_proj as one weight (they read the same input)
            self.qkv_proj, self.qkv_sizes = fused_linear(w, [prefix + n for n in ("q_proj", "k_proj", "v_proj")])
            self.o_proj = gpu_linear(w, prefix + "o_proj")
            return
        self.q_proj = w.linear(prefix + "q_proj")
        self.k_proj = w.linear(prefix + "k_proj")
        self.v_proj = w.linear(prefix + "v_proj")
        self.o_proj = w.linear(prefix + "o_proj")

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: [T, H]; cos, sin: [T, rotary_dim] for each token's position. Returns [T, H]."""
        if self.fast:
            return self.forward_gpu(x, batch)
        cfg = self.cfg
        t, hq, hkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, gate = self.q_proj(x).view(t, hq, 2 * d).chunk(2, dim=-1)
        q = apply_rotary(rms_norm_ref(q, self.q_norm, cfg.rms_norm_eps), cos, sin)
        k = apply_rotary(rms_norm_ref(self.k_proj(x).view(t, hkv, d), self.k_norm, cfg.rms_norm_eps), cos, sin)
        v = self.v_proj(x).view(t, hkv, d)
        out = torch.empty(t, hq, d, dtype=x.dtype, device=x.device)
        # [num_blocks * block_size, Hkv, D] views of this layer's paged cache
        k_cache = batch.cache.k[self.layer].view(-1, hkv, d)
        v_cache = batch.cache.v[self.layer].view(-1, hkv, d)
        for i, sl, ctx in batch.sequences():
            every = batch.sequence_kv_slots(i, x.device)  # positions 0 .. ctx + n - 1
            new = every[ctx:]
            k_cache[new] = k[sl].to(k_cache.dtype)
            v_cache[new] = v[sl].to(v_cache.dtype)
            out[sl] = attention_ref(q[sl], k_cache[every].to(x.dtype), v_cache[every].to(x.dtype), d**-0.5)
        out = out.reshape(t, hq * d) * torch.sigmoid(gate.reshape(t, hq * d))
        return self.o_proj(out)

    @property
    def input_projection(self):
        """The fused QKV projection (GPU path): what the layer's norm may quantize its output for."""
        return self.qkv_proj

    @property
    def output_projection(self):
        """The output projection (GPU path): what `forward_gpu(..., project=False)`'s result goes into."""
        return self.o_proj

    def forward_gpu(self, x: torch.Tensor, batch: ForwardBatch, xq=None, project: bool = True) -> torch.Tensor:
        """The GPU path: fused QKV projection, one kernel for q/k norm + RoPE + the KV-cache write, and paged
        attention over the whole batch (`vibeqwen_kernels.attention.paged`); with ``VIBEQWEN_FUSED_ATTENTION=1``
        (read when the layer is built) decode-sized batches (max_query_len <= SPLIT_MAX_Q: decode, verification) run
        the norm, RoPE and cache write inside the split-KV kernel instead (`vibeqwen_kernels.attention.decode_fused`; off by default: see
        bench/results/h200_notes.md, twentieth session). x: [T, H] -> [T, H]. xq: x quantized for a W8A8 QKV projection
        (`QuantizedRows`) or None. project=False: returns o_proj's input ([T, Hq * D]) instead, for the caller to
        fuse what follows."""
        from vibeqwen_kernels.attention.decode_fused import fused_decode_attention
        from vibeqwen_kernels.attention.paged import SPLIT_MAX_Q, paged_attention
        from vibeqwen_kernels.attention.rope_norm import qk_norm_rope_store

        cfg, meta = self.cfg, batch.device_batch()
        t, hq, hkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = self.qkv_proj(x, xq=xq)
        nq, nk, _ = self.qkv_sizes
        qg = qkv[:, :nq].view(t, hq, 2 * d)
        k = qkv[:, nq : nq + nk].view(t, hkv, d)
        v = qkv[:, nq + nk :].view(t, hkv, d)
        k_cache, v_cache = batch.cache.k[self.layer], batch.cache.v[self.layer]
        norm_args = (qg, k, v, self.q_norm, self.k_norm, cfg.rms_norm_eps, meta.positions, cfg.rotary_dim,
                     cfg.rope_theta)
        # the output gate sigmoid(gate half of q_proj) fused into the attention kernel's store
        if self.fused_decode and 1 <= meta.max_query_len <= SPLIT_MAX_Q:
            out = fused_decode_attention(*norm_args, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                                         meta.seq_lens, meta.query_start_loc, d**-0.5, meta.max_query_len,
                                         gate=qg[..., d:])
        else:
            q = qk_norm_rope_store(*norm_args, k_cache, v_cache, meta.slot_mapping)
            out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  d**-0.5, meta.max_query_len, gate=qg[..., d:])
        out = out.reshape(t, hq * d)
        return self.o_proj(out) if project else out
