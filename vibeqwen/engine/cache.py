"""CPU-side cache bookkeeping: KV blocks and GDN state slots, behind one allocate / free interface.

Attention layers use a paged KV cache: fixed-size blocks from a free list, a block table per sequence.
GDN layers keep one state slot (conv + recurrent state) per running sequence. A request holds one slot
from its first scheduled step until it finishes, is aborted or is preempted; blocks grow with its tokens.
No torch here (numpy only): the scheduler and its tests run anywhere.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CacheConfig:
    """num_blocks KV blocks of block_size tokens, and num_slots GDN state slots."""

    num_blocks: int
    block_size: int
    num_slots: int

    @classmethod
    def from_budget(cls, budget_bytes: int, block_bytes: int, slot_bytes: int, block_size: int,
                    max_num_seqs: int) -> "CacheConfig":
        """Split a byte budget: one GDN slot per possible running sequence, the rest to KV blocks.

        Raises ValueError when the budget cannot hold the slots plus one block per sequence.
        """
        slots_bytes = max_num_seqs * slot_bytes
        num_blocks = (budget_bytes - slots_bytes) // block_bytes
        if num_blocks < max_num_seqs:
            need = slots_bytes + max_num_seqs * block_bytes
            raise ValueError(
                f"cache budget of {budget_bytes / 2**20:.1f} MiB is too small for {max_num_seqs} sequences "
                f"(needs at least {need / 2**20:.1f} MiB); raise the budget or lower --max-num-seqs"
            )
        return cls(int(num_blocks), block_size, max_num_seqs)


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
    """Owns which KV blocks and GDN slots each request holds.

    `allocate(request_id, num_tokens)` makes the request's cache hold `num_tokens` tokens in total
    (growing its block table, taking a slot on first use) and returns False, changing nothing, when the
    free lists cannot cover it. `free(request_id)` returns everything the request holds.
    """

    def __init__(self, config: CacheConfig):
        self.config = config
        self.block_size = config.block_size
        self._free_blocks: deque[int] = deque(range(config.num_blocks))
        self._free_slots: deque[int] = deque(range(config.num_slots))
        self.block_tables: dict[str, BlockTable] = {}
        self.slots: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """KV blocks on the free list."""
        return len(self._free_blocks)

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
        return (self.blocks_needed(request_id, num_tokens) <= len(self._free_blocks)
                and (not needs_slot or self._free_slots))

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's cache to `num_tokens` tokens; False (and no change) if it does not fit."""
        if not self.can_allocate(request_id, num_tokens):
            return False
        if request_id not in self.slots:
            self.slots[request_id] = self._free_slots.popleft()
        table = self.block_tables.get(request_id)
        if table is None:
            table = self.block_tables[request_id] = BlockTable()
        for _ in range(self.blocks_needed(request_id, num_tokens)):
            table.append(self._free_blocks.popleft())
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Return the request's blocks beyond those needed for `num_tokens` tokens (rejected drafts)."""
        table = self.block_tables.get(request_id)
        keep = -(-num_tokens // self.block_size)
        while table and len(table) > keep:
            self._free_blocks.append(table.pop())

    def free(self, request_id: str) -> None:
        """Return the request's blocks and slot to the free lists (no-op for an unknown id)."""
        self._free_blocks.extend(self.block_tables.pop(request_id, ()))
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def usage(self) -> tuple[float, float]:
        """(KV block usage, GDN slot usage), each in [0, 1]."""
        c = self.config
        return 1 - len(self._free_blocks) / c.num_blocks, 1 - len(self._free_slots) / c.num_slots
