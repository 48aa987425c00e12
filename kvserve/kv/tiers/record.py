"""One block of one KV cache group as a self-checking record: what every tier stores.

Layout (little-endian): a fixed header (magic, version, group, token count, payload length, the
cache identity's root hash, the block's chained hash), the block's token ids (uint32), the payload
(the pool's bytes for the block, every layer of its group: PagedKVPool.read_block), then an xxh3-64
checksum of everything before it. The chained hash already covers the identity (model, dtype, KV
format, salt...), so a key never names another cache's block; the record says so again, and
decode_record refuses a record whose identity, key, length or checksum is not the expected one.

A signed record (version 3, written with a RecordSigner: kv/tiers/signing.py) ends with a 28-byte
signature of its key and every byte before it in place of the checksum: the MAC catches damage as
well as forgery, and computing both would cost a third more per store. A reader with a signer
refuses anything else; a reader without one refuses a signed record, which it cannot check.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvserve.kv.tiers.signing import TAG_BYTES, RecordSigner

MAGIC = b"KVSB"
VERSION, SIGNED_VERSION = 1, 3  # 2: signed records that also carried a checksum, refused
_HEADER = struct.Struct("<4sHHIQ16s16s")  # magic, version, group, tokens, payload bytes, identity, block hash
_CHECKSUM = struct.Struct("<Q")


REJECT_REASONS = ("damaged", "foreign", "unsigned", "bad_signature")


class CorruptRecord(ValueError):
    """A record that is truncated, damaged, of another cache or of another block, or (with a
    signer) unsigned or signed with another secret; `reason` is one of REJECT_REASONS."""

    def __init__(self, message: str, reason: str = "damaged") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class BlockRecord:
    block_hash: int  # the chained hash (kv/hashing.py)
    group: int  # the KV cache group the block belongs to
    token_ids: tuple[int, ...]
    payload: bytes  # the pool's bytes for the block


def record_overhead(block_size: int) -> int:
    """Bytes a record adds to its block's K/V at most: header, token ids, a checksum or a signature's tag."""
    return _HEADER.size + 4 * block_size + max(_CHECKSUM.size, TAG_BYTES)


def record_key(block_hash: int, group: int) -> str:
    """A tier's key for a group's block: its chained hash (identity and salt folded in) and group."""
    return f"{block_hash:032x}-{group}"


def record_head(data: bytes) -> tuple[int, int]:
    """(block hash, group) a record says it holds, unchecked: the key to decode it against."""
    if len(data) < _HEADER.size:
        raise CorruptRecord(f"{len(data)} bytes, shorter than a header")
    _, _, group, _, _, _, block = _HEADER.unpack_from(data)
    return int.from_bytes(block, "little"), group


def encode_record(record: BlockRecord, identity: int, signer: RecordSigner | None = None) -> bytes:
    tokens = np.asarray(record.token_ids, dtype="<u4").tobytes()
    header = _HEADER.pack(
        MAGIC, VERSION if signer is None else SIGNED_VERSION, record.group, len(record.token_ids), len(record.payload),
        identity.to_bytes(16, "little"), record.block_hash.to_bytes(16, "little"),
    )  # fmt: skip
    body = b"".join((header, tokens, record.payload))
    if signer is None:
        return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))
    return body + signer.tag(record_key(record.block_hash, record.group), body)


def decode_record(data: bytes, identity: int, key: str, signer: RecordSigner | None = None, verify: bool = True) -> BlockRecord:
    """The record in data, checked against the cache identity and the key it was stored under, and
    with a signer, against its signature (an unsigned record is refused). Not `verify`: a record
    that never left the process (the host tier), whose signature is taken as it is."""
    if len(data) < _HEADER.size + _CHECKSUM.size:
        raise CorruptRecord(f"record {key}: {len(data)} bytes, shorter than a header")
    magic, version, group, count, payload_bytes, ident, block = _HEADER.unpack_from(data)
    if magic != MAGIC or version not in (VERSION, SIGNED_VERSION):
        raise CorruptRecord(f"record {key}: not a version-{VERSION} or -{SIGNED_VERSION} kvserve block record")
    end = _HEADER.size + 4 * count + payload_bytes
    trailer = TAG_BYTES if version == SIGNED_VERSION else _CHECKSUM.size
    if len(data) != end + trailer:
        raise CorruptRecord(f"record {key}: {len(data)} bytes, its header says {end + trailer}")
    body = memoryview(data)[:end]
    if version == SIGNED_VERSION and not verify:
        pass
    elif version == SIGNED_VERSION:
        if signer is None:
            raise CorruptRecord(f"record {key}: signed with a KV record key, and this engine has none to check it",
                                "bad_signature")  # fmt: skip
        if not signer.verify(key, body, memoryview(data)[end:]):
            raise CorruptRecord(f"record {key}: damaged, moved, or signed with another KV record key", "bad_signature")
    else:
        (checksum,) = _CHECKSUM.unpack_from(data, end)
        if xxhash.xxh3_64_intdigest(body) != checksum:
            raise CorruptRecord(f"record {key}: checksum mismatch")
        if signer is not None:
            raise CorruptRecord(f"record {key}: unsigned, and this engine has a KV record key", "unsigned")
    if int.from_bytes(ident, "little") != identity:
        raise CorruptRecord(f"record {key}: written by another cache identity", "foreign")
    block_hash = int.from_bytes(block, "little")
    if record_key(block_hash, group) != key:
        raise CorruptRecord(f"record {key}: holds block {record_key(block_hash, group)}", "foreign")
    tokens = tuple(np.frombuffer(data, dtype="<u4", count=count, offset=_HEADER.size).tolist())
    return BlockRecord(block_hash, group, tokens, bytes(memoryview(data)[_HEADER.size + 4 * count : end]))
