"""CPU-side cache bookkeeping: KV blocks and GDN state slots, behind one allocate / free interface.

Attention layers use a paged KV cache: fixed-size blocks from a free list, a block table per sequence.
GDN layers keep one state slot (conv + recurrent state) per running sequence. A request holds one slot
from its first scheduled step until it finishes, is aborted or is preempted; blocks grow with its tokens.

With prefix caching (`CacheConfig.num_prefix_slots` > 0, `vibeqwen.engine.prefix_cache`) blocks are reference
counted: a block may sit in several block tables and prefix entries. A block only entries reference is cached:
it counts as free (`num_free_blocks`) and is reclaimed, least recently used entry first, when an allocation needs
it. Moving GDN states and partial blocks between slots is left to the device: the copies queue up in
`pending_copies`, which the model runner applies, in order, before its next forward pass.
No torch here (numpy only): the scheduler and its tests run anywhere.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from vibeqwen.engine.prefix_cache import PrefixCache, PrefixEntry


@dataclass(frozen=True)
class CacheConfig:
    """num_blocks KV blocks of block_size tokens, num_slots GDN state slots for running sequences (ids
    [0, num_slots)) and num_prefix_slots more for prefix-cache snapshots (ids [num_slots, num_slots +
    num_prefix_slots); 0: no prefix caching)."""

    num_blocks: int
    block_size: int
    num_slots: int
    num_prefix_slots: int = 0

    @classmethod
    def from_budget(cls, budget_bytes: int, block_bytes: int, slot_bytes: int, block_size: int,
                    max_num_seqs: int, num_prefix_slots: int = 0) -> "CacheConfig":
        """Split a byte budget: one GDN slot per possible running sequence, `num_prefix_slots` for prefix-cache
        snapshots, the rest to KV blocks.

        Raises ValueError when the budget cannot hold the slots plus one block per sequence.
        """
        slots_bytes = (max_num_seqs + num_prefix_slots) * slot_bytes
        num_blocks = (budget_bytes - slots_bytes) // block_bytes
        if num_blocks < max_num_seqs:
            need = slots_bytes + max_num_seqs * block_bytes
            extra = f" and {num_prefix_slots} prefix-cache state slots" if num_prefix_slots else ""
            # name what takes the room: one KV block per sequence (--block-size tokens each), the state slots
            knobs = ["--max-num-seqs"] + (["--prefix-cache-slots"] if num_prefix_slots else [])
            if max_num_seqs * block_bytes > slots_bytes:
                knobs.insert(0, "--block-size")
            raise ValueError(
                f"cache budget of {_size(budget_bytes)} is too small for {max_num_seqs} sequences{extra} "
                f"(needs at least {_size(need)}: a KV block of {block_size} tokens each, "
                f"{max_num_seqs} x {_size(block_bytes)} = {_size(max_num_seqs * block_bytes)}, and "
                f"{_size(slots_bytes)} of state slots); raise the budget "
                f"or lower {', '.join(knobs[:-1]) + ' or ' + knobs[-1] if len(knobs) > 1 else knobs[0]}"
            )
        return cls(int(num_blocks), block_size, max_num_seqs, num_prefix_slots)


def _size(n: int) -> str:
    """A byte count for a message, in the largest binary unit it reaches (B, KiB, MiB, GiB) with 3 significant
    digits: a tiny model's 100-byte block and the full model's GiB budgets both read as numbers."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


class BlockTable(list):
    """A request's KV block ids: a list, plus an int32 numpy copy kept in step so that building a batch's
    device metadata copies the table instead of converting Python ints every step. `append` writes the
    copy in place (amortised growth); every other change rebuilds it on the next `array()`."""

    __slots__ = ("_mirror", "_valid")

    def __init__(self, *args):
        super().__init__(*args)
        self._mirror = np.empty(max(16, len(self)), dtype=np.int32)
        self._valid = False

    def array(self) -> np.ndarray:
        """The ids as int32 [len] (a view; valid until the next change)."""
        n = len(self)
        if not self._valid:
            if self._mirror.shape[0] < n:
                self._mirror = np.empty(2 * n, dtype=np.int32)
            self._mirror[:n] = self
            self._valid = True
        return self._mirror[:n]

    def append(self, block: int) -> None:
        n = len(self)
        super().append(block)
        if self._valid:
            if self._mirror.shape[0] <= n:
                grown = np.empty(2 * (n + 1), dtype=np.int32)
                grown[:n] = self._mirror[:n]
                self._mirror = grown
            self._mirror[n] = block

    def _changed(name):
        def method(self, *args, **kwargs):
            self._valid = False
            return getattr(list, name)(self, *args, **kwargs)

        method.__name__ = name
        return method

    for _name in ("pop", "extend", "insert", "remove", "clear", "sort", "reverse", "__setitem__",
                  "__delitem__", "__iadd__", "__imul__"):
        locals()[_name] = _changed(_name)
    del _name, _changed


