"""Cache bookkeeping at toy sizes: exact block ids, slot reuse, all-or-nothing allocation, no leaks."""

from __future__ import annotations

import random

import pytest

from vibeqwen.engine.cache import CacheConfig, CacheManager


def test_allocate_grows_block_table_and_takes_one_slot():
    cm = CacheManager(CacheConfig(num_blocks=6, block_size=4, num_slots=2))
    assert cm.allocate("a", 5)  # 2 blocks
    assert cm.block_tables["a"] == [0, 1] and cm.slots["a"] == 0
    assert cm.allocate("a", 8)  # still 2 blocks
    assert cm.block_tables["a"] == [0, 1]
    assert cm.allocate("a", 9)  # a third
    assert cm.block_tables["a"] == [0, 1, 2] and cm.slots["a"] == 0
    assert cm.allocate("b", 1) and cm.block_tables["b"] == [3] and cm.slots["b"] == 1
    assert cm.num_free_blocks == 2 and cm.num_free_slots == 0


def test_allocation_is_all_or_nothing():
    cm = CacheManager(CacheConfig(num_blocks=3, block_size=4, num_slots=2))
    assert cm.allocate("a", 8)
    assert not cm.allocate("b", 9)  # needs 3 blocks, 1 free
    assert "b" not in cm.block_tables and "b" not in cm.slots and cm.num_free_slots == 1
    assert cm.allocate("b", 4)
    assert not cm.allocate("c", 1)  # no slot left
    assert cm.num_free_blocks == 0


def test_free_returns_blocks_in_order_and_slot():
    cm = CacheManager(CacheConfig(num_blocks=4, block_size=2, num_slots=2))
    cm.allocate("a", 4)
    cm.allocate("b", 2)
    cm.free("a")
    assert cm.num_free_blocks == 3 and cm.num_free_slots == 1
    cm.free("a")  # idempotent
    assert cm.num_free_blocks == 3
    assert cm.allocate("c", 6) and cm.block_tables["c"] == [3, 0, 1] and cm.slots["c"] == 0


def test_budget_split_and_too_small_budget():
    cfg = CacheConfig.from_budget(budget_bytes=10_000, block_bytes=100, slot_bytes=1000, block_size=16, max_num_seqs=4)
    assert cfg.num_slots == 4 and cfg.num_blocks == 60
    with pytest.raises(ValueError, match="too small.*lower --max-num-seqs$") as e:
        CacheConfig.from_budget(budget_bytes=4_100, block_bytes=100, slot_bytes=1000, block_size=16, max_num_seqs=4)
    assert "block-size" not in str(e.value)  # the state slots take the room, not the blocks
    # blocks that take most of the room (a huge --block-size) are named, with their size
    with pytest.raises(ValueError, match=r"a KV block of 100000 tokens each, 4 x 95\.4 MiB = 381 MiB.*lower "
                                         r"--block-size or --max-num-seqs$"):
        CacheConfig.from_budget(budget_bytes=2**20, block_bytes=100_000 * 1000, slot_bytes=1000, block_size=100_000,
                                max_num_seqs=4)
    # a tiny model's sizes as numbers, and the parts add up to the need (a break-it trial read "0.0 MiB" for a block)
    with pytest.raises(ValueError, match=r"budget of 4 KiB .*needs at least 4\.3 KiB: a KV block of 16 tokens "
                                         r"each, 4 x 100 B = 400 B, and 3\.91 KiB of state slots"):
        CacheConfig.from_budget(budget_bytes=4_100, block_bytes=100, slot_bytes=1000, block_size=16, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"budget of 0 B .*64 x 2 MiB = 128 MiB, and 10\.8 GiB of state slots"):
        CacheConfig.from_budget(budget_bytes=0, block_bytes=2 << 20, slot_bytes=(11008 << 20) // 64, block_size=16,
                                max_num_seqs=64)
    with pytest.raises(ValueError, match="lower --max-num-seqs or --prefix-cache-slots$"):
        CacheConfig.from_budget(budget_bytes=4_100, block_bytes=100, slot_bytes=1000, block_size=16, max_num_seqs=4,
                                num_prefix_slots=2)


def test_thousands_of_random_operations_leak_nothing():
    rng = random.Random(0)
    cm = CacheManager(CacheConfig(num_blocks=64, block_size=4, num_slots=8))
    live: dict[str, int] = {}
    for step in range(5000):
        op = rng.random()
        if op < 0.5:
            rid = f"r{step}"
            n = rng.randint(1, 40)
            if cm.allocate(rid, n):
                live[rid] = n
        elif op < 0.8 and live:
            rid = rng.choice(list(live))
            n = live[rid] + rng.randint(1, 8)
            if cm.allocate(rid, n):
                live[rid] = n
        elif live:
            rid = rng.choice(list(live))
            cm.free(rid)
            del live[rid]
        used = {b for t in cm.block_tables.values() for b in t}
        assert len(used) == sum(len(t) for t in cm.block_tables.values()), "a block is owned twice"
        assert cm.num_free_blocks + len(used) == 64
        assert cm.num_free_slots + len(cm.slots) == 8
    for rid in list(live):
        cm.free(rid)
    assert cm.num_free_blocks == 64 and cm.num_free_slots == 8
