"""The interface of a KV tier: a bounded key -> record store, safe to call from several threads."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TierUsage:
    used_bytes: int  # records plus what the store spends to index them
    capacity_bytes: int
    entries: int


class BlockStore(abc.ABC):
    """Records by key. Every method may be called from any thread; a store bounds its own size and
    drops its least recently used records to take a new one."""

    name = ""
    shared = False  # other engines read it too (the remote tier): a block goes there as soon as it is computed
    durable = False  # it outlives the process (the disk tier): what a restart starts warm from
    in_process = False  # only this process writes it (the host tier): its records' signatures need no check
    write_failures = 0  # puts the medium refused (a full or vanished disk, a server error): counted, each block recomputable

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The record stored under key (now the most recently used), or None."""

    @abc.abstractmethod
    def put(self, key: str, record: bytes) -> bool:
        """Store a record (replacing one under the same key); False when it cannot be taken (larger
        than the whole budget, or the medium failed), and nothing changed."""

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """Whether a record is stored under key (no change to the LRU order)."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """get() of each key (a remote store answers them in one round trip)."""
        return [self.get(key) for key in keys]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(key) for key in keys]

    def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.delete(key)

    def close(self) -> None:
        """Release connections and threads (the engine's shutdown)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Forget the record under key, if any."""

    @abc.abstractmethod
    def usage(self) -> TierUsage: ...
