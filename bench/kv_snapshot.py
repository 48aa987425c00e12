"""How long GET /v1/kv/snapshot holds the engine thread and how big it is, for pools of 10K to 400K
blocks in a random mix of states (the parts of the snapshot that grow with the pool: the block scan
and the grid, and the prefix tree over a cache of that many blocks; the rest is a few counters).

    .venv/bin/python bench/kv_snapshot.py
"""

from __future__ import annotations

import json
import random
import time

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.prefix import HashPrefixCache
from kvserve.kv.prefix_stats import PrefixCacheStats
from kvserve.kv.spec import KVCacheGroupSpec
from kvserve.server.kv_snapshot import MAX_CELLS, pool_snapshot
from kvserve.server.prefix_tree import prefix_tree


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


def cached_documents(num_blocks: int, seed: int = 0) -> HashPrefixCache:
    """A hash cache of num_blocks blocks: documents of 50 blocks under 20 shared prompts, random reuse."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks)
    cache = HashPrefixCache([KVCacheGroupSpec((0,))], 16, root=7)
    blocks = pool.allocate(num_blocks)
    for start in range(0, num_blocks, 50):
        parent = cache.parent_of_first(None) if start < 20 * 50 else rng.randrange(1, 20 * 50, 50)
        for k, block in enumerate(blocks[start : start + 50]):
            cache.publish(0, block, start + k + 1, parent, [k] * 16)
            block.hits = rng.randrange(8) if k < 10 else 0
            parent = start + k + 1
    pool.free(blocks)
    return cache


def median_ms(work, repeat: int = 5) -> tuple[float, object]:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        result = work()
        times.append((time.perf_counter() - started) * 1000)
    return sorted(times)[repeat // 2], result


def main() -> None:
    print("| blocks | scan + grid, ms (median of 5) | JSON bytes | cells | blocks per cell | prefix tree, ms | tree JSON bytes |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")
    for num_blocks in (10_000, 100_000, 400_000):
        pool = filled_pool(num_blocks)
        grid_ms, snapshot = median_ms(lambda: pool_snapshot("pool", pool, ["full"]))
        cache = cached_documents(num_blocks)
        tree_ms, tree = median_ms(lambda: prefix_tree(cache, 0, PrefixCacheStats()))
        size = len(json.dumps(snapshot))
        print(f"| {num_blocks:,} | {grid_ms:.1f} | {size:,} | {len(snapshot['cells'])} | {snapshot['blocks_per_cell']} | "
              f"{tree_ms:.1f} | {len(json.dumps(tree)):,} |")
    print(f"(at most {MAX_CELLS} cells)")


if __name__ == "__main__":
    main()
