"""Physical KV blocks with reference counts and free queues.

A block whose ref count drops to zero is free. Allocation takes, in this order: blocks that hold
nothing reusable (never used, or unpublished); cached blocks marked to go first (reuse_first: a
sliding window's blocks behind its window, an unloaded adapter's); then cached blocks, least
recently freed first (an LRU queue); last, cached blocks parked for a request still running (park:
the window a sliding group left behind before its prompt's last tokens, which a repeat of the
prompt reads once the request is done; refresh moves them to the LRU queue's tail then). A block the prefix cache published keeps its hash while free,
so a later lookup can revive it (O(1) removal from its queue); when allocation reuses such a block
the cache is told it was evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the prefix cache knows this block
    token_ids: tuple[int, ...] = ()  # the tokens it holds, to confirm a hash hit
    group: int = 0  # the KV cache group it was last allocated to
    parent: int | None = None  # the hash of the block before it in its prefix (set with block_hash)
    hits: int = 0  # requests that reused it since it was published (the KV page's prefix tree)
    adapter: str | None = None  # the LoRA adapter identity it was computed under (set with block_hash)


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._plain: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)  # nothing to reuse
        self._early: OrderedDict[int, KVBlock] = OrderedDict()  # cached, evicted before the LRU queue
        self._free: OrderedDict[int, KVBlock] = OrderedDict()  # cached, least recently freed first
        self._parked: OrderedDict[int, KVBlock] = OrderedDict()  # cached, a running request's: evicted after the LRU queue
        self.on_evict: Callable[[KVBlock], None] | None = None  # the prefix cache forgets a reused block
        self.reusing_first = False  # while on_evict runs: the block was one to reuse first (few hits could use it)
        self.num_evictions = 0
        self._used: dict[int, int] = {}  # group -> blocks some request holds

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evicted when taken)."""
        return len(self._plain) + len(self._early) + len(self._free) + len(self._parked)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_used_blocks(self, group: int) -> int:
        return self._used.get(group, 0)

    def allocate(self, count: int, group: int = 0) -> list[KVBlock]:
        if count > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {count} blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(count):
            queue = self._plain or self._early or self._free or self._parked
            _, block = queue.popitem(last=False)
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.reusing_first = queue is self._early
                    self.on_evict(block)
                self.num_evictions += 1
                forget(block)
            block.ref_count = 1
            block.group = group
            taken.append(block)
        self._used[group] = self._used.get(group, 0) + count
        return taken

    def touch(self, block: KVBlock) -> None:
        """Take one more reference to a block (a shared prefix); revive it if it was free."""
        if block.ref_count == 0:
            self._queue_of(block).pop(block.block_id)
            self._used[block.group] = self._used.get(block.group, 0) + 1
        block.ref_count += 1

    def _queue_of(self, block: KVBlock) -> OrderedDict[int, KVBlock]:
        return next(q for q in (self._free, self._early, self._plain, self._parked) if block.block_id in q)

    def reuse_first(self, block: KVBlock) -> None:
        """A free block few hits (or none: it was forgotten) can use is reused before the LRU queue's."""
        if block.ref_count == 0:
            self._queue_of(block).pop(block.block_id)
            (self._early if block.block_hash is not None else self._plain)[block.block_id] = block

    def park(self, block: KVBlock) -> None:
        """A free cached block a running request will want cached when it is done: evicted last."""
        if block.ref_count == 0 and block.block_hash is not None:
            self._queue_of(block).pop(block.block_id)
            self._parked[block.block_id] = block

    def refresh(self, block: KVBlock) -> None:
        """A free cached block counts as freed now: to the LRU queue's tail."""
        if block.ref_count == 0 and (block.block_id in self._free or block.block_id in self._parked):
            (self._free if block.block_id in self._free else self._parked).pop(block.block_id)
            self._free[block.block_id] = block

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; callers pass tail blocks first so they are evicted first."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                (self._free if block.block_hash is not None else self._plain)[block.block_id] = block
                self._used[block.group] -= 1


def forget(block: KVBlock) -> None:
    block.block_hash = block.parent = None
    block.token_ids = ()
    block.hits = 0
    block.adapter = None
