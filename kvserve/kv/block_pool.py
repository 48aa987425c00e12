"""Physical KV blocks with reference counts and an LRU free queue.

A block whose ref count drops to zero goes to the tail of the free queue; allocation takes from
the head, so the least recently freed block is reused first. Blocks keep their ``block_hash``
while free, so a later prefix-cache lookup can revive them (O(1) removal from the queue).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[KVBlock]:
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        taken = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            block.ref_count = 1
            block.block_hash = None
            taken.append(block)
        return taken

    def touch(self, block: KVBlock) -> None:
        """Take one more reference to a block (a shared prefix); revive it if it was free."""
        if block.ref_count == 0:
            self._free.pop(block.block_id)
        block.ref_count += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; callers pass tail blocks first so they are evicted first."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
