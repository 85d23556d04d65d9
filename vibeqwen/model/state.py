"""Batch metadata for one forward pass over a flattened batch of sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vibeqwen.model.cache import ModelCache
from vibeqwen.model.meta import DeviceBatch


class GDNHistoryBuffers:
    """Preallocated GDN history of verification passes of up to `capacity` tokens, stacked over the GDN
    layers (ModelCache.gdn_layers order) so the rollback updates every layer in one go:

        states  state_dtype [L, N, Hv, Dk, Dv]   recurrent state after every token
        inputs  dtype       [L, N, C]            conv inputs of every token
        conv0   dtype       [L, N, C, W-1]       each sequence's conv state before the pass (rows = sequences)

    state_dtype: float32 or bfloat16, the cache's recurrent-state dtype (ModelCache.state_dtype,
    EngineConfig.gdn_state_dtype), so a rollback copies states as stored. `get(layer)` gives that layer's (states,
    inputs, conv0) views (GatedDeltaNet.forward_gpu writes them). Every verification graph and eager pass that
    fits shares them: 2 MiB per token and layer of float32 states (1 MiB in bfloat16).
    """

    def __init__(self, cfg, layers: tuple[int, ...], capacity: int, dtype: torch.dtype, device,
                 state_dtype: torch.dtype = torch.float32):
        n, w1 = len(layers), cfg.linear_conv_kernel_dim - 1
        self.layers = tuple(layers)
        self.index = {layer: j for j, layer in enumerate(self.layers)}
        self.states = torch.empty(n, capacity, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim, dtype=state_dtype, device=device)
        self.inputs = torch.empty(n, capacity, cfg.gdn_conv_dim, dtype=dtype, device=device)
        self.conv0 = torch.empty(n, capacity, cfg.gdn_conv_dim, w1, dtype=dtype, device=device)
        # each layer's (conv0, inputs, states) start addresses, the order of ForwardBatch.gdn_history_batched's
        # tuples: `holds` runs after every verification step, so it compares these, not fresh views
        self._ptrs = {layer: (self.conv0[j].data_ptr(), self.inputs[j].data_ptr(), self.states[j].data_ptr())
                      for layer, j in self.index.items()}

    @property
    def capacity(self) -> int:
        """Tokens (and sequences) a pass may have to use these buffers."""
        return self.states.shape[1]

    def get(self, layer: int):
        """(states [N, Hv, Dk, Dv], inputs [N, C], conv0 [N, C, W-1]) of GDN layer `layer`, or None."""
        j = self.index.get(layer)
        return None if j is None else (self.states[j], self.inputs[j], self.conv0[j])

    def holds(self, history: dict) -> bool:
        """True when `history` (ForwardBatch.gdn_history_batched) is exactly these buffers' views, every
        layer (the pass fitted), so the stacked rollback applies."""
        if history.keys() != self._ptrs.keys():
            return False
        return all(tuple(t.data_ptr() for t in views) == self._ptrs[layer] for layer, views in history.items())


@dataclass
class ForwardBatch:
    """A flattened batch: sequence i owns tokens [starts[i], starts[i] + query_lens[i]) of the inputs.

    context_lens[i]: tokens of sequence i already in the cache before this pass (its first new token's
    position). block_tables[i]: its KV block ids, covering context_lens[i] + query_lens[i] tokens.
    gdn_slots[i]: its GDN state slot; a sequence with context_lens[i] == 0 starts from a zero state.
    keep_states[i]: keep the GDN state after every token of sequence i in `gdn_history[(layer, i)]` =
    (conv [T, C, W-1], recurrent [T, Hv, Dk, Dv] in the cache's state dtype), for speculative rollback (see
    `commit_gdn_state`).
    """

    cache: ModelCache
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    gdn_slots: list[int]
    keep_states: list[bool] | None = None
    starts: list[int] = field(init=False)
    gdn_history: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(init=False, default_factory=dict)
    # the GPU path's form, per layer for the whole batch: (conv state before the pass [B, C, W-1], the conv
    # inputs [T, C], the recurrent state after every token [T, Hv, Dk, Dv] in the cache's state dtype)
    gdn_history_batched: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        init=False, default_factory=dict)
    _slot_cache: dict[tuple[int, str], torch.Tensor] = field(init=False, default_factory=dict, repr=False)
    meta: DeviceBatch | None = field(default=None, repr=False)  # the GPU path's view (see device_batch)
    # where a verification pass of up to N tokens keeps its history (see GatedDeltaNet.forward_gpu); None:
    # allocate per pass
    history_buffers: GDNHistoryBuffers | None = field(default=None, repr=False)
    # (sequence indices, sub-batch) of each pass when the runner split this batch (ModelRunner._forward_split)
    split_passes: list = field(init=False, default_factory=list, repr=False)
    # a whole-chunk prefill graph's pass (vibeqwen.model.prefill_graphs): `meta` has exactly two rows, row 0
    # the one real sequence (its first query_start_loc[1] tokens), row 1 padding in the scratch block and
    # slot; the GDN layers run rows 0 and 1 as one fla sequence masked at n = query_start_loc[1]
    padded_prefill: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.query_lens)
        if self.keep_states is None:
            self.keep_states = [False] * n
        if not (len(self.context_lens) == len(self.block_tables) == len(self.gdn_slots) == n):
            raise ValueError("ForwardBatch fields must have one entry per sequence")
        self.starts, acc = [], 0
        for q in self.query_lens:
            self.starts.append(acc)
            acc += q
        self.num_tokens = acc

    def device_batch(self) -> DeviceBatch:
        """The batch as device tensors for the GPU kernels, built on first use (or preset by a CUDA graph)."""
        if self.meta is None:
            self.meta = DeviceBatch.build(self.query_lens, self.context_lens, self.block_tables, self.gdn_slots,
                                          self.cache.block_size, self.cache.device,
                                          pad_block=self.cache.scratch_block, pad_slot=self.cache.scratch_slot)
        return self.meta

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[T] int64: each token's position in its sequence."""
        return torch.cat([torch.arange(c, c + q) for c, q in zip(self.context_lens, self.query_lens)]).to(device)

    def kv_slots(self, i: int, start: int, end: int) -> torch.Tensor:
        """Flat KV cache slots of positions [start, end) of sequence i."""
        pos = torch.arange(start, end)
        bs = self.cache.block_size
        table = torch.tensor(self.block_tables[i], dtype=torch.long)
        if end > len(self.block_tables[i]) * bs:
            raise ValueError(f"sequence {i}: block table covers {len(self.block_tables[i]) * bs} tokens, need {end}")
        return table[pos // bs] * bs + pos % bs

    def sequence_kv_slots(self, i: int, device: torch.device | str) -> torch.Tensor:
        """Flat KV slots [context_lens[i] + query_lens[i]] of all of sequence i's positions, on `device`.

        Computed once per pass and shared by every attention layer (the new tokens are the last
        query_lens[i] entries).
        """
        key = (i, str(device))
        if key not in self._slot_cache:
            end = self.context_lens[i] + self.query_lens[i]
            self._slot_cache[key] = self.kv_slots(i, 0, end).to(device)
        return self._slot_cache[key]

    def commit_gdn_states(self, kept: dict[int, int]) -> None:
        """Roll the GDN slots of sequences i in `kept` back to their state after their first kept[i] tokens of
        this pass (1 <= kept[i] <= query_lens[i]; keep_states[i] must be set). GPU path: two launches for every
        layer when the history is the stacked buffers (`gdn_commit_states`, `gdn_commit_conv`), else a handful of
        batched index ops per layer; `commit_gdn_state` per sequence on the reference path."""
        if not kept:
            return
        if not self.gdn_history_batched:
            for i, n in kept.items():
                self.commit_gdn_state(i, n)
            return
        seqs = list(kept)
        dev = next(iter(self.gdn_history_batched.values()))[2].device
        # one host-to-device copy: rows kept tokens, first token, batch row, slot, last kept token's row
        idx = torch.tensor([[kept[i] for i in seqs], [self.starts[i] for i in seqs], seqs,
                            [self.gdn_slots[i] for i in seqs], [self.starts[i] + kept[i] - 1 for i in seqs]],
                           dtype=torch.int64).to(dev)
        n, starts, rows_b, slots, last = idx
        hb = self.history_buffers
        cache = self.cache
        if hb is not None and hb.layers == cache.gdn_layers and hb.holds(self.gdn_history_batched):
            # every layer at once: one gather-copy launch for the recurrent states, one for the conv windows
            from vibeqwen_kernels.gdn.commit import gdn_commit_conv, gdn_commit_states

            gdn_commit_states(cache.ssm_stacked, hb.states, slots, last)
            gdn_commit_conv(cache.conv_stacked, hb.inputs, hb.conv0, idx[:4])
            return
        for layer, (conv0, mixed, states) in self.gdn_history_batched.items():
            self.cache.ssm[layer].index_copy_(0, slots, states.index_select(0, last))
            w1 = conv0.shape[-1]  # W - 1
            # window position j (0..W-2) of the state after n tokens is input n - (W-1) + j of the pass;
            # negative positions come from the state before the pass
            pos = n[:, None] - w1 + torch.arange(w1, device=dev)[None, :]  # [S, W-1]
            from_mixed = mixed.index_select(0, (starts[:, None] + pos.clamp(min=0)).reshape(-1)).view(
                len(seqs), w1, -1)  # [S, W-1, C]
            from_conv0 = conv0.index_select(0, rows_b).gather(
                2, (pos + w1).clamp(max=w1 - 1)[:, None, :].expand(-1, conv0.shape[1], -1))  # [S, C, W-1]
            window = torch.where((pos >= 0)[:, None, :], from_mixed.transpose(1, 2).to(conv0.dtype), from_conv0)
            self.cache.conv[layer].index_copy_(0, slots, window)

    def commit_gdn_state(self, i: int, num_tokens: int) -> None:
        """Roll sequence i's GDN slots back to the state after its first `num_tokens` tokens of this pass
        (1 <= num_tokens <= query_lens[i]); requires keep_states[i]."""
        for (layer, j), (conv, ssm) in self.gdn_history.items():
            if j == i:
                self.cache.conv[layer][self.gdn_slots[i]] = conv[num_tokens - 1]
                self.cache.ssm[layer][self.gdn_slots[i]] = ssm[num_tokens - 1]

    def sequences(self):
        """Yield (i, token slice, context_len) per sequence."""
        for i, (s, q, c) in enumerate(zip(self.starts, self.query_lens, self.context_lens)):
            yield i, slice(s, s + q), c
