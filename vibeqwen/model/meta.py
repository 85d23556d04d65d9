"""Device-side metadata of one flattened batch, the form the GPU kernels read.

`ForwardBatch` keeps the scheduler's Python lists (the reference path loops over them); the GPU path needs
the same facts as small device tensors. They are packed on the host into one int32 and one int64 buffer
and sent with two copies; under a CUDA graph the copies land in the graph's static buffers, whose views
the captured kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DeviceBatch:
    """Per-pass metadata on the device. B sequences (rows), T tokens.

    query_start_loc: int32 [B+1], sequence b owns token rows [query_start_loc[b], query_start_loc[b+1]).
    seq_lens: int32 [B], tokens of b in the KV cache after this pass (context + new).
    block_tables: int32 [B, W], padded with `pad_block`.
    has_initial_state: bool [B], False for a sequence's first chunk (its GDN state starts at zero).
    slot_mapping: int64 [T], flat KV slot (block * block_size + offset) each new token is written to.
    gdn_slots: int64 [B], each sequence's GDN state slot.
    positions: int64 [T], each token's position in its sequence.
    max_query_len: host int, the longest query (sizes kernel grids; fixed under a CUDA graph).
    num_real: host int, rows that are real sequences (the rest is CUDA-graph padding).
    query_start_loc_cpu: int64 [B+1] host copy of query_start_loc (kernels that size work on the host read it
        instead of syncing).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    has_initial_state: torch.Tensor
    slot_mapping: torch.Tensor
    gdn_slots: torch.Tensor
    positions: torch.Tensor
    max_query_len: int
    num_real: int
    query_start_loc_cpu: torch.Tensor | None = None
    _i32: torch.Tensor | None = None  # the packed buffers the fields view (static buffers of a graph)
    _i64: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        """B, the rows (sequences, padding included)."""
        return self.seq_lens.shape[0]

    @staticmethod
    def _views(i32, i64, b: int, t: int, width: int):
        o = 0
        qsl = i32[o : o + b + 1]; o += b + 1
        seq = i32[o : o + b]; o += b
        nb = -(-b // 4)  # the flags are bytes: b of them packed into ceil(b / 4) int32 words
        if isinstance(i32, torch.Tensor):
            init = i32[o : o + nb].view(torch.uint8)[:b].view(torch.bool)
        else:
            init = i32[o : o + nb].view(np.uint8)[:b]
        o += nb
        table = i32[o : o + b * width].reshape(b, width)
        slot_mapping, gdn_slots, positions = i64[:t], i64[t : t + b], i64[t + b : 2 * t + b]
        return qsl, seq, table, init, slot_mapping, gdn_slots, positions

    @staticmethod
    def _sizes(b: int, t: int, width: int) -> tuple[int, int]:
        return 2 * b + 1 + -(-b // 4) + b * width, 2 * t + b

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              gdn_slots: list[int], block_size: int, device: torch.device | str,
              width: int | None = None, pad_to: int | None = None, pad_block: int = 0, pad_slot: int = 0,
              out: "DeviceBatch | None" = None, pad_query_len: int = 1) -> "DeviceBatch":
        """Pack the scheduler's lists and send them to `device`.

        width: block-table width (default: the longest table). pad_to: pad to this many sequences with
        `pad_query_len`-token dummies (context 0, positions 0 .. pad_query_len - 1) that read and write only
        `pad_block` (KV) and `pad_slot` (GDN state): a CUDA graph captured for pad_to rows then runs a
        smaller batch. A dummy longer than a block wraps: position p writes KV slot
        pad_block * block_size + p % block_size, and its table row holds pad_block in every column it reads
        (ceil(pad_query_len / block_size) of them, at least). Their K/V are garbage that only dummies read.
        out: static buffers to copy into (from `allocate` with the same shapes; only the table columns in use
        are sent: the longest real table's, or a dummy's if longer).
        Raises ValueError when a table is too short for its sequence or too wide for the buffers (a dummy's
        columns included).
        """
        n = len(query_lens)
        b = pad_to or n
        if b < n:
            raise ValueError(f"pad_to={pad_to} is smaller than the batch ({n})")
        used = max((len(t) for t in block_tables), default=1) or 1
        if b > n:  # the columns a dummy row reads (all pad_block)
            used = max(used, -(-pad_query_len // block_size))
        if out is not None:
            # static buffers: send only the table columns in use (entries past a sequence's length are never
            # read, so stale columns left by earlier batches are harmless)
            if used > out.block_tables.shape[1]:
                raise ValueError(f"a block table of {used} blocks exceeds the static width {out.block_tables.shape[1]}")
            full_width, width = out.block_tables.shape[1], used
        else:
            width = max(width or used, used if b > n else 0)
        qlens = np.full(b, pad_query_len, dtype=np.int64)
        qlens[:n] = query_lens
        ctx = np.zeros(b, dtype=np.int64)
        ctx[:n] = context_lens
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        t = int(qsl[-1])
        n32, n64 = cls._sizes(b, t, width)
        pin = torch.device(device).type == "cuda"
        i32_t = torch.empty(n32, dtype=torch.int32, pin_memory=pin)
        i64_t = torch.empty(n64, dtype=torch.int64, pin_memory=pin)
        hq, hs, ht, hi, hsm, hg, hp = cls._views(i32_t.numpy(), i64_t.numpy(), b, t, width)
        hq[:] = qsl
        hs[:] = ctx + qlens
        hi[:] = ctx > 0
        hg[:n] = gdn_slots
        hg[n:] = pad_slot
        ht[:] = pad_block
        for i in range(n):
            bt, c, q = block_tables[i], int(ctx[i]), int(qlens[i])
            if c + q > len(bt) * block_size:
                raise ValueError(f"sequence {i}: block table covers {len(bt) * block_size} tokens, need {c + q}")
            if len(bt) > width:
                raise ValueError(f"sequence {i}: {len(bt)} blocks exceed the table width {width}")
            mirror = getattr(bt, "array", None)  # engine.cache.BlockTable keeps an int32 copy: no conversion
            ht[i, : len(bt)] = mirror() if mirror is not None else bt
            s0 = int(qsl[i])
            if q == 1:
                hp[s0] = c
                hsm[s0] = bt[c // block_size] * block_size + c % block_size
            else:
                pos = np.arange(c, c + q)
                hp[s0 : s0 + q] = pos
                hsm[s0 : s0 + q] = np.asarray(bt, dtype=np.int64)[pos // block_size] * block_size + pos % block_size
        s_pad = int(qsl[n])
        pad_pos = np.tile(np.arange(pad_query_len), b - n)
        hp[s_pad:] = pad_pos
        hsm[s_pad:] = pad_block * block_size + pad_pos % block_size  # wraps: never outside pad_block
        i32, i64 = i32_t, i64_t
        dev = torch.device(device)
        if out is not None:
            if out._i32 is None or out._i32.numel() != cls._sizes(b, t, full_width)[0] or out._i64.numel() != n64:
                raise ValueError("static buffers were allocated for another shape")
            head = n32 - b * width
            out._i32[:head].copy_(i32[:head], non_blocking=True)
            out.block_tables[:, :width].copy_(i32[head:].view(b, width), non_blocking=True)
            out._i64.copy_(i64, non_blocking=True)
            out.max_query_len, out.num_real = int(qlens.max()) if b else 0, n
            out.query_start_loc_cpu = torch.from_numpy(qsl)
            return out
        d32 = i32.to(dev, non_blocking=True)
        d64 = i64.to(dev, non_blocking=True)
        return cls(*cls._views(d32, d64, b, t, width), max_query_len=int(qlens.max()) if b else 0, num_real=n,
                   query_start_loc_cpu=torch.from_numpy(qsl), _i32=d32, _i64=d64)

    @classmethod
    def allocate(cls, num_seqs: int, num_tokens: int, width: int, max_query_len: int,
                 device: torch.device | str) -> "DeviceBatch":
        """Zeroed static buffers for `num_seqs` sequences and `num_tokens` tokens (a CUDA graph's inputs)."""
        n32, n64 = cls._sizes(num_seqs, num_tokens, width)
        d32 = torch.zeros(n32, dtype=torch.int32, device=device)
        d64 = torch.zeros(n64, dtype=torch.int64, device=device)
        return cls(*cls._views(d32, d64, num_seqs, num_tokens, width), max_query_len=max_query_len,
                   num_real=num_seqs, _i32=d32, _i64=d64)
