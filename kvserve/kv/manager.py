"""Per-sequence block tables on top of the block pool."""

from __future__ import annotations

from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.spec import blocks_for_tokens


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so the request's table covers num_tokens in total."""
        have = len(self._tables.get(request_id, ()))
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_blocks_needed(request_id, num_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to cover num_tokens; False (and nothing taken) if blocks are short."""
        needed = self.num_blocks_needed(request_id, num_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        if needed:
            self._tables.setdefault(request_id, []).extend(self.pool.allocate(needed))
        return True

    def free(self, request_id: str) -> None:
        blocks = self._tables.pop(request_id, [])
        self.pool.free(list(reversed(blocks)))

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Slot ids of token positions [start, end) of a request."""
        table = self._tables[request_id]
        bs = self.block_size
        return [table[p // bs].block_id * bs + p % bs for p in range(start, end)]
