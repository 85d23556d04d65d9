"""Automatic prefix caching for a hybrid model: shared KV blocks plus snapshots of the GDN state.

An attention-only engine (vLLM, SGLang) can reuse any cached run of KV blocks. This model's Gated DeltaNet layers
carry a recurrent state that cannot be rewound, so a prefix can be reused only where a snapshot of that state was
taken. An entry is one such prefix: its token ids, the KV blocks holding them (the entry holds a reference on each)
and a prefix state slot holding the GDN conv + recurrent state after them.

Snapshots are taken where a later request is likely to start with the same tokens (`vibeqwen.engine.scheduler`):
- the end of every prompt: a chat's next turn extends it;
- the end of every request that finishes (stop or length): a conversation or an agent loop resends prompt + reply
  + what follows;
- a branch point: where a new prompt leaves the longest block-aligned prefix it shares with an entry (say a system
  prompt shared by many users). That prompt's prefill stops there once for the snapshot, so the next request with
  the same prefix hits it;
- one token before the end of a prompt that was seen whole before (a resent prompt, "regenerate"), which an entry
  at its very end cannot serve (see below).

A hit of p tokens on a sequence of n tokens needs p <= n - 1: at least one token runs, giving the next token's
logits. The request shares the entry's full blocks [0, p // B), gets a private copy of the entry's partial last
block when p % B != 0 (it writes positions p onward there), and a state slot copied from the entry's; its prefill
starts at position p. Positions below p of a shared block are never written again by anyone: the owner of a block
writes only at positions at or past its own computed tokens, which are past every entry it made.

Block references, free lists and the device copies are the `CacheManager`'s; this module keeps the entries, their
lookup index and their least-recently-used order, and owns no torch (the scheduler's tests run anywhere).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


def chain_hashes(tokens: list[int], block_size: int, known: list[int]) -> list[int]:
    """Extend `known` (the chain hashes of the first len(known) full blocks of `tokens`) to every full block of
    `tokens`, in place, and return it. Block k's hash covers tokens [0, (k + 1) * block_size): it hashes the hash
    of block k - 1 with block k's tokens (vLLM's scheme), so equal hashes at depth k mean equal prefixes up to
    collisions, which every hit checks token by token."""
    parent = known[-1] if known else 0
    for k in range(len(known), len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[k * block_size:(k + 1) * block_size])))
        known.append(parent)
    return known


@dataclass(eq=False)
class PrefixEntry:
    """A cached prefix: `tokens` (p ids), `blocks` (the ceil(p / B) KV blocks holding them, each referenced by this
    entry), `slot` (the prefix state slot with the GDN state after the p tokens) and `hashes` (the chain hashes of
    its p // B full blocks). With MTP drafting, `next_token` is the token at position p that the MTP layer's K/V at
    p - 1 was computed with (the MTP head pairs each position's hidden state with the next token): a hit needs the
    same token there, so drafts are those of a request computed whole."""

    tokens: tuple[int, ...]
    blocks: list[int]
    slot: int
    hashes: list[int] = field(repr=False)
    next_token: int | None = None  # the token after the prefix its MTP K/V was computed with (None: any, no MTP)

    @property
    def num_tokens(self) -> int:
        """p: the prefix's length in tokens."""
        return len(self.tokens)


class PrefixCache:
    """Entries by depth (full blocks) and chain hash, in least-recently-used order, over a fixed set of prefix state
    slots. Entries shorter than one block are never stored (the hit would save less than one block of prefill)."""

    def __init__(self, block_size: int, slots: list[int]):
        self.block_size = block_size
        self.num_slots = len(slots)
        self._free_slots = list(reversed(slots))
        self._lru: OrderedDict[int, PrefixEntry] = OrderedDict()  # id(entry) -> entry, oldest first
        self._by_hash: dict[int, list[PrefixEntry]] = {}  # hash of an entry's last full block -> entries
        self._prefix_count: dict[int, int] = {}  # chain hash -> entries whose tokens start with that prefix
        self._by_tokens: dict[tuple[int, ...], PrefixEntry] = {}

    def __len__(self) -> int:
        """Entries held."""
        return len(self._lru)

    @property
    def num_free_slots(self) -> int:
        """Prefix state slots no entry holds."""
        return len(self._free_slots)

    def entries(self) -> list[PrefixEntry]:
        """Every entry, least recently used first."""
        return list(self._lru.values())

    def get(self, tokens: tuple[int, ...]) -> PrefixEntry | None:
        """The entry of exactly these tokens, if any."""
        return self._by_tokens.get(tokens)

    def touch(self, entry: PrefixEntry) -> None:
        """Mark `entry` most recently used."""
        self._lru.move_to_end(id(entry))

    def lookup(self, tokens: list[int], hashes: list[int], limit: int) -> PrefixEntry | None:
        """The longest entry whose tokens start `tokens`, of at most `limit` tokens (ties: any), or None.

        hashes: the chain hashes of tokens' full blocks (`chain_hashes`). An entry with a `next_token` needs it at
        tokens[p] (limit < len(tokens)). Deepest depth first: an entry at depth k (k full blocks) is longer than any at
        a smaller depth."""
        b = self.block_size
        for k in range(min(len(hashes), limit // b), 0, -1):
            best = None
            for e in self._by_hash.get(hashes[k - 1], ()):
                p = e.num_tokens
                if p <= limit and (best is None or p > best.num_tokens) and \
                        (e.next_token is None or tokens[p] == e.next_token) and \
                        tuple(tokens[k * b:p]) == e.tokens[k * b:] and tuple(tokens[:k * b]) == e.tokens[:k * b]:
                    best = e
            if best is not None:
                return best
        return None

    def shared_blocks(self, hashes: list[int], limit: int) -> int:
        """The most full blocks (at most `limit`) that `hashes`' prefix shares with some entry, by chain hash."""
        for k in range(min(len(hashes), limit), 0, -1):
            if hashes[k - 1] in self._prefix_count:
                return k
        return 0

    def needs_slot(self) -> bool:
        """True when inserting an entry needs an eviction first (no prefix state slot is free)."""
        return not self._free_slots

    def insert(self, tokens: tuple[int, ...], blocks: list[int], hashes: list[int],
               next_token: int | None = None) -> PrefixEntry:
        """Store a new entry (most recently used) on a free slot; the caller references its blocks and fills the
        slot. Raises RuntimeError when no slot is free (evict first) and ValueError for a short or duplicate entry."""
        if len(tokens) < self.block_size or len(hashes) != len(tokens) // self.block_size:
            raise ValueError(f"a prefix entry needs at least one full block and its chain hashes, got "
                             f"{len(tokens)} tokens and {len(hashes)} hashes")
        if tokens in self._by_tokens:
            raise ValueError("that prefix is already cached")
        if not self._free_slots:
            raise RuntimeError("no prefix state slot is free")
        e = PrefixEntry(tokens, list(blocks), self._free_slots.pop(), list(hashes), next_token)
        self._lru[id(e)] = e
        self._by_tokens[tokens] = e
        self._by_hash.setdefault(e.hashes[-1], []).append(e)
        for h in e.hashes:
            self._prefix_count[h] = self._prefix_count.get(h, 0) + 1
        return e

    def oldest(self) -> PrefixEntry | None:
        """The least recently used entry (the next to evict), or None when empty."""
        return next(iter(self._lru.values()), None)

    def remove(self, e: PrefixEntry) -> None:
        """Drop `e` and free its slot; the caller releases its block references."""
        del self._lru[id(e)]
        del self._by_tokens[e.tokens]
        same = self._by_hash[e.hashes[-1]]
        same.remove(e)
        if not same:
            del self._by_hash[e.hashes[-1]]
        for h in e.hashes:
            n = self._prefix_count[h] - 1
            if n:
                self._prefix_count[h] = n
            else:
                del self._prefix_count[h]
        self._free_slots.append(e.slot)
