"""Prefix caches: which cached blocks can serve the start of a new request.

Both implementations index the blocks that requests computed, per KV cache group, by the chained
block hash of kv/hashing.py, and both leave eviction to the block pool's LRU free queue (a cached
block no request holds is evictable; the pool tells the cache when it reuses one). They differ in
what they match:

- `hash` (default): whole blocks. A block's hash covers its whole prefix, so a request reuses
  its leading blocks while their hashes (and, to confirm, their token ids) match.
- `radix` (radix.py): also the part of a block that a request shares with a cached one, at token
  granularity; the shared slots are copied into a fresh block.

A hit must hold for every group: a full-attention group needs every block before the match
point, a sliding-window group only the blocks of the last window before it.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.kv.block_pool import KVBlock, forget
from kvserve.kv.hashing import adapter_of, block_hash, first_parent, salt_key
from kvserve.kv.spec import KVCacheGroupSpec

MISS_REASONS = ("shorter_than_a_block", "no_shared_prefix", "evicted", "other_salt")
_RECENT = 1 << 16  # evicted hashes and first-block salts remembered to explain misses


@dataclass
class PrefixHit:
    num_tokens: int = 0
    blocks: list[list[KVBlock | None]] = field(default_factory=list)  # per group: blocks 0..k-1 (None: not needed)
    copies: list[tuple[int, KVBlock, int]] = field(default_factory=list)  # (group, source block, slots) for block k
    miss_reason: str | None = None  # when nothing was reused although a block could have been

    def held(self, group: int) -> int:
        return sum(b is not None for b in self.blocks[group]) + sum(1 for g, _, _ in self.copies if g == group)


class PrefixCache(abc.ABC):
    name = ""

    def __init__(self, groups: Sequence[KVCacheGroupSpec], block_size: int, root: int, tracks_salts: bool = False) -> None:
        self.groups = tuple(groups)
        self.block_size = block_size
        self.root = root
        self._evicted: OrderedDict[int, None] = OrderedDict()
        # `tracks_salts` (--expose-salt-stats): a miss whose first block another salt cached says other_salt.
        # Off, it is no_shared_prefix: a counter that told them apart would tell any caller, one guessed
        # block at a time, whether another tenant's prompts begin like theirs
        self.tracks_salts = tracks_salts
        self._first_blocks: OrderedDict[int, set[bytes]] = OrderedDict()  # unsalted first-block hash -> salts seen
        self._retired: set[str] = set()  # unloaded LoRA adapters: their requests still running publish nothing

    # ------------------------------------------------------------------ the index
    @abc.abstractmethod
    def cached(self, group: int, key: int) -> KVBlock | None:
        """The block of `group` published under `key`, if still cached."""

    @abc.abstractmethod
    def _insert(self, group: int, key: int, parent: int, block: KVBlock) -> bool:
        """Index a published block; False when an equal one is already cached."""

    @abc.abstractmethod
    def _remove(self, block: KVBlock) -> None:
        """Drop an evicted block from the index."""

    @abc.abstractmethod
    def _clear(self) -> None:
        """Forget every index entry (the blocks' own hashes are cleared by reset)."""

    @abc.abstractmethod
    def blocks(self, group: int | None = None) -> list[KVBlock]:
        """Every block the index holds (of one group)."""

    def partial_match(self, parent: int, tokens: Sequence[int], groups: set[int]) -> tuple[int, list[tuple[int, KVBlock, int]]]:
        """The most leading tokens of `tokens` that one cached child block of `parent` holds in every
        group of `groups`: (count, copies). Whole blocks only in hash mode: (0, [])."""
        return 0, []

    # ------------------------------------------------------------------ lookups
    def parent_of_first(self, salt: str | None) -> int:
        return first_parent(self.root, salt)

    def lookup(self, token_ids: Sequence[int], hashes: Sequence[int], limit: int, salt: str | None) -> PrefixHit:
        """The longest prefix of at most `limit` tokens that every group can serve."""
        bs = self.block_size
        hit = PrefixHit(blocks=[[] for _ in self.groups])
        whole = min(len(hashes), limit // bs)
        full = [g for g, spec in enumerate(self.groups) if spec.window is None]
        confirmed = 0  # leading blocks every full group holds
        while confirmed < whole and all(self._held(g, hashes[confirmed], token_ids, confirmed) for g in full):
            confirmed += 1
        for k in range(confirmed, -1, -1):
            if k and not self._windows_hold(token_ids, hashes, k * bs, k):
                continue
            extra, copies = 0, []
            if k == confirmed and k * bs < limit:
                parent = hashes[k - 1] if k else self.parent_of_first(salt)
                extra, copies = self._partial(parent, token_ids, hashes, k, limit)
            if k or extra:
                hit.num_tokens = k * bs + extra
                hit.copies = copies
                for g, spec in enumerate(self.groups):
                    first = spec.first_block(hit.num_tokens, bs)
                    hit.blocks[g] = [self.cached(g, hashes[i]) if i >= first else None for i in range(k)]
                return hit
        hit.miss_reason = self._miss_reason(token_ids, limit, salt)
        return hit

    def _partial(self, parent: int, token_ids, hashes, k: int, limit: int) -> tuple[int, list]:
        bs = self.block_size
        tail = token_ids[k * bs : min(limit, (k + 1) * bs)]
        extra, copies = self.partial_match(parent, tail, set(range(len(self.groups))))
        if extra and not self._windows_hold(token_ids, hashes, k * bs + extra, k):
            return 0, []
        return extra, copies

    def _held(self, group: int, key: int, token_ids: Sequence[int], index: int) -> bool:
        block = self.cached(group, key)
        bs = self.block_size
        return block is not None and block.token_ids == tuple(token_ids[index * bs : (index + 1) * bs])

    def _windows_hold(self, token_ids, hashes, position: int, k: int) -> bool:
        """Every sliding group holds blocks first_block(position) .. k - 1."""
        for g, spec in enumerate(self.groups):
            if spec.window is None:
                continue
            if not all(self._held(g, hashes[i], token_ids, i) for i in range(spec.first_block(position, self.block_size), k)):
                return False
        return True

    def _miss_reason(self, token_ids: Sequence[int], limit: int, salt: str | None) -> str:
        if limit < self.block_size:
            return "shorter_than_a_block"
        first = block_hash(self.parent_of_first(salt), token_ids[: self.block_size])
        if first in self._evicted:
            return "evicted"
        if self.tracks_salts:
            salts = self._first_blocks.get(block_hash(self.parent_of_first(None), token_ids[: self.block_size]), set())
            if salts - {salt_key(salt)}:
                return "other_salt"
        return "no_shared_prefix"

    # ------------------------------------------------------------------ changes
    def publish(self, group: int, block: KVBlock, key: int, parent: int, token_ids: Sequence[int], salt: str | None = None) -> bool:
        """Make a block another request can reuse; False if an equal block is already cached."""
        if block.block_hash is not None or (self._retired and adapter_of(salt) in self._retired):
            return False
        block.block_hash, block.parent, block.token_ids, block.group = key, parent, tuple(token_ids), group
        block.adapter = adapter_of(salt)
        if not self._insert(group, key, parent, block):
            forget(block)
            return False
        self._evicted.pop(key, None)
        if self.tracks_salts and parent == self.parent_of_first(salt) and len(token_ids) == self.block_size:
            plain = block_hash(self.parent_of_first(None), token_ids)
            self._first_blocks.setdefault(plain, set()).add(salt_key(salt))
            self._first_blocks.move_to_end(plain)
            if len(self._first_blocks) > _RECENT:
                self._first_blocks.popitem(last=False)
        return True

    def evicted(self, block: KVBlock) -> None:
        """The pool is reusing a cached block."""
        self._remove(block)
        self._evicted[block.block_hash] = None
        if len(self._evicted) > _RECENT:
            self._evicted.popitem(last=False)

    def drop_adapter(self, adapter: str) -> list[KVBlock]:
        """Forget every cached block computed under a LoRA adapter (it was unloaded) and publish none
        until it is served again (revive_adapter); returns them. Blocks requests hold stay theirs."""
        self._retired.add(adapter)
        dropped = [block for block in self.blocks() if block.adapter == adapter]
        for block in dropped:
            self._remove(block)
            forget(block)
        return dropped

    def revive_adapter(self, adapter: str) -> None:
        """A request under this adapter arrived: its blocks are published again."""
        self._retired.discard(adapter)

    def reset(self) -> int:
        """Forget every cached block (blocks in use stay with their requests); returns how many."""
        blocks = self.blocks()
        for block in blocks:
            forget(block)
        self._clear()
        self._evicted.clear()
        self._first_blocks.clear()
        return len(blocks)


class HashPrefixCache(PrefixCache):
    name = "hash"

    def __init__(self, groups: Sequence[KVCacheGroupSpec], block_size: int, root: int, tracks_salts: bool = False) -> None:
        super().__init__(groups, block_size, root, tracks_salts)
        self._maps: list[dict[int, KVBlock]] = [{} for _ in self.groups]

    def cached(self, group: int, key: int) -> KVBlock | None:
        return self._maps[group].get(key)

    def _insert(self, group: int, key: int, parent: int, block: KVBlock) -> bool:
        if key in self._maps[group]:
            return False
        self._maps[group][key] = block
        return True

    def _remove(self, block: KVBlock) -> None:
        if self._maps[block.group].get(block.block_hash) is block:
            del self._maps[block.group][block.block_hash]

    def _clear(self) -> None:
        for entries in self._maps:
            entries.clear()

    def blocks(self, group: int | None = None) -> list[KVBlock]:
        if group is not None:
            return list(self._maps[group].values())
        return [b for entries in self._maps for b in entries.values()]
