"""The prefix cache as the KV page draws it: the cached blocks of one full-attention group as a
tree (radix) or a forest of hash chains, each block with the requests that reused it.

The tree shows the MAX_TREE_BLOCKS blocks most reused (their ancestors too, so it stays connected),
and a chain of blocks that agree on hits and holders is one run: a 4,000-token document read once
is one node, a system prompt shared by a hundred chats is one node with its questions below it. A
run that starts a salt's prefix is labelled with the salt's digest (kv/prefix_stats.py), never
the salt. Token text is in it only when the server runs with --dashboard-show-tokens.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np
from collections.abc import Callable, Sequence

from kvserve.kv.block_pool import KVBlock
from kvserve.kv.prefix import PrefixCache
from kvserve.kv.prefix_stats import PrefixCacheStats
from kvserve.kv.tiers.record import record_key
from kvserve.kv.tiers.store import BlockStore

MAX_TREE_BLOCKS = 512
MAX_RUN_TEXT = 240  # characters of a run's text, when shown
_HITS, _REUSE = attrgetter("hits"), attrgetter("hits", "ref_count")


def tree_group(windows: Sequence[int | None]) -> int:
    """The group whose chains are whole: the first full-attention one (a window group drops its start)."""
    return next((g for g, window in enumerate(windows) if window is None), 0)


def prefix_tree(cache: PrefixCache, group: int, stats: PrefixCacheStats, tiers: Sequence[BlockStore] = (),
                decode: Callable[[list[int]], str] | None = None, max_blocks: int = MAX_TREE_BLOCKS) -> dict:  # fmt: skip
    cached = cache.blocks(group)
    top = cached
    if len(cached) > max_blocks:  # the most reused: a partition over one array, not a sort of block objects
        hits = np.fromiter(map(_HITS, cached), np.int64, len(cached))
        top = [cached[i] for i in np.argpartition(-hits, max_blocks - 1)[:max_blocks]]
    shown: dict[int, KVBlock] = {b.block_hash: b for b in top}
    for block in list(shown.values()):
        while len(shown) < 2 * max_blocks and block.parent not in shown:
            block = cache.cached(group, block.parent)
            if block is None:
                break
            shown[block.block_hash] = block
    children: dict[int, list[KVBlock]] = {}
    for block in shown.values():
        children.setdefault(block.parent, []).append(block)
    runs: list[dict] = []
    run_of: dict[int, int] = {}  # a run's last block hash -> its index
    starts = [b for b in shown.values() if b.parent not in shown]
    while starts:
        block = starts.pop()
        members = [block]
        below = children.get(block.block_hash, [])
        while len(below) == 1 and _REUSE(below[0]) == _REUSE(block):
            block = below[0]
            members.append(block)
            below = children.get(block.block_hash, [])
        first = members[0]
        run = {"id": len(runs), "parent": run_of.get(first.parent), "salt": stats.salt_roots.get(first.parent),
               "blocks": len(members), "tokens": sum(len(b.token_ids) for b in members), "hits": block.hits, "refs": block.ref_count}  # fmt: skip
        if tiers:
            keys = [record_key(b.block_hash, group) for b in members]
            run["tiers"] = {store.name: sum(map(store.contains, keys)) for store in tiers}
        if decode is not None:
            run["text"] = decode([t for b in members for t in b.token_ids][:MAX_RUN_TEXT])[:MAX_RUN_TEXT]
        run_of[block.block_hash] = run["id"]
        runs.append(run)
        starts.extend(below)
    return {"kind": cache.name, "group": group, "cached_blocks": len(cached), "shown_blocks": len(shown), "runs": runs}
