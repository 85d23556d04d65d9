"""Qwen3.6-35B-A3B text model: the decoder stack and the language-model head (reference path)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from vibeqwen.checkpoint.layout import TEXT_PREFIX
from vibeqwen.config import ModelConfig
from vibeqwen.model.attention import GatedAttention
from vibeqwen.model.gdn import GatedDeltaNet
from vibeqwen.model.layers import rotary_cos_sin
from vibeqwen.model.moe import SparseMoE
from vibeqwen.model.quant_linear import NVFP4Linear, gpu_linear, w8a8_rows
from vibeqwen.model.mtp import MTPHead
from vibeqwen.model.state import ForwardBatch
from vibeqwen.model.weights import Weights
from vibeqwen_kernels import rms_norm_ref


class DecoderLayer:
    """x + mixer(norm(x)), then + moe(norm(x)); the mixer is GDN or gated attention by layer type."""

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, layer: int, layer_type: str):
        self.eps = cfg.rms_norm_eps
        self.is_attention = layer_type == "full_attention"
        self.input_norm = w.param(prefix + "input_layernorm.weight")
        self.post_norm = w.param(prefix + "post_attention_layernorm.weight")
        if self.is_attention:
            self.mixer = GatedAttention(cfg, w, prefix + "self_attn.", layer)
        else:
            self.mixer = GatedDeltaNet(cfg, w, prefix + "linear_attn.", layer)
        self.mlp = SparseMoE(cfg, w, prefix + "mlp.")
        self.fast = w.fast

    def __call__(self, x, cos, sin, batch: ForwardBatch) -> torch.Tensor:
        if self.fast:
            delta, residual = self.forward_gpu(x, None, batch)
            return residual + delta
        h = rms_norm_ref(x, self.input_norm, self.eps)
        h = self.mixer(h, cos, sin, batch) if self.is_attention else self.mixer(h, batch)
        x = x + h
        return x + self.mlp(rms_norm_ref(x, self.post_norm, self.eps))

    def forward_gpu(self, delta: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch):
        """The GPU path with the residual add fused into each RMSNorm: the layer's input is
        residual + delta (rounded to the activation dtype, as the reference's `x + h`; residual None: delta
        is the input). Returns (the MoE output, the residual stream before it)."""
        from vibeqwen_kernels.norm_fused import rms_norm

        # a W8A8 prompt pass: the norm also quantizes its output for the mixer's FP8 input projection
        quant = w8a8_rows(self.mixer.input_projection, delta.shape[0])
        hq = None
        if residual is None:
            h, residual = rms_norm(delta, self.input_norm, self.eps, quantize=quant), delta
            if quant:
                h, hq = h
        elif quant:
            h, residual, hq = rms_norm(delta, self.input_norm, self.eps, residual=residual, quantize=True)
        else:
            h, residual = rms_norm(delta, self.input_norm, self.eps, residual=residual)
        # the output projection, the residual add and the post-attention norm: fused where the projection can
        # (FP8Linear.add_rms_norm: its K split's reduce and the norm in one launch)
        mixed = self.mixer.forward_gpu(h, batch, xq=hq, project=False)
        proj = self.mixer.output_projection
        fused = proj.add_rms_norm(mixed, residual, self.post_norm, self.eps) if hasattr(proj, "add_rms_norm") else None
        if fused is None:
            fused = rms_norm(proj(mixed), self.post_norm, self.eps, residual=residual)
        h, residual = fused
        return self.mlp(h), residual


class Qwen3_5MoeForCausalLM:
    """The text tower. `forward` runs one flattened batch and returns final hidden states; `logits` applies
    the LM head to selected rows.

    Build with `from_weights`; the engine owns the per-sequence states passed in a `ForwardBatch`.
    """

    def __init__(self, cfg: ModelConfig, w: Weights, with_mtp: bool = False):
        self.cfg = cfg
        self.dtype = w.dtype
        self.device = w.device
        self.embed_tokens = w.param(TEXT_PREFIX + "embed_tokens.weight")  # [V, H]
        self.layers = [
            DecoderLayer(cfg, w, f"{TEXT_PREFIX}layers.{i}.", i, t) for i, t in enumerate(cfg.layer_types)
        ]
        self.norm = w.param(TEXT_PREFIX + "norm.weight")
        self.fast = w.fast
        self.lm_head = gpu_linear(w, "lm_head") if self.fast else w.linear("lm_head")  # [V, H]
        if isinstance(self.lm_head, NVFP4Linear):
            self.lm_head.enable_mma()  # the CUDA MMA kernels for 1-128 rows, where they run
        self.mtp = MTPHead(cfg, w, self.embed_tokens) if with_mtp else None

    @property
    def graph_capturable(self) -> bool:
        """Every layer runs GPU kernels without host syncs (so a decode pass can be captured in a CUDA graph);
        False when some part fell back to the reference path (e.g. BF16 experts)."""
        return self.fast and all(layer.mlp.fast for layer in self.layers)

    def enable_prefill_graphs(self, max_tokens: int) -> bool:
        """GPU path with fla-core: run the GDN layers' chunked prefill from CUDA graphs (`ChunkPrefillGraphs`:
        one replay per sequence of up to `max_tokens` tokens, every token bucket captured now, one set shared
        by the 30 layers). Returns whether they are on (a failed capture logs a warning and leaves prefill
        to fla-core's eager call)."""
        from vibeqwen.model.gdn import _fla_available

        if not (self.fast and self.device.type == "cuda" and _fla_available()):
            return False
        from vibeqwen_kernels.gdn.chunk_fla import ChunkPrefillGraphs

        c = self.cfg
        graphs = ChunkPrefillGraphs(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                                    c.linear_value_head_dim, self.dtype, self.device, max_tokens)
        try:
            graphs.capture_all()
        except Exception as e:  # noqa: BLE001 - an optional speed-up must never stop the engine: eager fla is correct
            logging.getLogger(__name__).warning("could not capture the GDN prefill CUDA graphs (%s); prefill "
                                                "runs fla-core eagerly", e)
            return False
        for layer in self.layers:
            if not layer.is_attention:
                layer.mixer.chunk_graphs = graphs
        return True

    @classmethod
    def from_weights(cls, cfg: ModelConfig, w: Weights, with_mtp: bool = False) -> "Qwen3_5MoeForCausalLM":
        """Build from loaded weights; with_mtp also builds the MTP draft head (needs `mtp.*` tensors)."""
        return cls(cfg, w, with_mtp)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [T] int64 (flattened over the batch). Returns final-normed hidden [T, H].

        Writes the new tokens' K/V into the paged cache and the sequences' GDN slots (batch.cache).
        """
        x = F.embedding(input_ids, self.embed_tokens)
        if self.fast:
            from vibeqwen_kernels.norm_fused import rms_norm

            delta, residual = x, None
            for layer in self.layers:
                delta, residual = layer.forward_gpu(delta, residual, batch)
            return rms_norm(delta, self.norm, self.cfg.rms_norm_eps, residual=residual)[0]
        cos, sin = rotary_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, batch)
        return rms_norm_ref(x, self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, vocab] float32. An NVFP4 LM head writes fp32 straight from its fp32
        accumulator: bf16 logits (8 significant bits) would make the top two of 248k logits an exact tie
        often enough to flip greedy tokens between batch shapes."""
        if isinstance(self.lm_head, NVFP4Linear):
            return self.lm_head(hidden, out_dtype=torch.float32)
        return self.lm_head(hidden).float()
