"""CUDA graphs of the forward pass for decode and speculative-verification steps, one graph per batch size.

A decode step (one new token per sequence) launches ~15 kernels per layer; replaying a captured graph
issues them all with one launch, so the step costs GPU time, not Python time. Each graph owns static
input buffers (token ids and a `DeviceBatch`); a batch of n sequences runs the smallest graph of size
g >= n, rows n..g-1 being dummies that read and write only the cache's scratch block and slot.
Graphs of one kind share a memory pool (captured largest first).

Verification graphs (`query_len` = k + 1 tokens per sequence, `keep_states`) also keep the GDN history
(`ForwardBatch.gdn_history_batched`): its tensors are graph outputs, refreshed by every replay.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from vibeqwen_kernels.pdl import EARLY_MAX_TOKENS, early_launch

from vibeqwen.model.meta import DeviceBatch
from vibeqwen.model.state import ForwardBatch

log = logging.getLogger(__name__)


def default_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (what the scheduler's batches round up to)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 8, 8))
    return sorted({min(s, max_batch) for s in sizes})


def capture_graph(fn, device, pool=None, warmups: int = 2):
    """Capture one call of `fn` (no arguments) into a CUDA graph on `device`, in memory pool `pool` (None: a
    new one; graphs of one kind share theirs). `fn` first runs `warmups` times on a side stream, so its
    kernels compile and autotune outside the capture. Returns (graph, what the captured call returned: the
    graph's output tensors, refreshed by every replay). Raises what `fn` or the capture raises."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # int64 [g * query_len]
    meta: DeviceBatch
    hidden: torch.Tensor  # [g * query_len, H]
    history: dict  # layer -> GDN history tensors (verification graphs)


class DecodeGraphs:
    """Captured passes of `model` over `cache` for batch sizes `sizes`, `query_len` tokens per sequence
    (1: decode; k + 1 with keep_states: speculative verification).

    width: block-table width of the static buffers (blocks of the longest sequence served).
    Raises ValueError when query_len exceeds the cache's block size (padding rows live in one block).
    """

    def __init__(self, model, cache, width: int, sizes: list[int], query_len: int = 1, keep_states: bool = False,
                 pool=None, history_buffers=None):
        if query_len > cache.block_size:
            raise ValueError(f"graphs of {query_len} tokens per sequence need a block size >= {query_len}")
        self.model, self.cache, self.width = model, cache, width
        self.query_len, self.keep_states = query_len, keep_states
        self.history_buffers = history_buffers
        self.sizes = sorted(sizes)
        self.graphs: dict[int, _Graph] = {}
        t0 = time.perf_counter()
        for g in reversed(self.sizes):
            self.graphs[g] = self._capture(g, pool)
            pool = self.graphs[g].graph.pool()
        self.pool = pool  # graphs of other kinds may share it: every replay's outputs are used before the next
        torch.cuda.synchronize()
        log.info("captured %d %s CUDA graphs (batch %s) in %.1f s", len(self.sizes),
                 "decode" if query_len == 1 else f"verification ({query_len} tokens)", self.sizes,
                 time.perf_counter() - t0)

    @property
    def max_batch(self) -> int:
        """The largest captured batch (sequences); larger batches run eagerly."""
        return self.sizes[-1]

    def _capture(self, g: int, pool) -> _Graph:
        dev, q = self.cache.device, self.query_len
        meta = DeviceBatch.allocate(g, g * q, self.width, q, dev)
        self._fill(meta, [], [], [], [], g)
        input_ids = torch.zeros(g * q, dtype=torch.int64, device=dev)
        batch = ForwardBatch(self.cache, [q] * g, [0] * g, [[self.cache.scratch_block]] * g,
                             [self.cache.scratch_slot] * g, [self.keep_states] * g)
        batch.meta = meta
        batch.history_buffers = self.history_buffers
        # small steps are chains of latency-bound kernels: each lets the next launch early (vibeqwen_kernels.pdl)
        with early_launch(g * q <= EARLY_MAX_TOKENS):
            graph, hidden = capture_graph(lambda: self.model.forward(input_ids, meta.positions, batch), dev, pool)
        return _Graph(graph, input_ids, meta, hidden, dict(batch.gdn_history_batched))

    def _fill(self, meta: DeviceBatch, query_lens, context_lens, tables, slots, g: int) -> None:
        DeviceBatch.build(query_lens, context_lens, tables, slots, self.cache.block_size, self.cache.device,
                          width=self.width, pad_to=g, pad_block=self.cache.scratch_block,
                          pad_slot=self.cache.scratch_slot, out=meta, pad_query_len=self.query_len)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A batch of exactly query_len tokens per sequence (keeping GDN states iff these graphs do) that
        fits a graph."""
        n = len(batch.query_lens)
        return (0 < n <= self.max_batch and all(q == self.query_len for q in batch.query_lens)
                and all(k == self.keep_states for k in batch.keep_states)
                and all(len(t) <= self.width for t in batch.block_tables))

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Replay the graph for `batch` (see `can_run`). input_ids: int64 [n * query_len]. Returns hidden
        [n * query_len, H] (a view of the graph's output buffer, valid until the next replay). Points
        batch.meta (and the GDN history of verification graphs) at the graph's buffers."""
        n = len(batch.query_lens)
        g = next(s for s in self.sizes if s >= n)
        st = self.graphs[g]
        t = n * self.query_len
        self._fill(st.meta, batch.query_lens, batch.context_lens, batch.block_tables, batch.gdn_slots, g)
        st.input_ids[:t].copy_(input_ids, non_blocking=True)
        if n < g:
            st.input_ids[t:].zero_()
        st.graph.replay()
        batch.meta = st.meta
        batch.gdn_history_batched = dict(st.history)
        return st.hidden[:t]
