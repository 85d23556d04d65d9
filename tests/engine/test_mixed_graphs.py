"""A step that no one CUDA graph fits (decode rows next to prompt chunks, or several chunks) runs as one graph replay
per piece (`ModelRunner._graph_pieces`, `MIXED_GRAPH_MAX_CHUNKS`), or as one eager pass when a piece fits no graph.

The dispatch on the CPU with stand-in graphs and model: which pieces run where, and the hidden rows coming back in the
batch's row order. The same steps with real graphs, against eager passes, are in tests/model/test_gpu_path.py
(`test_mixed_steps_replay_graphs_per_piece`).
"""

from __future__ import annotations

import pytest
import torch

from vibeqwen.engine.runner import MIXED_GRAPH_MAX_CHUNKS, ModelRunner, mixed_graphs_enabled
from vibeqwen.model.state import ForwardBatch

H = 3


class _Graphs:
    """Runs a batch when `rule(query_lens, keep_states)` holds; its hidden rows are (input id, tag, token count)."""

    def __init__(self, tag: int, rule):
        self.tag, self.rule, self.calls = tag, rule, []

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.rule(batch.query_lens, batch.keep_states)

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert self.can_run(batch)
        self.calls.append(list(batch.query_lens))
        batch.meta = "graph meta"
        n = input_ids.shape[0]
        return torch.stack([input_ids.float(), torch.full((n,), float(self.tag)), torch.full((n,), float(n))], 1)


class _Model:
    fast = True

    def __init__(self):
        self.calls = []

    def forward(self, input_ids, positions, batch):
        self.calls.append(list(batch.query_lens))
        n = input_ids.shape[0]
        return torch.stack([input_ids.float(), torch.full((n,), -1.0), torch.full((n,), float(n))], 1)


class _Cache:
    """What DeviceBatch.build reads of a ModelCache (the eager passes build their batch's metadata)."""

    block_size, scratch_block, scratch_slot, device = 16, 7, 9, torch.device("cpu")


def _runner(prefill: bool = True, decode_max: int = 8):
    r = object.__new__(ModelRunner)
    r.model = _Model()
    r.fp8_prefill_w8a8 = False
    r.device = torch.device("cpu")
    r.graphs = _Graphs(1, lambda q, k: 0 < len(q) <= decode_max and all(x == 1 for x in q) and not any(k))
    r.verify_graphs = {4: _Graphs(2, lambda q, k: 0 < len(q) <= decode_max and all(x == 4 for x in q) and all(k))}
    r.prefill_graphs = _Graphs(3, lambda q, k: len(q) == 1 and 1 <= q[0] <= 256 and not k[0]) if prefill else None
    return r


