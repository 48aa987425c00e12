"""What the prefix cache served: tokens looked up and reused, in all and per cache salt.

Counted once per request, at its first admission (a preempted request's own prefix coming back is
not a hit), in tokens as vLLM counts them. Each reused block counts the requests that took it
(KVBlock.hits), which the KV page draws as the prefix tree.

A salt is a tenant's secret: the per-salt figures name it by a keyed digest that only this process
can compute (never the salt, and no stable hash a client could test guesses against), and keep at
most MAX_SALTS of them; requests of further salts are counted under OTHER_SALTS. Even so, a row per
salt confirms a guessed salt (its requests move an existing row instead of adding one), so they are
kept only with --expose-salt-stats (`per_salt`); otherwise every request counts in the totals alone.

Requests under a LoRA adapter are also counted per adapter identity (`adapters`): an adapter is the
server's, not a tenant's secret, and its blocks are keyed apart (kv/hashing.adapter_salt).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field

from kvserve.kv.hashing import adapter_of
from kvserve.kv.prefix import MISS_REASONS, PrefixHit

MAX_SALTS = 256
MAX_SALT_ROOTS = 4096  # salts the tree can label; the ones past MAX_SALTS as OTHER_SALTS
NO_SALT, OTHER_SALTS = "(none)", "(other)"
MAX_ADAPTERS = 256
OTHER_ADAPTERS = "(other)"
_LABEL_KEY = os.urandom(16)


def salt_label(salt: str | None) -> str:
    if salt is None:
        return NO_SALT
    return "salt-" + hmac.new(_LABEL_KEY, salt.encode(), hashlib.sha256).hexdigest()[:8]


@dataclass
class SaltReuse:
    requests: int = 0
    queries: int = 0
    hits: int = 0


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache
    eligible: int = 0  # prompt tokens a cache could serve at most (all but the last)
    requests: int = 0
    requests_hit: int = 0  # requests that reused at least min_hit_tokens
    min_hit_tokens: int = 1  # the manager's block size: a radix match of a shared BOS token alone is no hit
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    salts: dict[str, SaltReuse] = field(default_factory=dict)  # salt_label -> its requests' reuse
    salt_roots: dict[int, str] = field(default_factory=dict)  # a salt's first-block parent hash -> salt_label
    per_salt: bool = False  # keep `salts` and `salt_roots` (--expose-salt-stats)
    adapters: dict[str, SaltReuse] = field(default_factory=dict)  # LoRA adapter identity -> its requests' reuse

    def record(self, hit: PrefixHit, prompt_len: int, salt: str | None = None, salt_root: int | None = None) -> None:
        self.queries += prompt_len
        self.hits += hit.num_tokens
        self.eligible += prompt_len - 1
        self.requests += 1
        self.requests_hit += hit.num_tokens >= self.min_hit_tokens
        if hit.miss_reason is not None:
            self.misses[hit.miss_reason] += 1
        for blocks in hit.blocks:
            for block in blocks:
                if block is not None:
                    block.hits += 1
        for _, source, _ in hit.copies:
            source.hits += 1
        adapter = adapter_of(salt)
        if adapter is not None:
            if adapter not in self.adapters and len(self.adapters) >= MAX_ADAPTERS:
                adapter = OTHER_ADAPTERS
            _count(self.adapters.setdefault(adapter, SaltReuse()), hit, prompt_len)
        if not self.per_salt:
            return
        label = salt_label(salt)
        if label not in self.salts and len(self.salts) >= MAX_SALTS:
            label = OTHER_SALTS
        if salt_root is not None and (salt_root in self.salt_roots or len(self.salt_roots) < MAX_SALT_ROOTS):
            self.salt_roots[salt_root] = label
        _count(self.salts.setdefault(label, SaltReuse()), hit, prompt_len)


def _count(reuse: SaltReuse, hit: PrefixHit, prompt_len: int) -> None:
    reuse.requests += 1
    reuse.queries += prompt_len
    reuse.hits += hit.num_tokens
