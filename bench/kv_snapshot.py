"""How long GET /v1/kv/snapshot holds the engine thread and how big it is, for pools of 10K to 400K
blocks in a random mix of states (the part of the snapshot that grows with the pool: the block scan
and the grid; the rest is a few counters).

    .venv/bin/python bench/kv_snapshot.py
"""

from __future__ import annotations

import json
import random
import time

from kvserve.kv.block_pool import BlockPool
from kvserve.server.kv_snapshot import MAX_CELLS, pool_snapshot


def filled_pool(num_blocks: int, seed: int = 0) -> BlockPool:
    rng = random.Random(seed)
    pool = BlockPool(num_blocks)
    held = pool.allocate(num_blocks * 6 // 10, group=0)
    for block in held:
        if rng.random() < 0.3:
            pool.touch(block)  # shared
    pool.free([b for b in held if rng.random() < 0.2])
    for block in pool.blocks:
        if block.ref_count == 0 and rng.random() < 0.5:
            block.block_hash = rng.getrandbits(63)  # free but cached
    return pool


def main() -> None:
    print(f"| blocks | scan + grid, ms (median of 5) | JSON bytes | cells | blocks per cell |\n|---:|---:|---:|---:|---:|")
    for num_blocks in (10_000, 100_000, 400_000):
        pool = filled_pool(num_blocks)
        times = []
        for _ in range(5):
            started = time.perf_counter()
            snapshot = pool_snapshot("pool", pool, ["full"])
            times.append((time.perf_counter() - started) * 1000)
        size = len(json.dumps(snapshot))
        print(f"| {num_blocks:,} | {sorted(times)[2]:.1f} | {size:,} | {len(snapshot['cells'])} | {snapshot['blocks_per_cell']} |")
    print(f"(at most {MAX_CELLS} cells)")


if __name__ == "__main__":
    main()
