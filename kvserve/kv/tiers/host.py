"""The host-memory tier: an LRU of records in this process's RAM, within an exact byte budget."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from kvserve.kv.tiers.store import BlockStore, TierUsage

# what one entry costs beyond its record's and key's characters: the objects' headers and the
# ordered dict's slot and links (tracemalloc on CPython 3.11, 20,000 entries: 165 bytes), rounded up
ENTRY_OVERHEAD = 192


class HostStore(BlockStore):
    name = "host"
    in_process = True

    def __init__(self, capacity_bytes: int, on_evict: Callable[[str, bytes], None] | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the host tier's budget must be positive, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.on_evict = on_evict  # where a record dropped for room goes (the next tier down), outside the lock
        self._records: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    @staticmethod
    def _cost(key: str, record: bytes) -> int:
        return len(record) + len(key) + ENTRY_OVERHEAD

    def get(self, key: str) -> bytes | None:
        with self._lock:
            record = self._records.get(key)
            if record is not None:
                self._records.move_to_end(key)
            return record

    def put(self, key: str, record: bytes) -> bool:
        cost = self._cost(key, record)
        if cost > self.capacity_bytes:
            return False
        dropped = []
        with self._lock:
            old = self._records.pop(key, None)
            if old is not None:
                self._used -= self._cost(key, old)
            while self._used + cost > self.capacity_bytes:
                gone_key, gone = self._records.popitem(last=False)
                self._used -= self._cost(gone_key, gone)
                dropped.append((gone_key, gone))
            self._records[key] = record
            self._used += cost
        if self.on_evict is not None:
            for gone_key, gone in dropped:
                self.on_evict(gone_key, gone)
        return True

    def records(self) -> list[tuple[str, bytes]]:
        """Every (key, record) held, least recently used first (a copy of the index, not of the bytes)."""
        with self._lock:
            return list(self._records.items())

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._records

    def delete(self, key: str) -> None:
        with self._lock:
            record = self._records.pop(key, None)
            if record is not None:
                self._used -= self._cost(key, record)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._used, self.capacity_bytes, len(self._records))
