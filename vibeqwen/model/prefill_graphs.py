"""CUDA graphs of the whole forward pass for one prompt chunk of one sequence, one graph per token bucket.

Why: an eager 1k-token prefill launches ~1000 kernels from Python and took 66-90 ms of wall time on the H200
for ~31 ms of GPU work (bench/results/h200_notes.md, "The 1k prefill is now bound by the host"). A replay
launches them all at once.

What a graph of bucket B (a power of two from 128, or max_num_batched_tokens; `bucket_sizes`) runs: a
flattened batch of exactly B tokens in two rows of a static `DeviceBatch`:

    row 0  the real sequence: T tokens (1 <= T <= B), its context, block table, GDN slot
    row 1  padding: B - T tokens at positions 0 .. B-T-1, context 0, every table column the scratch block,
           the scratch GDN slot; its KV writes wrap inside the scratch block (`DeviceBatch.build`)

Why one graph serves every T <= B: every kernel's grid depends only on B and the host int max_query_len,
fixed at B under the graph (the attention prefill kernel and conv1d read the row boundaries, sequence lengths
and block tables from device tensors; programs past a row's length do nothing); the MoE's routing and
alignment run on the device with buffers sized from B (`moe_align`: no host reads); linears, norms and the
MoE are per token. The GDN layers, which in an eager pass need the sequence lengths on the host, run rows 0
and 1 as ONE fla sequence of B tokens masked at n = query_start_loc[1] = T on the device
(`ForwardBatch.padded_prefill`, `vibeqwen_kernels.gdn.chunk_fla.gdn_chunk_padded`: padding tokens get g = 0,
beta = 0 and zero q, k, v, which leaves the state and every real token's output exactly as without them);
the initial state comes from row 0's slot (zero unless it has a context), the final state goes back there.
conv1d keeps the two rows apart, so row 0's conv state ends with its own last tokens.

So padding costs compute only, and touches nothing but the scratch block and slot (which no sequence owns).
Logits are computed outside the graph (the runner picks the rows).

Memory: the graphs share one private pool (captured largest first; each replay's intermediates are dead once
it returns, and the graph outputs `hidden` are distinct live tensors), about the activation peak of one
B_max-token pass. Not shared with the decode graphs' pool: that pool is small (one token per sequence), so
sharing would save little, and keeping them apart means a prefill replay can never overwrite a decode
graph's buffers even if a future change reads a decode output late.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from vibeqwen_kernels.gdn.chunk_fla import GRAPH_MIN_TOKENS, bucket_sizes

from vibeqwen.model.cuda_graphs import capture_graph
from vibeqwen.model.meta import DeviceBatch
from vibeqwen.model.quant_linear import prompt_pass, w8a8_active
from vibeqwen.model.state import ForwardBatch

log = logging.getLogger(__name__)

#: Activation bytes per token of a pass over the full model, the peak of one layer: the fused MoE's fp32
#: split partials and pair buffers (9 pairs x (2 x 512 + 2048) x 4 B ~ 110 KiB), the GDN layer's projection,
#: conv and fla intermediates (~100 KiB), the residual stream and norms; rounded up to 512 KiB. The graphs'
#: pool holds that for the largest bucket (1 GiB at 2048 tokens): LLMEngine._activation_reserve sets it aside,
#: and the capture logs the real figure next to it.
PREFILL_GRAPH_BYTES_PER_TOKEN = 512 << 10

#: Smallest bucket (tokens). Chunks of 1 .. 16 tokens replay the 16-token graph (17 .. 32 the 32-token one, and so
#: on): a short prompt (a chat turn of a few words is ~15 tokens with its template) or the uncached tail of a
#: prefix-cache hit would otherwise run the eager pass, whose ~1000 launches from Python take ~20 ms of host time.
#: A 14-token prompt took 6.7 ms from the 16-token graph against 9.3 from a 128-token one on the H200
#: (bench/results/h200_notes.md, thirty-seventh session), for three more graphs captured at start-up.
#: Buckets of 64 tokens or fewer run the FP8 projections W8A16 (`FP8_DECODE_MAX_M`), larger ones W8A8.
#: `VIBEQWEN_PREFILL_MIN_BUCKET` (a power of two, 16 .. 4096) sets another size.
MIN_BUCKET = 16


def min_bucket() -> int:
    """The smallest bucket: `VIBEQWEN_PREFILL_MIN_BUCKET` if set, else :data:`MIN_BUCKET`.

    Raises:
        ValueError: the variable is not a power of two in 16 .. 4096.
    """
    raw = os.environ.get("VIBEQWEN_PREFILL_MIN_BUCKET", "")
    if not raw:
        return MIN_BUCKET
    try:
        b = int(raw)
    except ValueError:
        b = 0
    if b < 16 or b > 4096 or b & (b - 1):
        raise ValueError(f"VIBEQWEN_PREFILL_MIN_BUCKET must be a power of two from 16 to 4096, got {raw!r}")
    return b


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None on the CPU (tests): run() calls the model on the static buffers
    input_ids: torch.Tensor  # int64 [B]
    meta: DeviceBatch  # 2 rows, B tokens
    batch: ForwardBatch  # the capture's batch (padded_prefill), over `meta`
    hidden: torch.Tensor | None  # [B, H], the graph's output (CPU: the last run's)


class PrefillGraphs:
    """Captured forward passes of `model` over `cache` for one sequence's prompt chunk of T tokens,
    1 <= T <= max_tokens, one graph per bucket of `bucket_sizes(min_tokens, max_tokens)` (min_tokens: default
    `min_bucket()`).

    width: block-table width of the static buffers (blocks of the longest sequence served); raised to what
    the padding row of the largest bucket reads. On a CPU device nothing is captured: `run` runs the same
    padded pass eagerly (tests check the padding that way).

    Raises what a capture raises (out of memory, a kernel that cannot be captured); the caller leaves prefill
    eager then.
    """

    def __init__(self, model, cache, width: int, max_tokens: int, min_tokens: int | None = None, pool=None):
        if max_tokens <= GRAPH_MIN_TOKENS:
            raise ValueError(f"prefill graphs need max_tokens > {GRAPH_MIN_TOKENS}, got {max_tokens}")
        self.model, self.cache = model, cache
        # never a bucket above max_tokens (what LLMEngine reserved activation memory for)
        self.sizes = bucket_sizes(min(min_bucket() if min_tokens is None else min_tokens, max_tokens), max_tokens)
        self.width = max(width, -(-self.sizes[-1] // cache.block_size))
        self.graphs: dict[int, _Graph] = {}
        self.pool = pool
        # the FP8 layers' W8A8 choice the captures record (the runner builds the graphs inside its prompt_pass)
        self.w8a8 = w8a8_active()
        cuda = cache.device.type == "cuda"
        t0 = time.perf_counter()
        if cuda:  # measure what the graphs keep: their pool and static buffers, not the warm-ups' cached blocks
            torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(cache.device) if cuda else 0
        for size in reversed(self.sizes):
            self.graphs[size] = self._capture(size)
        if cuda:
            torch.cuda.synchronize(cache.device)
            torch.cuda.empty_cache()
            log.info("captured %d prefill CUDA graphs (tokens %s) in %.1f s; they keep %.0f MiB (pool and buffers; "
                     "LLMEngine reserved %.0f MiB for them)", len(self.sizes), self.sizes, time.perf_counter() - t0,
                     (torch.cuda.memory_reserved(cache.device) - before) / 2**20, self.reserve_bytes() / 2**20)

    def reserve_bytes(self) -> int:
        """What LLMEngine._activation_reserve sets aside for these graphs (PREFILL_GRAPH_BYTES_PER_TOKEN per
        token of the largest bucket), for the log line to compare with."""
        return PREFILL_GRAPH_BYTES_PER_TOKEN * self.max_tokens

    @property
    def max_tokens(self) -> int:
        """The largest bucket; longer chunks run eagerly."""
        return self.sizes[-1]

    def bucket(self, t: int) -> int:
        """The smallest bucket holding t tokens (t <= max_tokens)."""
        return next(s for s in self.sizes if s >= t)

    def _capture(self, size: int) -> _Graph:
        cache, dev = self.cache, self.cache.device
        meta = DeviceBatch.allocate(2, size, self.width, size, dev)
        # capture (and warm up) on a row 0 of all `size` tokens in the scratch block and slot, row 1 empty
        scratch = [cache.scratch_block] * -(-size // cache.block_size)
        self._fill(meta, size, [size], [0], [scratch], [cache.scratch_slot])
        input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
        batch = ForwardBatch(cache, [size], [0], [scratch], [cache.scratch_slot], padded_prefill=True)
        batch.meta = meta
        if dev.type != "cuda":
            return _Graph(None, input_ids, meta, batch, None)
        graph, hidden = capture_graph(lambda: self.model.forward(input_ids, meta.positions, batch), dev, self.pool)
        self.pool = graph.pool()
        return _Graph(graph, input_ids, meta, batch, hidden)

    def _fill(self, meta: DeviceBatch, size: int, query_lens, context_lens, tables, slots) -> None:
        """Row 0 from the lists (one sequence), row 1 the padding of size - T tokens. max_query_len stays
        `size` (the grids the graph was captured with)."""
        c = self.cache
        DeviceBatch.build(query_lens, context_lens, tables, slots, c.block_size, c.device, pad_to=2,
                          pad_block=c.scratch_block, pad_slot=c.scratch_slot, out=meta,
                          pad_query_len=size - query_lens[0])
        meta.max_query_len = size

    def can_run(self, batch: ForwardBatch) -> bool:
        """Exactly one sequence, a chunk of 1 <= T <= max_tokens tokens, no GDN states kept (speculative
        verification), a block table within the static width. (A lone one-token step replays a decode graph
        first when there is one: `ModelRunner.forward` asks those before these.)"""
        return (len(batch.query_lens) == 1 and 1 <= batch.query_lens[0] <= self.max_tokens
                and not batch.keep_states[0] and len(batch.block_tables[0]) <= self.width)

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Replay the bucket's graph for `batch` (see `can_run`). input_ids: int64 [T]. Returns hidden [T, H]
        (a view of the graph's output buffer, valid until the next replay of this bucket). Writes the chunk's
        K/V into its blocks and its GDN state into its slot, as an eager pass; points batch.meta at the
        graph's static metadata (row 0 = the sequence: positions[:T] are its positions)."""
        t = batch.query_lens[0]
        size = self.bucket(t)
        st = self.graphs[size]
        self._fill(st.meta, size, batch.query_lens, batch.context_lens, batch.block_tables, batch.gdn_slots)
        st.input_ids[:t].copy_(input_ids, non_blocking=True)
        st.input_ids[t:].zero_()  # padding tokens: any valid id
        if st.graph is not None:
            st.graph.replay()
        else:  # no capture on the CPU: the pass a graph would replay, in the FP8 mode it would have recorded
            with prompt_pass(self.w8a8):
                st.hidden = self.model.forward(st.input_ids, st.meta.positions, st.batch)
        batch.meta = st.meta
        return st.hidden[:t]
