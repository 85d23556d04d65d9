"""CUDA graphs of the decode forward pass: one graph per batch size, replayed with padded inputs.

A decode step (one new token per sequence) launches ~15 kernels per layer; replaying a captured graph
issues them all with one launch, so the step costs GPU time, not Python time. Each graph owns static
input buffers (token ids and a `DeviceBatch`); a batch of n sequences runs the smallest graph of size
g >= n, rows n..g-1 being dummies that read and write only the cache's scratch block and slot.
Graphs share one memory pool (captured largest first).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from vibeqwen.model.meta import DeviceBatch
from vibeqwen.model.state import ForwardBatch

log = logging.getLogger(__name__)


def default_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch (what the scheduler's batches round up to)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 8, 8))
    return sorted({min(s, max_batch) for s in sizes})


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # int64 [g]
    meta: DeviceBatch
    hidden: torch.Tensor  # [g, H]


class DecodeGraphs:
    """Captured decode passes of `model` over `cache` for batch sizes `sizes`.

    width: block-table width of the static buffers (blocks of the longest sequence served).
    """

    def __init__(self, model, cache, width: int, sizes: list[int]):
        self.model, self.cache, self.width = model, cache, width
        self.sizes = sorted(sizes)
        self.graphs: dict[int, _Graph] = {}
        pool = None
        t0 = time.perf_counter()
        for g in reversed(self.sizes):
            self.graphs[g] = self._capture(g, pool)
            pool = self.graphs[g].graph.pool()
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.sizes), self.sizes,
                 time.perf_counter() - t0)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _capture(self, g: int, pool) -> _Graph:
        dev = self.cache.device
        meta = DeviceBatch.allocate(g, g, self.width, 1, dev)
        self._fill(meta, [], [], [], [], g)
        input_ids = torch.zeros(g, dtype=torch.int64, device=dev)
        batch = ForwardBatch(self.cache, [1] * g, [0] * g, [[self.cache.scratch_block]] * g,
                             [self.cache.scratch_slot] * g)
        batch.meta = meta
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and autotune the kernels outside the capture
                self.model.forward(input_ids, meta.positions, batch)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self.model.forward(input_ids, meta.positions, batch)
        return _Graph(graph, input_ids, meta, hidden)

    def _fill(self, meta: DeviceBatch, query_lens, context_lens, tables, slots, g: int) -> None:
        DeviceBatch.build(query_lens, context_lens, tables, slots, self.cache.block_size, self.cache.device,
                          width=self.width, pad_to=g, pad_block=self.cache.scratch_block,
                          pad_slot=self.cache.scratch_slot, out=meta)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A decode batch (one token per sequence, no speculative state keeping) that fits a graph."""
        n = len(batch.query_lens)
        return (0 < n <= self.max_batch and all(q == 1 for q in batch.query_lens) and not any(batch.keep_states)
                and all(len(t) <= self.width for t in batch.block_tables))

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Replay the graph for `batch` (see `can_run`). input_ids: int64 [n]. Returns hidden [n, H] (a view of
        the graph's output buffer, valid until the next replay). Sets batch.meta to the graph's buffers."""
        n = len(batch.query_lens)
        g = next(s for s in self.sizes if s >= n)
        st = self.graphs[g]
        self._fill(st.meta, batch.query_lens, batch.context_lens, batch.block_tables, batch.gdn_slots, g)
        st.input_ids[:n].copy_(input_ids, non_blocking=True)
        if n < g:
            st.input_ids[n:].zero_()
        st.graph.replay()
        batch.meta = st.meta
        return st.hidden[:n]
