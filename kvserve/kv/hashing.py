"""The one stable, chained block hash of the prefix cache (and, later, of the tiers' keys).

A block's hash is xxh3-128 over a canonical encoding of its parent's hash, its extra keys and its
token ids, so equal hashes mean equal token prefixes computed the same way. The root of every
chain is the hash of the cache identity: everything that changes the K/V a token gets (model and
tokenizer bytes, KV dtype and quantization, attention configuration, adapter, chat template). A
request's cache salt is an extra key of its first block, so two salts never share a block. The
encoding is fixed (little-endian, length-prefixed), so the same prefix hashes the same in every
process and on every machine.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import xxhash


@dataclass(frozen=True)
class CacheIdentity:
    """What must match for two computations of the same tokens to give the same K/V."""

    model: str  # digest of the weights (file contents)
    tokenizer: str = ""  # digest of the tokenizer
    dtype: str = ""  # activations and weights
    kv_cache_dtype: str = ""
    kv_quantization: str = ""  # group size, residual, scales... (quantized formats)
    attention: str = ""  # backend, block size, windows
    adapter: str = ""
    chat_template: str = ""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


def root_hash(identity: CacheIdentity) -> int:
    return xxhash.xxh3_128_intdigest(b"kvserve-prefix-v1\0" + identity.encode())


def block_hash(parent: int, token_ids: Sequence[int] | np.ndarray, extra: bytes = b"") -> int:
    """Hash of one block: its parent's hash, its extra keys (a salt) and its token ids."""
    tokens = np.asarray(token_ids, dtype="<u4").tobytes()
    return xxhash.xxh3_128_intdigest(parent.to_bytes(16, "little") + struct.pack("<I", len(extra)) + extra + tokens)


MAX_CACHE_SALT_CHARS = 1024


def validate_cache_salt(salt: object) -> None:
    """A salt is hashed as UTF-8 in every process: a non-empty, bounded string that UTF-8 can encode."""
    if salt is None:
        return
    if not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
    if not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("cache_salt must be valid Unicode text (it holds an unpaired surrogate)") from None
    if "\x00" in salt:
        raise ValueError("cache_salt must not hold a NUL character")


_ADAPTER_MARK = "\x00lora:"


def adapter_salt(salt: str | None, adapter: str | None) -> str | None:
    """The salt a request's blocks are keyed with: its cache_salt, and its LoRA adapter's identity
    after a NUL, which no cache_salt holds (so no salt alone names an adapter's blocks)."""
    return salt if adapter is None else f"{salt or ''}{_ADAPTER_MARK}{adapter}"


def adapter_of(salt: str | None) -> str | None:
    """The LoRA adapter identity a salt made by adapter_salt names (None: the base model)."""
    if salt is None:
        return None
    _, mark, adapter = salt.partition(_ADAPTER_MARK)
    return adapter if mark else None


def salt_key(salt: str | None) -> bytes:
    return b"" if salt is None else b"salt:" + salt.encode()


def first_parent(root: int, salt: str | None) -> int:
    """The parent of a request's first block: the root with the request's salt folded in."""
    return block_hash(root, (), salt_key(salt))


def chain_hashes(root: int, token_ids: Sequence[int], block_size: int, salt: str | None, known: list[int] | None = None) -> list[int]:
    """The hashes of every full block of token_ids, extending `known` (the hashes of a prefix)."""
    hashes = list(known or ())
    parent = hashes[-1] if hashes else first_parent(root, salt)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
