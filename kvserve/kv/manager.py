"""Per-request block tables, one per KV cache group, on top of one shared block pool.

A table maps a sequence's block index (position // block_size) to a block. A sliding-window
group frees the blocks that no future query can read, leaving None in their place, so it holds
about window / block_size blocks whatever the sequence's length. Block ids are mirrored in one
numpy array per group, a row per request, from which the runner slices a step's tables.
"""

from __future__ import annotations

import numpy as np

from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.spec import KVCacheSpec, blocks_for_tokens


class KVCacheManager:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, max_blocks_per_seq: int) -> None:
        self.spec = spec
        self.groups = spec.groups
        self.block_size = spec.block_size
        self.pool = BlockPool(num_blocks)
        self.max_blocks_per_seq = max_blocks_per_seq
        self._tables: dict[str, list[list[KVBlock | None]]] = {}
        self._rows: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._ids = [np.zeros((0, max_blocks_per_seq), dtype=np.int64) for _ in self.groups]
        self.num_used_blocks = [0] * len(self.groups)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    # ------------------------------------------------------------------ reading
    def block_table(self, request_id: str, group: int = 0) -> list[int | None]:
        """Block ids of one group's table (None where a sliding group freed the block)."""
        tables = self._tables.get(request_id)
        if tables is None:
            return []
        return [b.block_id if b is not None else None for b in tables[group]]

    def num_held_blocks(self, request_id: str, group: int) -> int:
        return sum(b is not None for b in self._tables.get(request_id, [[]] * len(self.groups))[group])

    def block_id_rows(self, request_ids: list[str], width: int) -> list[np.ndarray]:
        """Per group, the block ids of these requests' tables [len(request_ids), width] (0 where none)."""
        rows = np.fromiter((self._rows[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
        return [ids[rows, :width] for ids in self._ids]

    # ------------------------------------------------------------------ needs
    def _new_blocks(self, request_id: str, start: int, end: int) -> list[tuple[int, int]]:
        """Per group, (first block index to add, one past the last) so tokens [start, end) can be computed."""
        tables = self._tables.get(request_id)
        last = blocks_for_tokens(end, self.block_size)
        spans = []
        for g, group in enumerate(self.groups):
            have = len(tables[g]) if tables is not None else 0
            spans.append((max(have, group.first_block(start, self.block_size)), last))
        return spans

    def num_blocks_needed(self, request_id: str, start: int, end: int) -> int:
        return sum(max(0, hi - lo) for lo, hi in self._new_blocks(request_id, start, end))

    def can_admit(self, request_id: str, num_tokens: int, chunk: int) -> bool:
        """The request can reach num_tokens, `chunk` tokens per step, with what is free now."""
        need = sum(
            max(0, group.peak_blocks(num_tokens, self.block_size, chunk) - self.num_held_blocks(request_id, g))
            for g, group in enumerate(self.groups)
        )
        return need <= self.pool.num_free_blocks

    # ------------------------------------------------------------------ changing
    def allocate_slots(self, request_id: str, start: int, end: int) -> bool:
        """Give the request blocks to compute tokens [start, end); False (and nothing taken) if short."""
        spans = self._new_blocks(request_id, start, end)
        needed = sum(max(0, hi - lo) for lo, hi in spans)
        if needed > self.pool.num_free_blocks:
            return False
        if end > self.max_blocks_per_seq * self.block_size:
            raise ValueError(f"request {request_id} grew past {self.max_blocks_per_seq} blocks")
        tables = self._tables.get(request_id)
        if tables is None:
            tables = self._tables[request_id] = [[] for _ in self.groups]
            self._rows[request_id] = self._take_row()
        row = self._rows[request_id]
        for g, (lo, hi) in enumerate(spans):
            if hi <= lo:
                continue
            table = tables[g]
            table.extend([None] * (lo - len(table)))
            blocks = self.pool.allocate(hi - lo)
            table.extend(blocks)
            self._ids[g][row, lo:hi] = [b.block_id for b in blocks]
            self.num_used_blocks[g] += hi - lo
        return True

    def free_unreachable(self, request_id: str, num_computed: int) -> None:
        """Free each sliding group's blocks that no query at num_computed or later reads."""
        tables = self._tables.get(request_id)
        if tables is None:
            return
        row = self._rows[request_id]
        for g, group in enumerate(self.groups):
            if group.window is None:
                continue
            first = min(group.first_block(num_computed, self.block_size), len(tables[g]))
            table = tables[g]
            gone = [b for b in table[:first] if b is not None]
            if not gone:
                continue
            for i in range(first):
                table[i] = None
            self._ids[g][row, :first] = 0
            self.num_used_blocks[g] -= len(gone)
            self.pool.free(list(reversed(gone)))

    def free(self, request_id: str) -> None:
        tables = self._tables.pop(request_id, None)
        if tables is None:
            return
        row = self._rows.pop(request_id)
        for g, table in enumerate(tables):
            held = [b for b in table if b is not None]
            self.num_used_blocks[g] -= len(held)
            self.pool.free(list(reversed(held)))
            self._ids[g][row, : len(table)] = 0
        self._free_rows.append(row)

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self._ids[0].shape[0]
            grown = max(16, 2 * old)
            self._ids = [np.concatenate([ids, np.zeros((grown - old, self.max_blocks_per_seq), dtype=np.int64)]) for ids in self._ids]
            self._free_rows = list(range(grown - 1, old - 1, -1))
        return self._free_rows.pop()
