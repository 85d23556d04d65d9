"""The multi-token-prediction (MTP) head: one extra decoder layer that drafts the token after next.

Input at position p: the target's final (normed) hidden state h_p and the embedding of token p+1; output:
a hidden state whose LM-head logits predict token p+2. Drafting k tokens runs it k times, feeding its own
output hidden state back with the token it just drafted. It has its own attention KV cache (cache layer id
`num_hidden_layers`, sharing the sequence's block table) and shares the embedding and LM head with the
target. Weights: `mtp.fc` [H, 2H], `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`
(gated attention + MoE), `mtp.norm` (DESIGN.md section 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vibeqwen.config import ModelConfig
from vibeqwen.model.layers import rotary_cos_sin
from vibeqwen.model.state import ForwardBatch
from vibeqwen.model.weights import Weights
from vibeqwen_kernels import rms_norm_ref


class MTPHead:
    """The MTP draft head built from `mtp.*` weights; `forward` as documented below, shapes per token."""
    def __init__(self, cfg: ModelConfig, w: Weights, embed_tokens: torch.Tensor):
        from vibeqwen.model.qwen import DecoderLayer

        self.cfg = cfg
        self.cache_layer = cfg.num_hidden_layers
        self.embed_tokens = embed_tokens
        self.fc = w.linear("mtp.fc")
        self.norm_embedding = w.param("mtp.pre_fc_norm_embedding.weight")
        self.norm_hidden = w.param("mtp.pre_fc_norm_hidden.weight")
        self.layer = DecoderLayer(cfg, w, "mtp.layers.0.", self.cache_layer, "full_attention")
        self.norm = w.param("mtp.norm.weight")

    @torch.inference_mode()
    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """next_ids: [T] tokens p+1; hidden: [T, H] normed hidden states of positions p; positions: [T] = p.
        Writes the MTP layer's K/V at positions p. Returns normed MTP hidden states [T, H].

        The GPU path (`DecoderLayer.fast`) runs the norms as fused kernels (`norm_fused.rms_norm`: the two input
        norms straight into the halves of fc's input, the final one fused with the layer's residual add, as the
        target model's final norm) and takes the positions from `batch` (its rotary embedding is in the
        attention kernels): the reference's values up to fp32 summation order."""
        eps = self.cfg.rms_norm_eps
        if self.layer.fast:
            from vibeqwen_kernels.norm_fused import rms_norm

            t, d = hidden.shape
            x = torch.empty(t, 2 * d, dtype=hidden.dtype, device=hidden.device)  # [norm(e) | norm(h)]
            rms_norm(F.embedding(next_ids, self.embed_tokens), self.norm_embedding, eps, out=x[:, :d])
            rms_norm(hidden, self.norm_hidden, eps, out=x[:, d:])
            delta, residual = self.layer.forward_gpu(self.fc(x), None, batch)
            return rms_norm(delta, self.norm, eps, residual=residual)[0]
        e = rms_norm_ref(F.embedding(next_ids, self.embed_tokens), self.norm_embedding, eps)
        h = rms_norm_ref(hidden, self.norm_hidden, eps)
        x = self.fc(torch.cat([e, h], dim=-1))
        cos, sin = rotary_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta, x.dtype)
        x = self.layer(x, cos, sin, batch)
        return rms_norm_ref(x, self.norm, eps)


def draft_tokens(model, hidden: torch.Tensor, steps: list[ForwardBatch]) -> torch.Tensor:
    """Greedy MTP drafts from the MTP hidden states of each sequence's last known position.

    hidden: [n, H] (the MTP head's output there); steps: the k - 1 one-token passes' batches (sequence i's
    position in pass s: its last known position + 1 + s; the K/V written there are provisional, rewritten by
    the next step's MTP pass over verified positions). Draft 0 is the LM head's argmax at `hidden`, draft s + 1
    the argmax after pass s, which reads (hidden, draft) of pass s - 1's output. Returns int64 [n, k] on the
    device; nothing here reads back to the host, but an MTP layer with BF16 experts (the vendors' checkpoints)
    runs the reference MoE loop, which does once a pass. Where the MoE runs the GPU kernels it is CUDA-graph
    capturable with static metadata (`vibeqwen.model.mtp_graphs`). Raises ValueError (`DeviceBatch.build`) where
    a block table does not cover its sequence's position in a pass."""
    tok = model.logits(hidden).argmax(-1)
    drafted, h = [tok], hidden
    for batch in steps:
        positions = batch.device_batch().positions if model.fast else batch.positions(hidden.device)
        h = model.mtp.forward(tok, h, positions, batch)
        tok = model.logits(h).argmax(-1)
        drafted.append(tok)
    return torch.stack(drafted, dim=1)
