"""Stored responses (the Responses API's `store`): what `GET /v1/responses/{id}` returns and what a
follow-up's `previous_response_id` continues (the conversation as chat messages, instructions
apart). Kept in memory, least recently used out first past a count and a byte bound; or, with
--kv-remote-url, in that Redis server, so replicas behind a router share conversations.

Ids are unguessable (192 random bits). A stored response belongs to the API key that made it and its
cache_salt: its owner is a digest of both, and a lookup under another owner finds nothing (the same
404 as an id that never was, so ids cannot be probed across tenants).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass

import redis

REDIS_PREFIX = "kvserve:response:"


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


def owner_of(api_key: str | None, cache_salt: str | None) -> str:
    """Who may read a response: the API key presented (none without --api-key) and the cache_salt."""
    material = f"kvserve-response-owner\x00{api_key or ''}\x00{cache_salt if cache_salt is not None else ''}"
    return hashlib.sha256(material.encode()).hexdigest()


@dataclass
class StoredResponse:
    id: str
    owner: str
    response: dict  # the Response object, as returned
    history: list[dict]  # the conversation through this response's output, as chat messages (no instructions)
    cache_salt: str | None = None
    truncated_items: int = 0  # the conversation's leading items this turn dropped (truncation: auto): the next turn keeps the cut
    engine_request_id: str | None = None  # the engine request whose blocks stay pinned for the next turn

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredResponse:
        return cls(**json.loads(text))


class MemoryResponseStore:
    shared = False

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("--responses-store-max and --responses-store-max-mib must not be negative")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> bool:
        size = len(stored.to_json())
        if size > self.max_bytes or self.max_entries == 0:
            return False
        with self._lock:
            old = self._entries.pop(stored.id, None)
            if old is not None:
                self._bytes -= old[1]
            self._entries[stored.id] = (stored, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, gone) = self._entries.popitem(last=False)
                self._bytes -= gone
        return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry[0].owner != owner:
                return None
            self._entries.move_to_end(response_id)
            return entry[0]

    def delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry[0].owner != owner:
                return False
            del self._entries[response_id]
            self._bytes -= entry[1]
            return True

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes


class RedisResponseStore:
    """The same, in Redis: one key per response, living ttl_s after it was last written or read."""

    shared = True

    def __init__(self, url: str, ttl_s: int, max_bytes: int, timeout_s: float = 2.0, ca_file: str | None = None) -> None:
        options = {"ssl_ca_certs": ca_file} if ca_file is not None else {}
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **options)
        self.ttl_s, self.max_bytes = ttl_s, max_bytes

    def put(self, stored: StoredResponse) -> bool:
        text = stored.to_json()
        if len(text) > self.max_bytes:
            return False
        self._client.set(REDIS_PREFIX + stored.id, text, ex=self.ttl_s)
        return True

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        text = self._client.getex(REDIS_PREFIX + response_id, ex=self.ttl_s)
        if text is None:
            return None
        stored = StoredResponse.from_json(text)
        return stored if secrets.compare_digest(stored.owner, owner) else None

    def delete(self, response_id: str, owner: str) -> bool:
        if self.get(response_id, owner) is None:
            return False
        return bool(self._client.delete(REDIS_PREFIX + response_id))
