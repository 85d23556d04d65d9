"""DeviceBatch.build (the GPU path's per-step metadata, built on the host) against a direct construction:
decode rows, longer queries, empty queries, padding rows, static buffers, BlockTable and plain-list tables."""

import numpy as np
import pytest
import torch

from vibeqwen.engine.cache import BlockTable
from vibeqwen.model.meta import DeviceBatch


def _expected(query_lens, context_lens, tables, slots, bs, pad_to, pad_block, pad_slot, pad_q):
    n = len(query_lens)
    b = pad_to or n
    qlens = list(query_lens) + [pad_q] * (b - n)
    ctx = list(context_lens) + [0] * (b - n)
    qsl = np.concatenate([[0], np.cumsum(qlens)])
    pos, slot_map = [], []
    for i in range(b):
        for p in range(ctx[i], ctx[i] + qlens[i]):
            pos.append(p)
            if i < n:
                slot_map.append(tables[i][p // bs] * bs + p % bs)
            else:
                slot_map.append(pad_block * bs + p % bs)
    return qsl, [c + q for c, q in zip(ctx, qlens)], [c > 0 for c in ctx], pos, slot_map, \
        list(slots) + [pad_slot] * (b - n)


@pytest.mark.parametrize("table_type", [list, BlockTable])
@pytest.mark.parametrize("static", [False, True])
def test_build_matches_a_direct_construction(table_type, static):
    rng = np.random.default_rng(3)
    bs = 4
    for case in range(20):
        n = int(rng.integers(1, 9))
        query_lens = [int(rng.choice([0, 1, 1, 1, 3, 7])) for _ in range(n)]
        context_lens = [int(rng.integers(0, 30)) for _ in range(n)]
        tables = []
        for q, c in zip(query_lens, context_lens):
            need = -(-(q + c) // bs) + int(rng.integers(0, 2))
            t = table_type()
            for blk in rng.permutation(200)[:need].tolist():
                t.append(blk)
            tables.append(t)
        slots = rng.permutation(50)[:n].tolist()
        pad_to = n + int(rng.integers(0, 3))
        pad_q = 1 if case % 2 else 2
        width = 12
        t_total = sum(query_lens) + (pad_to - n) * pad_q
        out = DeviceBatch.allocate(pad_to, t_total, width, 8, "cpu") if static else None
        meta = DeviceBatch.build(query_lens, context_lens, tables, slots, bs, "cpu", width=width, pad_to=pad_to,
                                 pad_block=199, pad_slot=49, out=out, pad_query_len=pad_q)
        qsl, seq_lens, init, pos, slot_map, gdn = _expected(query_lens, context_lens, tables, slots, bs, pad_to,
                                                            199, 49, pad_q)
        assert meta.query_start_loc.tolist() == qsl.tolist()
        assert meta.query_start_loc_cpu.tolist() == qsl.tolist()
        assert meta.seq_lens.tolist() == seq_lens
        assert meta.has_initial_state.tolist() == init
        assert meta.positions.tolist() == pos
        assert meta.slot_mapping.tolist() == slot_map
        assert meta.gdn_slots.tolist() == gdn
        for i, t in enumerate(tables):
            assert meta.block_tables[i, : len(t)].tolist() == list(t)
        assert meta.max_query_len == max(query_lens + [pad_q] * (pad_to - n))


@pytest.mark.parametrize("static", [False, True])
def test_padding_rows_longer_than_a_block_stay_in_the_pad_block(static):
    """A whole-chunk prefill graph (PrefillGraphs) pads one real sequence with ONE dummy row of B - T tokens,
    often many blocks long: its slot mapping wraps inside the pad block (never another block, never past the
    cache), its positions run 0 .. len - 1 with seq_len len (what the attention kernel derives its key
    positions from), and every table column it reads holds the pad block, even when the real table is
    shorter, and with static buffers whose stale columns held real blocks."""
    bs, pad_block, width = 16, 99, 12
    table = [5, 3, 8]  # 40 tokens of context + 8 new
    out = DeviceBatch.allocate(2, 128, width, 128, "cpu") if static else None
    if static:  # stale columns from an earlier, longer sequence (real blocks)
        out.block_tables.copy_(torch.arange(2 * width, dtype=torch.int32).view(2, width))
    for t_real, ctx in [(17, 0), (48, 0), (8, 40), (128, 0)]:
        tab = table if ctx else [[1, 2, 4, 6, 7, 9, 10, 11][i] for i in range(-(-t_real // bs))]
        pad = 128 - t_real
        meta = DeviceBatch.build([t_real], [ctx], [tab], [3], bs, "cpu", pad_to=2, pad_block=pad_block,
                                 pad_slot=7, out=out, pad_query_len=pad)
        sm = meta.slot_mapping.tolist()
        assert sm[:t_real] == [tab[p // bs] * bs + p % bs for p in range(ctx, ctx + t_real)]
        assert all(pad_block * bs <= s < (pad_block + 1) * bs for s in sm[t_real:]), "padding left its block"
        assert sm[t_real:] == [pad_block * bs + p % bs for p in range(pad)]
        assert meta.positions.tolist()[t_real:] == list(range(pad))
        assert meta.seq_lens.tolist() == [ctx + t_real, pad]
        assert meta.query_start_loc.tolist() == [0, t_real, 128]
        assert meta.has_initial_state.tolist() == [ctx > 0, False]
        assert meta.gdn_slots.tolist() == [3, 7]
        assert meta.block_tables[1, : -(-pad // bs)].tolist() == [pad_block] * -(-pad // bs)
        assert meta.block_tables[0, : len(tab)].tolist() == list(tab)
        if not static:
            assert meta.block_tables.shape[1] >= -(-pad // bs)
    with pytest.raises(ValueError, match="exceeds the static width"):  # a dummy wider than the buffers
        DeviceBatch.build([1], [0], [[1]], [0], 4, "cpu", pad_to=2, pad_query_len=4 * width + 1,
                          out=DeviceBatch.allocate(2, 4 * width + 2, width, 8, "cpu"))


def test_build_rejects_short_and_wide_tables():
    with pytest.raises(ValueError, match="sequence 1: block table covers 4 tokens, need 6"):
        DeviceBatch.build([1, 2], [0, 4], [[0], [1]], [0, 1], 4, "cpu")
    with pytest.raises(ValueError, match="sequence 0: 3 blocks exceed the table width 2"):
        DeviceBatch.build([1], [0], [[0, 1, 2]], [0], 4, "cpu", width=2)


def test_block_table_mirror_follows_every_change():
    t = BlockTable()
    for i in range(40):
        t.append(i)
        assert t.array().tolist() == list(t)
    t.pop()
    t[0] = 99
    t.extend([5, 6])
    del t[1]
    t.insert(0, 7)
    t += [8]
    assert t.array().dtype == np.int32 and t.array().tolist() == list(t)
    t.append(11)
    assert t.array().tolist() == list(t)
    t.clear()
    assert t.array().tolist() == []
    assert torch.tensor(t).numel() == 0 and isinstance(t, list)