def _batch(query_lens, keep=None):
    n = len(query_lens)
    tables = [list(range(-(-(5 + q) // 16))) for q in query_lens]
    return ForwardBatch(_Cache(), query_lens, [5] * n, tables, list(range(n)), keep)


def _run(runner, query_lens, keep=None):
    batch = _batch(query_lens, keep)
    ids = torch.arange(100, 100 + sum(query_lens))
    hidden = runner.forward(ids, batch)
    assert torch.equal(hidden[:, 0], ids.float())  # every row back in its place
    return batch, hidden


@pytest.fixture(autouse=True)
def _default_switch(monkeypatch):
    monkeypatch.delenv("VIBEQWEN_MIXED_GRAPHS", raising=False)


def test_decode_rows_and_a_chunk_replay_two_graphs():
    r = _runner()
    batch, hidden = _run(r, [1, 1, 1, 40])
    assert r.graphs.calls == [[1, 1, 1]] and r.prefill_graphs.calls == [[40]] and r.model.calls == []
    assert hidden[:3, 1].tolist() == [1.0] * 3 and hidden[3:, 1].tolist() == [3.0] * 40
    assert r.last_graphed and batch.meta is None and batch.split_passes == []


def test_rows_in_any_order_and_several_chunks():
    r = _runner()
    _, hidden = _run(r, [30, 1, 7, 1, 2])
    # decode rows 1 and 3 in one replay, each chunk in its own, in batch order
    assert r.graphs.calls == [[1, 1]] and r.prefill_graphs.calls == [[30], [7], [2]]
    assert hidden[30, 1] == 1 and hidden[38, 1] == 1 and hidden[30, 2] == 2  # the decode replay ran 2 tokens
    assert hidden[:30, 1].tolist() == [3.0] * 30 and hidden[31:38, 2].tolist() == [7.0] * 7
    # prompt chunks only (two new prompts): one replay each
    r = _runner()
    _run(r, [50, 60])
    assert r.prefill_graphs.calls == [[50], [60]] and r.graphs.calls == [] and r.model.calls == []


def test_verification_rows_and_a_chunk():
    r = _runner()
    vg = r.verify_graphs[4]
    run = vg.run

    def with_history(input_ids, batch):  # a verification graph leaves its per-token GDN states on its batch
        batch.gdn_history_batched = {0: "history"}
        return run(input_ids, batch)

    vg.run = with_history
    batch, hidden = _run(r, [20, 4, 4], keep=[False, True, True])
    assert vg.calls == [[4, 4]] and r.prefill_graphs.calls == [[20]]
    assert hidden[20:, 1].tolist() == [2.0] * 8 and r.last_graphed
    # execute commits the rollback through the verification piece's sub-batch, its sequences named by index
    (idx, sub), = batch.split_passes
    assert idx == [1, 2] and sub.gdn_history_batched == {0: "history"} and sub.query_lens == [4, 4]


def test_eager_when_a_piece_fits_no_graph(monkeypatch):
    # too many decode rows for the decode graphs: one eager pass of everything (not a replay and an eager pass)
    r = _runner(decode_max=2)
    _run(r, [1, 1, 1, 9])
    assert r.model.calls == [[1, 1, 1, 9]] and r.graphs.calls == r.prefill_graphs.calls == [] and not r.last_graphed
    # a chunk longer than every prefill bucket
    r = _runner()
    _run(r, [1, 300])
    assert r.model.calls == [[1, 300]] and not r.last_graphed
    # more chunks than MIXED_GRAPH_MAX_CHUNKS
    r = _runner()
    _run(r, [1] + [3] * (MIXED_GRAPH_MAX_CHUNKS + 1))
    assert len(r.model.calls) == 1 and r.prefill_graphs.calls == []
    # exactly MIXED_GRAPH_MAX_CHUNKS chunks still split
    r = _runner()
    _run(r, [1] + [3] * MIXED_GRAPH_MAX_CHUNKS)
    assert r.model.calls == [] and len(r.prefill_graphs.calls) == MIXED_GRAPH_MAX_CHUNKS
    # mixed decode and verification rows (no one graph for them): eager, split as before (verification + decode
    # in one pass, the chunk in another)
    r = _runner()
    _run(r, [4, 1, 20], keep=[True, False, False])
    assert r.model.calls == [[4, 1], [20]] and not r.last_graphed
    # no prefill graphs at all (not captured): the one eager pass
    r = _runner(prefill=False)
    _run(r, [1, 1, 40])
    assert r.model.calls == [[1, 1, 40]] and r.graphs.calls == []


def test_switch(monkeypatch):
    assert mixed_graphs_enabled()
    monkeypatch.setenv("VIBEQWEN_MIXED_GRAPHS", "0")
    assert not mixed_graphs_enabled()
    r = _runner()
    _run(r, [1, 1, 40])
    assert r.model.calls == [[1, 1, 40]] and r.graphs.calls == r.prefill_graphs.calls == []
    # whole-batch graphs are unaffected by the switch
    _run(r, [1, 1])
    assert r.graphs.calls == [[1, 1]]
    monkeypatch.setenv("VIBEQWEN_MIXED_GRAPHS", "yes")
    with pytest.raises(ValueError, match="VIBEQWEN_MIXED_GRAPHS"):
        mixed_graphs_enabled()
