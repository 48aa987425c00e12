"""`--prefix-cache radix`: a radix tree over token ids whose edges are blocks, matched at token
granularity (SGLang's RadixCache, over paged blocks).

Each node is one block of tokens, a whole one or (a leaf published when its request ended) a part
of one, keyed by its chained hash and linked under its parent; it holds that block of each KV
cache group that still caches it. Whole-block matching walks the same chain the hash cache does;
where that walk stops, the children of the last node are compared token by token with the request,
and the longest common run is reused by copying its slots into a fresh block. A node is locked
while any request holds its blocks (their ref counts; a request holds every ancestor of the
blocks it uses), and unreferenced blocks are evicted least recently used first by the block pool,
leaves before their parents since a request frees its tail first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.kv.block_pool import KVBlock
from kvserve.kv.prefix import PrefixCache
from kvserve.kv.spec import KVCacheGroupSpec


@dataclass(eq=False)
class RadixNode:
    key: int
    parent: int
    blocks: dict[int, KVBlock] = field(default_factory=dict)  # group -> block


class RadixPrefixCache(PrefixCache):
    name = "radix"

    def __init__(self, groups: Sequence[KVCacheGroupSpec], block_size: int, root: int, tracks_salts: bool = False) -> None:
        super().__init__(groups, block_size, root, tracks_salts)
        self._nodes: dict[int, RadixNode] = {}
        self._children: dict[int, dict[int, RadixNode]] = {}

    def cached(self, group: int, key: int) -> KVBlock | None:
        node = self._nodes.get(key)
        return node.blocks.get(group) if node is not None else None

    def _insert(self, group: int, key: int, parent: int, block: KVBlock) -> bool:
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = RadixNode(key, parent)
            self._children.setdefault(parent, {})[key] = node
        if group in node.blocks:
            return False
        node.blocks[group] = block
        return True

    def _remove(self, block: KVBlock) -> None:
        node = self._nodes.get(block.block_hash)
        if node is None or node.blocks.get(block.group) is not block:
            return
        del node.blocks[block.group]
        if not node.blocks:
            del self._nodes[node.key]
            siblings = self._children.get(node.parent, {})
            siblings.pop(node.key, None)
            if not siblings:
                self._children.pop(node.parent, None)

    def _clear(self) -> None:
        self._nodes.clear()
        self._children.clear()

    def blocks(self, group: int | None = None) -> list[KVBlock]:
        if group is not None:
            return [node.blocks[group] for node in self._nodes.values() if group in node.blocks]
        return [b for node in self._nodes.values() for b in node.blocks.values()]

    def partial_match(self, parent: int, tokens: Sequence[int], groups: set[int]) -> tuple[int, list[tuple[int, KVBlock, int]]]:
        best, source = 0, None
        wanted = tuple(tokens)
        for child in self._children.get(parent, {}).values():
            if not groups <= child.blocks.keys():
                continue
            held = next(iter(child.blocks.values())).token_ids
            common = 0
            for a, b in zip(held, wanted):
                if a != b:
                    break
                common += 1
            if common > best:
                best, source = common, child
        if source is None:
            return 0, []
        return best, [(g, source.blocks[g], best) for g in sorted(groups)]
