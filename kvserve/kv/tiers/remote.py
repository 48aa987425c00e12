"""The shared remote tier: the same records as the disk tier, in a Redis server several engines use.

One key per record (`kvserve:` + the record key, whose chained hash folds in the cache identity and
the salt), written with a single SET, so a reader sees the whole record or none; every entry gets
the TTL and a read refreshes it (GETEX). Multi-block reads and existence checks are one pipelined
round trip. Every call has a deadline; a call that fails or runs past it marks the server down: from
then on the tier answers misses at once (the engine recomputes), one warning line is logged, and a
probe thread pings the server every second until it answers, when the tier comes back by itself.
The server bounds its own memory (maxmemory with an LRU policy); this store does not count bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import redis

from kvserve.kv.tiers.store import BlockStore, TierUsage

logger = logging.getLogger(__name__)

KEY_PREFIX = "kvserve:"
SCHEMES = ("redis", "rediss")
PROBE_INTERVAL_S = 1.0
_USAGE_REFRESH_S = 5.0
_T = TypeVar("_T")


def masked_url(url: str) -> str:
    """The URL without its password, whether in the user part or the query (for logs and errors)."""
    parts = urlsplit(url)
    user, at, host = parts.netloc.rpartition("@")
    if at and ":" in user:
        user = user.split(":", 1)[0] + ":***"
    query = "&".join(f"{k}=***" if k.lower() == "password" else f"{k}={v}" if sep else k
                     for k, sep, v in (item.partition("=") for item in parts.query.split("&") if item))  # fmt: skip
    masked = parts._replace(netloc=f"{user}{at}{host}", query=query).geturl()
    if not parts.netloc and url.startswith(f"{parts.scheme}://"):  # geturl() drops the // of an empty host ("redis://")
        masked = f"{parts.scheme}://" + masked[len(parts.scheme) + 1 :]
    return masked


class RemoteStore(BlockStore):
    name = "remote"
    shared = True  # other engines read what this one writes: blocks go here as soon as they are computed

    def __init__(self, url: str, timeout_ms: int = 200, ttl_s: int = 3600, ca_file: str | None = None) -> None:
        scheme = urlsplit(url).scheme
        if scheme not in SCHEMES:
            raise ValueError(f"--kv-remote-url must be redis://[:password@]host:port/db or rediss://..., got {masked_url(url)!r}")
        if ca_file is not None and scheme != "rediss":
            raise ValueError("--kv-remote-ca-file verifies a TLS server: give a rediss:// --kv-remote-url")
        if ca_file is not None:
            try:
                with open(ca_file, "rb") as pem:
                    if b"-----BEGIN CERTIFICATE-----" not in pem.read(1 << 20):
                        raise ValueError(f"--kv-remote-ca-file {ca_file}: not a PEM certificate")
            except OSError as error:
                raise ValueError(f"--kv-remote-ca-file {ca_file}: {error.strerror}") from None
        self.url = masked_url(url)
        self.ttl_s = ttl_s
        seconds = timeout_ms / 1000
        options = {"ssl_ca_certs": ca_file} if ca_file is not None else {}
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=seconds, socket_connect_timeout=seconds, max_connections=16,
                                                retry_on_timeout=False, retry=None, **options)  # fmt: skip
            self._client.ping()
        except (redis.RedisError, OSError, ValueError) as error:
            raise ValueError(f"--kv-remote-url {self.url}: {type(error).__name__}: {error}") from None
        self._lock = threading.Lock()
        self.up = True
        self.outages = 0
        self.timeouts = 0
        self.errors = 0
        self._usage = TierUsage(0, 0, 0)
        self._usage_at = 0.0
        self._closed = threading.Event()

    @staticmethod
    def _key(key: str) -> str:
        return KEY_PREFIX + key

    # ------------------------------------------------------------------ availability
    def _call(self, call: Callable[[], _T], down: _T) -> _T:
        """call() against the server, or `down` at once while it is marked down or when it fails."""
        if not self.up:
            return down
        try:
            return call()
        except redis.TimeoutError as error:
            self.timeouts += 1
            self._mark_down(error)
        except (redis.RedisError, OSError) as error:
            self.errors += 1
            self._mark_down(error)
        return down

    def _mark_down(self, error: BaseException) -> None:
        with self._lock:
            if not self.up:
                return
            self.up = False
            self.outages += 1
        logger.warning("the remote KV tier %s is unreachable (%s: %s); requests recompute until it answers again",
                       self.url, type(error).__name__, error)  # fmt: skip
        threading.Thread(target=self._probe, name="kvserve-remote-probe", daemon=True).start()

    def _probe(self) -> None:
        while not self._closed.wait(PROBE_INTERVAL_S):
            try:
                self._client.ping()
            except (redis.RedisError, OSError):
                continue
            self.up = True
            logger.warning("the remote KV tier %s answers again", self.url)
            return

    # ------------------------------------------------------------------ BlockStore
    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The records under keys, in one round trip (each read refreshes its TTL)."""

        def call() -> list[bytes | None]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.getex(self._key(key), ex=self.ttl_s)
            # a key holding another type (a list planted under a record's name) answers WRONGTYPE: an
            # empty record, refused as damaged and deleted, not an outage of the whole tier
            return [b"" if isinstance(value, redis.exceptions.ResponseError) else value for value in pipe.execute(raise_on_error=False)]

        return self._call(call, [None] * len(keys))

    def put(self, key: str, record: bytes) -> bool:
        stored = bool(self._call(lambda: self._client.set(self._key(key), record, ex=self.ttl_s), False))
        if not stored:
            self.write_failures += 1
        return stored

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []

        def call() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._key(key))
            return [bool(n) for n in pipe.execute()]

        return self._call(call, [False] * len(keys))

    def delete(self, key: str) -> None:
        self.delete_many([key])

    def delete_many(self, keys: Sequence[str]) -> None:
        if keys:
            self._call(lambda: self._client.delete(*(self._key(key) for key in keys)), None)

    def usage(self) -> TierUsage:
        """The server's memory and key count (refreshed at most every few seconds): shared with every
        engine that uses it. capacity_bytes is its maxmemory (0: unbounded)."""
        now = time.monotonic()
        if self.up and now - self._usage_at >= _USAGE_REFRESH_S:
            self._usage_at = now

            def call() -> TierUsage:
                memory = self._client.info("memory")
                return TierUsage(int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0)), int(self._client.dbsize()))

            self._usage = self._call(call, self._usage)
        return self._usage

    def close(self) -> None:
        self._closed.set()
        self._client.close()