class CacheManager:
    """Owns which KV blocks and GDN slots each request holds, and the prefix cache's entries.

    `allocate(request_id, num_tokens)` makes the request's cache hold `num_tokens` tokens in total
    (growing its block table, taking a slot on first use) and returns False, changing nothing, when the
    free lists cannot cover it. `free(request_id)` returns everything the request holds. With prefix caching,
    `match` finds a cached prefix, `allocate_prefix` starts a request on it and `snapshot` caches a request's
    computed tokens.
    """

    def __init__(self, config: CacheConfig):
        self.config = config
        self.block_size = config.block_size
        self._free_blocks: deque[int] = deque(range(config.num_blocks))
        self._free_slots: deque[int] = deque(range(config.num_slots))
        self.block_tables: dict[str, BlockTable] = {}
        self.slots: dict[str, int] = {}
        # references per block: from block tables and prefix entries; entry references alone make it cached
        self._refs = [0] * config.num_blocks
        self._entry_refs = [0] * config.num_blocks
        self._num_cached = 0
        self.prefix: PrefixCache | None = PrefixCache(
            config.block_size, list(range(config.num_slots, config.num_slots + config.num_prefix_slots))
        ) if config.num_prefix_slots else None
        # with MTP drafting an entry also records the token after its prefix (see PrefixEntry.next_token); the engine
        # sets this when its MTP head drafts
        self.match_next_token = False
        # device copies to apply, in order, before the next forward pass: ("state", src slot, dst slot) copies a
        # GDN conv + recurrent state, ("block", src block, dst block) a KV block of every attention layer
        self.pending_copies: list[tuple[str, int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        """KV blocks an allocation can take: the free list plus cached blocks no request holds."""
        return len(self._free_blocks) + self._num_cached

    @property
    def num_free_slots(self) -> int:
        """GDN state slots on the free list."""
        return len(self._free_slots)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks the request needs to hold `num_tokens` tokens."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """Whether `allocate(request_id, num_tokens)` would succeed (blocks, and a slot if it has none)."""
        needs_slot = request_id not in self.slots
        return (self.blocks_needed(request_id, num_tokens) <= self.num_free_blocks
                and (not needs_slot or self._free_slots))

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's cache to `num_tokens` tokens; False (and no change) if it does not fit. Evicts
        least recently used prefix entries when the free list alone is short."""
        if not self.can_allocate(request_id, num_tokens):
            return False
        if request_id not in self.slots:
            self.slots[request_id] = self._free_slots.popleft()
        table = self.block_tables.get(request_id)
        if table is None:
            table = self.block_tables[request_id] = BlockTable()
        need = self.blocks_needed(request_id, num_tokens)
        self._reclaim(need)
        for _ in range(need):
            table.append(self._take_block())
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Return the request's blocks beyond those needed for `num_tokens` tokens (rejected drafts)."""
        table = self.block_tables.get(request_id)
        keep = -(-num_tokens // self.block_size)
        while table and len(table) > keep:
            self._unref(table.pop())

    def free(self, request_id: str) -> None:
        """Return the request's blocks and slot (no-op for an unknown id). A block a prefix entry (or another
        request) references stays where it is."""
        for block in self.block_tables.pop(request_id, ()):
            self._unref(block)
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def usage(self) -> tuple[float, float]:
        """(KV block usage, GDN slot usage), each in [0, 1]; cached blocks no request holds count as free."""
        c = self.config
        return 1 - self.num_free_blocks / c.num_blocks, 1 - len(self._free_slots) / c.num_slots

    # ---- prefix caching ----
    def match(self, tokens: list[int], hashes: list[int], limit: int) -> PrefixEntry | None:
        """The longest cached prefix of `tokens` of at most `limit` tokens (see `PrefixCache.lookup`), or None."""
        return self.prefix.lookup(tokens, hashes, limit) if self.prefix is not None else None

    def allocate_prefix(self, request_id: str, entry: PrefixEntry, num_tokens: int) -> bool:
        """Start a request without cache on `entry`'s prefix and grow it to `num_tokens` tokens (> the prefix):
        share the entry's full blocks, copy its partial last block (if any) into a new one, copy its GDN state
        into the request's slot. False (and no change) if it does not fit."""
        if request_id in self.slots or request_id in self.block_tables:
            raise ValueError(f"request {request_id!r} already holds cache")
        b, p = self.block_size, entry.num_tokens
        if num_tokens <= p:
            raise ValueError(f"a prefix hit of {p} tokens must leave tokens to run, asked for {num_tokens}")
        shared = entry.blocks[: p // b]
        pinned = entry.blocks[: -(-p // b)]  # the shared blocks and the partial one to copy from
        need = -(-num_tokens // b) - len(shared)
        # pinning a cached block takes it out of what eviction can reclaim
        pinned_cached = sum(1 for x in pinned if self._refs[x] == self._entry_refs[x])
        if not self._free_slots or need > self.num_free_blocks - pinned_cached:
            return False
        self.prefix.touch(entry)
        for x in pinned:
            self._ref(x)
        self._reclaim(need)
        slot = self.slots[request_id] = self._free_slots.popleft()
        table = self.block_tables[request_id] = BlockTable(shared)
        for _ in range(need):
            table.append(self._take_block())
        self.pending_copies.append(("state", entry.slot, slot))
        if p % b:
            self.pending_copies.append(("block", entry.blocks[-1], table[len(shared)]))
        for x in pinned[len(shared):]:
            self._unref(x)  # the partial block: copied (the copy runs before anything can reuse it)
        return True

    def snapshot(self, request_id: str, tokens: list[int], hashes: list[int], next_token: int | None = None) -> bool:
        """Cache the request's first len(tokens) tokens (`tokens`, whose K/V and GDN state the request's cache holds
        now; `hashes`: chain hashes of at least their full blocks; `next_token`: the request's token after them, kept
        with `match_next_token`): an entry referencing the blocks, with the GDN state copied to a prefix slot
        (evicting the least recently used entry when none is free). A prefix already cached is left as it is.
        Returns whether the prefix is cached (False: prefix caching off, or shorter than one block)."""
        b, p = self.block_size, len(tokens)
        if self.prefix is None or p < b:
            return False
        key = tuple(tokens)
        if self.prefix.get(key) is not None:
            return True  # computing a prefix again is no use of its entry: only hits keep entries young
        table = self.block_tables[request_id]
        if len(table) * b < p:
            raise ValueError(f"request {request_id!r} holds {len(table) * b} tokens of blocks, not {p}")
        if self.prefix.needs_slot():
            self._evict(self.prefix.oldest())
        e = self.prefix.insert(key, table[: -(-p // b)], hashes[: p // b],
                               next_token if self.match_next_token else None)
        for x in e.blocks:
            self._ref(x, entry=True)
        self.pending_copies.append(("state", self.slots[request_id], e.slot))
        return True

    def take_copies(self) -> list[tuple[str, int, int]]:
        """The device copies queued since the last call, in order (see `pending_copies`)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def clear_prefix_cache(self) -> int:
        """Evict every prefix entry; returns how many there were."""
        n = 0
        while self.prefix is not None and len(self.prefix):
            self._evict(self.prefix.oldest())
            n += 1
        return n

    # ---- block references ----
    def _take_block(self) -> int:
        block = self._free_blocks.popleft()
        self._refs[block] = 1
        return block

    def _ref(self, block: int, entry: bool = False) -> None:
        refs, entry_refs = self._refs, self._entry_refs
        was_cached = refs[block] > 0 and refs[block] == entry_refs[block]
        refs[block] += 1
        entry_refs[block] += entry
        self._num_cached += (refs[block] == entry_refs[block]) - was_cached

    def _unref(self, block: int, entry: bool = False) -> None:
        refs, entry_refs = self._refs, self._entry_refs
        was_cached = refs[block] == entry_refs[block]
        refs[block] -= 1
        entry_refs[block] -= entry
        if refs[block] == 0:
            self._num_cached -= was_cached
            self._free_blocks.append(block)
        else:
            self._num_cached += (refs[block] == entry_refs[block]) - was_cached

    def _evict(self, entry: PrefixEntry) -> None:
        self.prefix.remove(entry)
        for block in entry.blocks:
            self._unref(block, entry=True)

    def _reclaim(self, n: int) -> None:
        """Evict least recently used entries until the free list holds `n` blocks (or no entry can add one). An
        entry none of whose blocks is cached only (every one also in a request's table) is kept: evicting it would
        free nothing."""
        if self.prefix is None:
            return
        for e in self.prefix.entries():
            if len(self._free_blocks) >= n:
                return
            if any(self._refs[b] == self._entry_refs[b] for b in e.blocks):
                self._evict(e)
