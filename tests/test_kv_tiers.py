"""KV tiers' building blocks (kv/tiers/): the block record and its checks, the host store's exact
LRU budget, the disk store's atomic writes, budget and restart, and a pool block's bytes round trip
for every KV format."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvserve.kv.hashing import CacheIdentity, block_hash, first_parent, root_hash
from kvserve.kv.pool import PagedKVPool
from kvserve.kv.spec import KVCacheSpec
from kvserve.kv.tiers import BlockRecord, CorruptRecord, DiskStore, HostStore, decode_record, encode_record, record_key
from kvserve.kv.tiers.host import ENTRY_OVERHEAD

IDENTITY = root_hash(CacheIdentity(model="m", dtype="bfloat16", kv_cache_dtype="bfloat16"))


def a_record(seed: int, payload_bytes: int = 1000, group: int = 0) -> tuple[str, BlockRecord]:
    rng = random.Random(seed)
    tokens = tuple(rng.randrange(50_000) for _ in range(16))
    key_hash = block_hash(first_parent(IDENTITY, None), tokens)
    record = BlockRecord(key_hash, group, tokens, rng.randbytes(payload_bytes))
    return record_key(key_hash, group), record


def test_a_record_round_trips_and_every_kind_of_damage_is_refused():
    key, record = a_record(0)
    data = encode_record(record, IDENTITY)
    assert decode_record(data, IDENTITY, key) == record
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    with pytest.raises(CorruptRecord, match="checksum"):
        decode_record(bytes(flipped), IDENTITY, key)
    with pytest.raises(CorruptRecord, match="bytes"):
        decode_record(data[:-7], IDENTITY, key)  # truncated
    with pytest.raises(CorruptRecord, match="shorter than a header"):
        decode_record(data[:20], IDENTITY, key)
    with pytest.raises(CorruptRecord, match="another cache identity"):
        other = root_hash(CacheIdentity(model="m", dtype="bfloat16", kv_cache_dtype="int8"))
        decode_record(data, other, key)
    other_key, _ = a_record(1)
    with pytest.raises(CorruptRecord, match="holds block"):
        decode_record(data, IDENTITY, other_key)  # stored under the wrong key
    with pytest.raises(CorruptRecord, match="holds block"):
        decode_record(data, IDENTITY, record_key(record.block_hash, 1))  # another group's key
    with pytest.raises(CorruptRecord, match="not a version"):
        decode_record(b"XXXX" + data[4:], IDENTITY, key)


def test_a_salted_block_has_another_key():
    tokens = tuple(range(16))
    plain = block_hash(first_parent(IDENTITY, None), tokens)
    salted = block_hash(first_parent(IDENTITY, "tenant-a"), tokens)
    assert record_key(plain, 0) != record_key(salted, 0) and record_key(plain, 0) != record_key(plain, 1)


def test_the_host_store_keeps_its_exact_budget_in_lru_order():
    records = [a_record(i) for i in range(12)]
    cost = len(encode_record(records[0][1], IDENTITY)) + len(records[0][0]) + ENTRY_OVERHEAD
    dropped = []
    store = HostStore(10 * cost, on_evict=lambda key, data: dropped.append(key))
    for key, record in records[:10]:
        assert store.put(key, encode_record(record, IDENTITY))
    assert store.usage().used_bytes == 10 * cost and store.usage().entries == 10
    assert store.get(records[0][0]) is not None  # now the most recently used
    for key, record in records[10:]:
        assert store.put(key, encode_record(record, IDENTITY))
    assert dropped == [records[1][0], records[2][0]]  # least recently used first, handed down
    assert store.contains(records[0][0]) and not store.contains(records[1][0])
    assert store.usage().used_bytes <= store.capacity_bytes
    store.delete(records[0][0])
    assert not store.contains(records[0][0]) and store.usage().entries == 9
    assert not HostStore(cost - 1).put(*[records[0][0], encode_record(records[0][1], IDENTITY)])  # larger than the budget
    with pytest.raises(ValueError, match="positive"):
        HostStore(0)


def test_the_disk_store_survives_a_restart_within_its_budget(tmp_path):
    records = [(key, encode_record(record, IDENTITY)) for key, record in (a_record(i) for i in range(6))]
    size = len(records[0][1])
    store = DiskStore(tmp_path, 4 * size)
    for i, (key, data) in enumerate(records[:4]):
        assert store.put(key, data)
        os.utime(tmp_path / f"{key}.kvb", ns=(10**18 + i, 10**18 + i))  # distinct times on a coarse clock
    store.get(records[0][0])
    os.utime(tmp_path / f"{records[0][0]}.kvb", ns=(10**18 + 10, 10**18 + 10))
    (tmp_path / f"{records[5][0]}.tmp-1-0").write_bytes(b"half a rec")  # a crash mid-write
    again = DiskStore(tmp_path, 4 * size)  # a new engine on the same directory
    assert again.usage() == store.usage()
    assert not list(tmp_path.glob("*.tmp-*"))
    assert again.get(records[2][0]) == records[2][1]
    assert decode_record(again.get(records[3][0]), IDENTITY, records[3][0])
    assert again.put(*records[4])  # over budget: the least recently used (record 1) goes
    assert not again.contains(records[1][0]) and not (tmp_path / f"{records[1][0]}.kvb").exists()
    assert again.contains(records[0][0]) and again.usage().used_bytes <= 4 * size
    (tmp_path / f"{records[2][0]}.kvb").unlink()  # deleted behind its back: a miss
    assert again.get(records[2][0]) is None and not again.contains(records[2][0])
    smaller = DiskStore(tmp_path, 2 * size)  # a smaller budget at start drops the oldest
    assert smaller.usage().entries == 2 and smaller.usage().used_bytes <= 2 * size
    assert not smaller.put("big", bytes(3 * size))


def test_a_disk_store_that_cannot_write_refuses_without_an_error(tmp_path):
    store = DiskStore(tmp_path / "tier", 10_000)
    os.chmod(tmp_path / "tier", 0o500)
    try:
        if os.access(tmp_path / "tier", os.W_OK):  # root ignores modes: take the directory away instead
            os.chmod(tmp_path / "tier", 0o700)
            (tmp_path / "tier").rename(tmp_path / "gone")
        assert not store.put("k", b"data")
        assert store.write_failures == 1 and store.usage().entries == 0
    finally:
        for path in (tmp_path / "tier", tmp_path / "gone"):
            if path.exists():
                os.chmod(path, 0o700)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match="--kv-offload-disk-dir"):
        DiskStore(tmp_path / "file" / "sub", 10_000)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3", "int4", "int2"])
def test_a_pool_block_round_trips_through_a_record(kv_dtype):
    kivi = kv_dtype in ("int4", "int2")
    extra = {"residual_dtype": "bfloat16"} if kivi else {}
    spec = KVCacheSpec(3, 2, 64, kv_dtype, 32 if kivi else 16, **extra)
    pool = PagedKVPool(spec, 8, torch.device("cpu"), num_residual_blocks=4 if kivi else 0)
    g = torch.Generator().manual_seed(0)
    for block in (2, 9 if kivi else 5):  # a quantized (or float) block; a KIVI cache's residual block
        like = pool.read_block(block)
        if like.dtype == torch.uint8:
            data = torch.randint(0, 255, like.shape, generator=g, dtype=torch.uint8)
        else:
            data = torch.randn(like.shape, generator=g).to(like.dtype)
        pool.write_block(block, data)
        key, _ = a_record(block)
        record = BlockRecord(int(key.split("-")[0], 16), 0, tuple(range(16)), pool.block_bytes(block))
        stored = encode_record(record, IDENTITY)
        target = block + 1
        pool.write_block_bytes(target, decode_record(stored, IDENTITY, key).payload)
        assert torch.equal(pool.read_block(target), pool.read_block(block))
        with pytest.raises(ValueError, match="bytes"):
            pool.write_block_bytes(target, record.payload[:-1])
