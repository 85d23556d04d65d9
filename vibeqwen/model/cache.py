"""The model's cache tensors: a paged KV cache per attention layer and GDN state slots per GDN layer.

Which blocks and slots a sequence owns is decided on the CPU by `vibeqwen.engine.cache`; this module only
holds the tensors and sizes them. Layout (per layer):

    k[layer], v[layer]   [num_blocks + 1, block_size, Hkv, D]   compute dtype
    conv[layer]          [num_slots + 1, C, W-1]                compute dtype (the last W-1 conv inputs)
    ssm[layer]           [num_slots + 1, Hv, Dk, Dv]            state_dtype (the recurrent state): float32 or
                                                                bfloat16 (EngineConfig.gdn_state_dtype)

The last block and slot (`scratch_block`, `scratch_slot`) are never handed out: padding rows of a CUDA
graph read and write there.

Token at position p of a sequence with block table `bt` lives at flat KV slot bt[p // B] * B + p % B.
"""

from __future__ import annotations

import torch
from vibeqwen_kernels.gdn.recurrent import STATE_DTYPES

from vibeqwen.config import ModelConfig


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, extra_layers: int = 0) -> int:
    """Bytes one KV block takes across all attention layers (K and V), plus `extra_layers` (MTP)."""
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    return (len(cfg.attention_layers) + extra_layers) * block_size * per_token


def gdn_state_bytes(cfg: ModelConfig, state_dtype: torch.dtype) -> int:
    """Bytes of one GDN layer's recurrent state [Hv, Dk, Dv] in `state_dtype` (a slot's, or one token's in the
    verification history)."""
    return cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_dtype.itemsize


def gdn_bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
    """Bytes one GDN state slot takes across all GDN layers: conv state in the compute `dtype` + recurrent state in
    `state_dtype` (float32 or bfloat16, EngineConfig.gdn_state_dtype)."""
    conv = cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * dtype.itemsize
    return len(cfg.gdn_layers) * (conv + gdn_state_bytes(cfg, state_dtype))


class ModelCache:
    """Cache tensors for `num_blocks` KV blocks of `block_size` tokens and `num_slots` GDN state slots.

    `dtype`: KV and conv states (the compute dtype); `state_dtype`: the GDN recurrent state, float32 or bfloat16
    (EngineConfig.gdn_state_dtype; the `state_dtype` attribute)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 extra_attention_layers: tuple[int, ...] = (), state_dtype: torch.dtype = torch.float32):
        if num_blocks < 1 or block_size < 1 or num_slots < 1:
            raise ValueError(f"cache needs at least one block and slot, got {num_blocks=} {block_size=} {num_slots=}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"GDN state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
        self.state_dtype = state_dtype
        self.num_blocks, self.block_size, self.num_slots = num_blocks, block_size, num_slots
        self.device = torch.device(device)
        # one more block and slot than the engine hands out: padding rows of a CUDA graph write there
        self.scratch_block, self.scratch_slot = num_blocks, num_slots
        kv_shape = (num_blocks + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # extra_attention_layers: the MTP head's layer (id num_hidden_layers) shares the block tables
        attn = (*cfg.attention_layers, *extra_attention_layers)
        self.k = {i: torch.zeros(kv_shape, dtype=dtype, device=device) for i in attn}
        self.v = {i: torch.zeros(kv_shape, dtype=dtype, device=device) for i in attn}
        conv_shape = (num_slots + 1, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1)
        ssm_shape = (num_slots + 1, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        # stacked over the GDN layers (in cfg.gdn_layers order), conv[layer] / ssm[layer] are views: the
        # speculative rollback updates every layer with one launch (ForwardBatch.commit_gdn_states)
        self.gdn_layers = tuple(cfg.gdn_layers)
        self.conv_stacked = torch.zeros((len(self.gdn_layers), *conv_shape), dtype=dtype, device=device)
        self.ssm_stacked = torch.zeros((len(self.gdn_layers), *ssm_shape), dtype=state_dtype, device=device)
        self.conv = {layer: self.conv_stacked[j] for j, layer in enumerate(self.gdn_layers)}
        self.ssm = {layer: self.ssm_stacked[j] for j, layer in enumerate(self.gdn_layers)}

    @property
    def num_tokens(self) -> int:
        """KV capacity in tokens."""
        return self.num_blocks * self.block_size

    def copy_state(self, src: int, dst: int) -> None:
        """Copy GDN state slot `src` (conv and recurrent state of every GDN layer) into slot `dst`."""
        self.conv_stacked[:, dst].copy_(self.conv_stacked[:, src])
        self.ssm_stacked[:, dst].copy_(self.ssm_stacked[:, src])

    def copy_block(self, src: int, dst: int) -> None:
        """Copy KV block `src` (K and V of every attention layer, MTP's included) into block `dst`."""
        for layer in self.k:
            self.k[layer][dst].copy_(self.k[layer][src])
            self.v[layer][dst].copy_(self.v[layer][src])

    def apply_copies(self, copies: list[tuple[str, int, int]]) -> None:
        """Apply `CacheManager.pending_copies` in order: ("state", src, dst) -> `copy_state`, ("block", src, dst)
        -> `copy_block`. Order matters (a slot snapshotted may be refilled by a later copy), so one at a time."""
        for kind, src, dst in copies:
            if kind == "state":
                self.copy_state(src, dst)
            elif kind == "block":
                self.copy_block(src, dst)
            else:
                raise ValueError(f"unknown cache copy {kind!r}")
