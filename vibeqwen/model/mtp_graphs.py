"""CUDA graphs of the MTP head's draft passes (speculative decoding with method 'mtp' on the GPU path).

After the step's MTP pass over its kept positions (eager: its query lengths vary from step to step), drafting k
tokens a sequence is the LM head's argmax at the last position's MTP hidden state, then k - 1 one-token passes of
the MTP layer, each followed by the LM head and an argmax (`mtp.draft_tokens`): ~(k - 1) x 20 kernel launches plus
k LM heads, each a Python call when run eagerly. One graph per batch size g holds all of it. Input: the MTP hidden
states [g, H]; output: the drafted ids [g, k]; the k - 1 passes' metadata (positions, KV slots in the MTP layer's
cache, block tables, sequence lengths) are k - 1 static `DeviceBatch` buffers filled before each replay. Rows
n..g-1 are dummies that read and write only the cache's scratch block (as in `cuda_graphs.DecodeGraphs`).

Off by default until measured on a GPU (`VIBEQWEN_MTP_GRAPHS=1` captures them; bench/h200.py's spec_mtp stage).
Only capturable where the MTP layer's MoE runs the GPU kernels (NVFP4 experts). The vendors ship the MTP layer in
BF16, whose MoE runs the reference loop (a host read of the routed expert ids per pass), so with such checkpoints
the engine drafts eagerly (`ModelRunner.capture_mtp_graphs` says so) until the MoE has a sync-free BF16 path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from vibeqwen.model.cuda_graphs import capture_graph
from vibeqwen.model.meta import DeviceBatch
from vibeqwen.model.mtp import draft_tokens
from vibeqwen.model.state import ForwardBatch

log = logging.getLogger(__name__)


@dataclass
class _DraftGraph:
    graph: torch.cuda.CUDAGraph | None  # None: `capture=False`, the passes run eagerly on the static buffers
    hidden: torch.Tensor  # [g, H] model dtype: the MTP hidden states drafting starts from
    metas: list[DeviceBatch]  # the k - 1 passes' static metadata
    steps: list[ForwardBatch]  # the passes' batches, reading `metas`
    ids: torch.Tensor | None  # int64 [g, k]: the graph's output (refreshed by every replay)


class MTPDraftGraphs:
    """Draft passes of `model.mtp` over `cache` for batch sizes `sizes`, k drafts a sequence.

    width: block-table width of the static buffers (blocks of the longest sequence served, lookahead included).
    capture: False keeps every pass eager on the same static buffers (the CPU tests' way through the
    filling and padding); True needs a CUDA device. Raises ValueError for k < 1, a model without the MTP head,
    off the GPU path (`model.fast`) or, capturing with k > 1, whose MTP MoE runs the reference loop (BF16
    experts), and what the capture raises.
    """

    def __init__(self, model, cache, width: int, sizes: list[int], k: int, pool=None, capture: bool = True):
        if k < 1:
            raise ValueError(f"MTP draft graphs need k >= 1 drafts, got {k}")
        if model.mtp is None:
            raise ValueError("MTP draft graphs need the model's MTP head (built with with_mtp=True)")
        if not model.fast:  # the reference path reads the batch's host lists, which the static batches do not hold
            raise ValueError("MTP draft graphs need the GPU path's model (Weights.fast)")
        if capture and k > 1 and not model.mtp.layer.mlp.fast:
            # BF16 experts (the vendors' MTP layers are unquantized) run the reference MoE loop, which reads the
            # routed expert ids back to the host: not capturable
            raise ValueError("MTP draft graphs need the MTP layer's MoE on the GPU kernels (NVFP4 experts); its "
                             "experts are not NVFP4, so its MoE runs the reference loop, which syncs with the host")
        self.model, self.cache, self.width, self.k = model, cache, width, k
        self.sizes = sorted(sizes)
        self.graphs: dict[int, _DraftGraph] = {}
        t0 = time.perf_counter()
        for g in reversed(self.sizes):  # largest first: the smaller ones fit in its pool
            self.graphs[g] = self._capture(g, pool, capture)
            if capture:
                pool = self.graphs[g].graph.pool()
        if capture:
            torch.cuda.synchronize()
            log.info("captured %d MTP draft CUDA graphs (k = %d, batch %s) in %.1f s", len(self.sizes), k,
                     self.sizes, time.perf_counter() - t0)

    @property
    def max_batch(self) -> int:
        """The largest batch (sequences) a graph holds; larger batches draft eagerly."""
        return self.sizes[-1]

    def _capture(self, g: int, pool, capture: bool) -> _DraftGraph:
        cache, dev = self.cache, self.cache.device
        metas = [DeviceBatch.allocate(g, g, self.width, 1, dev) for _ in range(self.k - 1)]
        steps = []
        for meta in metas:
            self._fill(meta, [], [], [], g)
            step = ForwardBatch(cache, [1] * g, [0] * g, [[cache.scratch_block]] * g, [cache.scratch_slot] * g)
            step.meta = meta
            steps.append(step)
        hidden = torch.zeros(g, self.model.cfg.hidden_size, dtype=self.model.dtype, device=dev)
        if not capture:
            return _DraftGraph(None, hidden, metas, steps, None)
        from vibeqwen_kernels.pdl import EARLY_MAX_TOKENS, early_launch

        with early_launch(g <= EARLY_MAX_TOKENS):  # chains of latency-bound kernels, as the decode graphs
            graph, ids = capture_graph(lambda: draft_tokens(self.model, hidden, steps), dev, pool)
        return _DraftGraph(graph, hidden, metas, steps, ids)

    def _fill(self, meta: DeviceBatch, context_lens, tables, slots, g: int) -> None:
        DeviceBatch.build([1] * len(context_lens), context_lens, tables, slots, self.cache.block_size,
                          self.cache.device, width=self.width, pad_to=g, pad_block=self.cache.scratch_block,
                          pad_slot=self.cache.scratch_slot, out=meta)

    def can_run(self, n: int, k: int, tables: list[list[int]]) -> bool:
        """n sequences drafting k tokens each (the graphs' k), no more than the largest graph, tables that fit."""
        return 0 < n <= self.max_batch and k == self.k and all(len(t) <= self.width for t in tables)

    def run(self, hidden: torch.Tensor, first: list[int], tables: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Draft for n sequences (see `can_run`). hidden: [n, H] the MTP hidden state at each one's last known
        position; first: each one's first draft pass position (that position + 1); tables, slots: their block
        tables and GDN slots. Returns int64 [n, k] drafts on the device (a view of the graph's output, valid until
        the next replay); `mtp.draft_tokens` computes the same eagerly. Raises ValueError (`DeviceBatch.build`)
        where a table does not cover a pass's position, as the eager passes do."""
        n = len(first)
        g = next(s for s in self.sizes if s >= n)
        st = self.graphs[g]
        for s, meta in enumerate(st.metas):
            self._fill(meta, [p + s for p in first], tables, slots, g)
        st.hidden[:n].copy_(hidden, non_blocking=True)
        if n < g:
            st.hidden[n:].zero_()
        if st.graph is None:
            return draft_tokens(self.model, st.hidden, st.steps)[:n]
        st.graph.replay()
        return st.ids[:n]
