"""The reference forward pass on its own: prefill + decode equals one long prefill; batching is invisible."""

from __future__ import annotations

import torch

from vibeqwen.model.state import ForwardBatch, SequenceState


def _run(model, chunks: list[list[int]]):
    """Feed `chunks` one after another to one sequence; return logits of every token fed."""
    state, out = SequenceState(), []
    for c in chunks:
        pos = torch.arange(state.num_tokens, state.num_tokens + len(c))
        out.append(model.logits(model.forward(torch.tensor(c), pos, ForwardBatch([state], [len(c)]))))
    return torch.cat(out)


def test_prefill_then_decode_equals_one_prefill(tiny_model_fp32):
    _, model, _ = tiny_model_fp32
    ids = torch.randint(0, 248044, (150,)).tolist()  # > 2 GDN chunks of 64
    whole = _run(model, [ids])
    split = _run(model, [ids[:70], ids[70:71], ids[71:100], *[[t] for t in ids[100:]]])
    torch.testing.assert_close(split, whole, atol=1e-4, rtol=1e-4)


def test_flattened_batch_matches_single_sequences(tiny_model_fp32):
    _, model, _ = tiny_model_fp32
    seqs = [torch.randint(0, 248044, (n,)).tolist() for n in (5, 1, 33)]
    alone = [_run(model, [s]) for s in seqs]
    states = [SequenceState() for _ in seqs]
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    logits = model.logits(model.forward(ids, pos, ForwardBatch(states, [len(s) for s in seqs])))
    torch.testing.assert_close(logits, torch.cat(alone), atol=1e-4, rtol=1e-4)
