"""Conversations' KV kept between turns: the cached blocks of a stored response (its prompt and its
output, as published to the prefix cache) are pinned when it finishes, so the follow-up that names
it (`previous_response_id`) finds them however much other traffic ran in between.

A pin holds one reference to each of its blocks, so the pool neither evicts nor reuses them. Pins
are bounded by a share of the pool (distinct blocks; past it the oldest pins go first) and live
for a time-to-live; a released pin's blocks go back to the free queue as cached blocks, tail first,
where eviction writes them down to the host tier when one is set (write-back), like any other.
Pinned blocks never cost a running or new request anything: when the pool runs short, pins are
released, oldest first, before anything is preempted or refused (KVCacheManager asks release_oldest).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.kv.block_pool import KVBlock


@dataclass(frozen=True)
class ConversationKVConfig:
    share: float = 0.1  # of the pool's blocks, at most, pinned (distinct blocks)
    ttl_s: float = 300.0  # seconds a pin lives after its response finished

    def __post_init__(self) -> None:
        if not (isinstance(self.share, (int, float)) and 0.0 <= self.share <= 1.0):
            raise ValueError(f"conversation_kv_share must be a fraction of the pool in [0, 1], got {self.share!r}")
        if not (isinstance(self.ttl_s, (int, float)) and math.isfinite(self.ttl_s) and 0.0 <= self.ttl_s <= 7 * 86400):
            raise ValueError(f"conversation_kv_ttl must be a number of seconds in [0, 604800], got {self.ttl_s!r}")


@dataclass
class _Pin:
    deadline: float
    blocks: list[KVBlock]  # in prefix order


class ConversationPins:
    def __init__(self, num_blocks: int, config: ConversationKVConfig, release: Callable[[list[KVBlock]], None],
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.max_blocks = int(config.share * num_blocks)
        self.ttl_s = config.ttl_s
        self._release = release  # drops one reference from each block, in order (KVCacheManager._release)
        self._clock = clock
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # the request that computed it -> its pin, oldest first
        self._counts: dict[int, int] = {}  # block id -> pins holding it
        self.num_pinned_total = 0  # conversations pinned
        self.num_released_early = 0  # pins released before their TTL: past the share, or for room

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0 and self.ttl_s > 0

    @property
    def num_blocks(self) -> int:
        """Distinct blocks pinned now."""
        return len(self._counts)

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, key: str, blocks: list[KVBlock], take: Callable[[KVBlock], None]) -> bool:
        """Pin a finished conversation's cached blocks under `key` (the request that computed them;
        `take` adds the reference); older pins go while the share is exceeded. False when this one
        alone exceeds the share (nothing pinned)."""
        new = {b.block_id for b in blocks} - self._counts.keys()
        if not self.enabled or not blocks or key in self._pins or len({b.block_id for b in blocks}) > self.max_blocks:
            return False
        while self._pins and self.num_blocks + len(new) > self.max_blocks:
            self._drop(next(iter(self._pins)))
            self.num_released_early += 1
            new = {b.block_id for b in blocks} - self._counts.keys()
        for block in blocks:
            take(block)
            self._counts[block.block_id] = self._counts.get(block.block_id, 0) + 1
        self._pins[key] = _Pin(self._clock() + self.ttl_s, list(blocks))
        self.num_pinned_total += 1
        return True

    def expire(self) -> int:
        """Release the pins past their TTL; returns how many."""
        now, done = self._clock(), 0
        while self._pins:
            key, pin = next(iter(self._pins.items()))
            if pin.deadline > now:
                break
            self._drop(key)
            done += 1
        return done

    def release_oldest(self) -> bool:
        """Release the oldest pin (the pool is short); False if none is left."""
        if not self._pins:
            return False
        self._drop(next(iter(self._pins)))
        self.num_released_early += 1
        return True

    def release(self, key: str) -> bool:
        """Release one conversation's pin (its stored response was deleted); False if none."""
        if key not in self._pins:
            return False
        self._drop(key)
        return True

    def release_all(self) -> None:
        while self._pins:
            self._drop(next(iter(self._pins)))

    def _drop(self, key: str) -> None:
        pin = self._pins.pop(key)
        for block in pin.blocks:
            left = self._counts[block.block_id] - 1
            if left:
                self._counts[block.block_id] = left
            else:
                del self._counts[block.block_id]
        self._release(list(reversed(pin.blocks)))  # the tail first: evicted before the prefix others share
