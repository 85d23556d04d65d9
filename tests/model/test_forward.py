"""The reference forward pass on its own: prefill + decode equals one long prefill; batching is invisible."""

from __future__ import annotations

import torch

from seqrun import Sequences


def _run(model, chunks: list[list[int]]):
    """Feed `chunks` one after another to one sequence; return logits of every token fed."""
    seqs = Sequences(model, num_seqs=1)
    return torch.cat([seqs.run({0: c}) for c in chunks if c])


def test_prefill_then_decode_equals_one_prefill(tiny_model_fp32):
    _, model, _ = tiny_model_fp32
    ids = torch.randint(0, 248044, (150,)).tolist()  # > 2 GDN chunks of 64, > 18 KV blocks of 8
    whole = _run(model, [ids])
    split = _run(model, [ids[:70], ids[70:71], ids[71:100], *[[t] for t in ids[100:130]], ids[130:]])
    # float32, chunked vs token-by-token GDN and different matmul shapes: op-order noise only (observed
    # up to ~1.2e-4 on logits of unit scale); a wrong state hand-over moves logits by O(0.1)
    torch.testing.assert_close(split, whole, atol=5e-4, rtol=1e-4)


def test_flattened_mixed_batch_matches_single_sequences(tiny_model_fp32):
    _, model, _ = tiny_model_fp32
    prompts = [torch.randint(0, 248044, (n,)).tolist() for n in (5, 1, 33, 70)]
    alone = [_run(model, [p[:-1], p[-1:]]) for p in prompts]
    seqs = Sequences(model, num_seqs=4)
    # step 1: prefill chunks of all four; step 2: a decode for each (mixed lengths in one flattened batch)
    first = seqs.run({i: p[:-1] for i, p in enumerate(prompts) if len(p) > 1})
    second = seqs.run({3: prompts[3][-1:], 1: prompts[1], 0: prompts[0][-1:], 2: prompts[2][-1:]})
    got = [None] * 4
    off = 0
    for i in (0, 2, 3):
        n = len(prompts[i]) - 1
        got[i] = [first[off : off + n]]
        off += n
    for j, i in enumerate((3, 1, 0, 2)):
        got[i] = (got[i] or []) + [second[j : j + 1]]
    for i in range(4):
        torch.testing.assert_close(torch.cat(got[i]), alone[i], atol=1e-4, rtol=1e-4)


def test_reused_gdn_slot_starts_from_zero_state(tiny_model_fp32):
    _, model, _ = tiny_model_fp32
    a, b = torch.randint(0, 248044, (20,)).tolist(), torch.randint(0, 248044, (12,)).tolist()
    seqs = Sequences(model, num_seqs=1)
    seqs.run({0: a})
    seqs.lens[0] = 0  # the slot and blocks now belong to a new sequence
    torch.testing.assert_close(seqs.run({0: b}), _run(model, [b]), atol=1e-5, rtol=1e-5)
