"""KV below the pool: tiers that hold whole blocks once they leave it (host memory, local disk).

`store.BlockStore` is the one interface (get, put, contains, delete, usage) every tier implements;
`record` is the one format they all hold: a block of one KV cache group, every layer of it, keyed by
its chained block hash and checked by its identity and a checksum.
"""

from kvserve.kv.tiers.disk import DiskStore
from kvserve.kv.tiers.host import HostStore
from kvserve.kv.tiers.record import BlockRecord, CorruptRecord, decode_record, encode_record, record_key
from kvserve.kv.tiers.store import BlockStore, TierUsage

__all__ = [
    "BlockRecord", "BlockStore", "CorruptRecord", "DiskStore", "HostStore", "TierUsage", "decode_record", "encode_record", "record_key",
]  # fmt: skip
