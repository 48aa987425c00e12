"""The local-disk tier: one file per record in a directory, within a byte budget, across restarts.

A record is written to a temporary name in the same directory, then renamed, so a crash leaves
either the whole record or none (temporary files are removed at start). The LRU order is the files'
modification times (a read touches its file), so a new engine on the same directory rebuilds its
index from the listing and keeps the order.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from kvserve.kv.tiers.store import BlockStore, TierUsage

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_TEMPORARY = ".tmp-"


class DiskStore(BlockStore):
    name = "disk"
    durable = True

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the disk tier's budget must be positive, got {capacity_bytes} bytes")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._names = itertools.count()
        self.write_failures = 0
        self._failing = False  # since the last failure, no write has succeeded: further failures are counted, not logged
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"--kv-offload-disk-dir {self.directory}: not a directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"--kv-offload-disk-dir {self.directory}: cannot create it ({error.strerror})") from None
        probe = self.directory / f"probe{_TEMPORARY}{os.getpid()}"
        try:  # permissions say little for root or on special file systems: write a file
            probe.write_bytes(b"kvserve")
            probe.unlink()
        except OSError as error:
            raise ValueError(f"--kv-offload-disk-dir {self.directory}: cannot write a file there ({error.strerror})") from None
        self._rebuild_index()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def _rebuild_index(self) -> None:
        found = []
        for entry in os.scandir(self.directory):
            if _TEMPORARY in entry.name:
                Path(entry.path).unlink(missing_ok=True)  # a write that did not finish
            elif entry.name.endswith(SUFFIX) and entry.is_file():
                stat = entry.stat()
                found.append((stat.st_mtime_ns, entry.name[: -len(SUFFIX)], stat.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self._used += size
        self._shrink_to(self.capacity_bytes)

    def _unlink(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError:  # not a file any more (a directory put there): forgotten all the same
            pass

    def _shrink_to(self, limit: int) -> None:
        while self._used > limit and self._sizes:
            key, size = self._sizes.popitem(last=False)
            self._used -= size
            self._unlink(key)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            if key not in self._sizes:
                return None
            self._sizes.move_to_end(key)
        path = self._path(key)
        try:
            data = path.read_bytes()
            os.utime(path)
        except OSError:  # deleted (or replaced by something unreadable) behind our back: a miss
            self.delete(key)
            return None
        return data

    def _write(self, key: str, record: bytes) -> None:
        temporary = self.directory / f"{key}{_TEMPORARY}{os.getpid()}-{next(self._names)}"
        try:
            with open(temporary, "wb") as out:
                out.write(record)
            os.replace(temporary, self._path(key))
        except OSError:
            temporary.unlink(missing_ok=True)
            raise

    def _recreate(self) -> bool:
        """After the directory vanished: make it again and forget the records that went with it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        with self._lock:
            lost = len(self._sizes)
            self._sizes.clear()
            self._used = 0
        logger.warning("the disk tier's directory %s was removed; made it again (its %d records are gone)", self.directory, lost)
        return True

    def put(self, key: str, record: bytes) -> bool:
        if len(record) > self.capacity_bytes:
            return False
        try:
            try:
                self._write(key, record)
            except FileNotFoundError:
                if self.directory.is_dir() or not self._recreate():
                    raise
                self._write(key, record)
        except OSError as error:
            self.write_failures += 1
            if not self._failing:
                logger.warning("the disk tier could not write %s (%s); the block stays recomputable (further failures are counted in "
                               "kv_tier_write_failures, not logged, until a write succeeds)", key, error.strerror)  # fmt: skip
            self._failing = True
            return False
        if self._failing:
            logger.info("the disk tier writes again (%d writes failed so far)", self.write_failures)
            self._failing = False
        with self._lock:
            self._used -= self._sizes.pop(key, 0)
            self._sizes[key] = len(record)
            self._used += len(record)
            self._shrink_to(self.capacity_bytes)
        return True

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._sizes

    def delete(self, key: str) -> None:
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._used -= size
        self._unlink(key)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._used, self.capacity_bytes, len(self._sizes))
