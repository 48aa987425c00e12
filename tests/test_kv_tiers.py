"""KV tiers' building blocks (kv/tiers/): the block record and its checks, the host store's exact
LRU budget, the disk store's atomic writes, budget and restart, and a pool block's bytes round trip
for every KV format."""

from __future__ import annotations

import logging
import os
import random
import shutil
import time

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


def test_a_disk_store_that_cannot_write_refuses_without_an_error(tmp_path, caplog):
    store = DiskStore(tmp_path / "tier", 10_000)
    assert store.put("old", b"x")
    # the directory removed while the engine runs: made again at the next write, its records forgotten (found by QA: it never was)
    shutil.rmtree(tmp_path / "tier")
    assert store.put("k", b"data") and store.usage().entries == 1 and not store.contains("old")
    # a medium that refuses (a file where the directory was): refused and counted, one warning until a write succeeds
    shutil.rmtree(tmp_path / "tier")
    (tmp_path / "tier").write_bytes(b"")
    with caplog.at_level(logging.INFO, logger="kvserve.kv.tiers.disk"):
        for i in range(5):
            assert not store.put(f"k{i}", b"data")
        assert store.write_failures == 5 and store.usage().entries == 1
        assert sum("could not write" in r.getMessage() for r in caplog.records) == 1
        (tmp_path / "tier").unlink()
        (tmp_path / "tier").mkdir()
        assert store.put("k9", b"data") and store.get("k9") == b"data"
        assert store.get("k") is None  # its file went with the directory: a miss
        assert any("writes again" in r.getMessage() for r in caplog.records)
    # a record replaced by a directory is a miss that is forgotten, never an error
    assert store.put("k8", b"data")
    (tmp_path / "tier" / "k8.kvb").unlink()
    (tmp_path / "tier" / "k8.kvb").mkdir()
    assert store.get("k8") is None and not store.contains("k8")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match="--kv-offload-disk-dir"):
        DiskStore(tmp_path / "file" / "sub", 10_000)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3", "int4", "int2"])
def test_a_pool_block_round_trips_through_a_record(kv_dtype):
    kivi = kv_dtype in ("int4", "int2")
    extra = {"residual_dtype": "bfloat16"} if kivi else {}
    spec = KVCacheSpec(3, 2, 64, kv_dtype, 32 if kivi else 16, **extra)
    pool = PagedKVPool(spec, 4 * spec.residual_units if kivi else 8, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for block in (2, pool.first_residual + 1 if kivi else 5):  # a quantized (or float) block; a KIVI cache's full-precision block
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


# ---------------------------------------------------------------------- the engine with tiers
from conftest import random_prompts  # noqa: E402
import kvserve.engine.engine as engine_module  # noqa: E402
from kvserve.kv.tiers import budgets  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=11, logprobs=2)


def trace(output) -> tuple:
    return tuple(output.token_ids), tuple((lp.token_id, lp.logprob) for lp in output.logprobs or ())


def one_by_one(llm: LLM, prompts, params) -> list:
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    if llm.engine.kv.offloader is not None:
        llm.engine.kv.offloader.drain()
    return outs


def tiered(path, tmp_path, tier: str, **settings) -> LLM:
    tiers = {"host": dict(kv_offload_host_gib=0.002), "disk": dict(kv_offload_disk_dir=str(tmp_path / "disk"), kv_offload_disk_gib=0.05),
             "both": dict(kv_offload_host_gib=0.0001, kv_offload_disk_dir=str(tmp_path / "disk"), kv_offload_disk_gib=0.05)}[tier]  # fmt: skip
    llm = LLM(path, **({"dtype": "float32", "num_kv_blocks": 24, "max_num_seqs": 2} | tiers | settings))
    # a tiny model recomputes faster than a tier reads: pin its prefill rate low so loads win (the
    # decision itself is test_loading_is_chosen_only_where_it_beats_recompute's)
    llm.engine.kv.offloader.prefill_rate = 1.0
    llm.engine.kv.offloader.observe_prefill = lambda tokens, seconds: None
    return llm


def test_a_radix_hit_of_a_few_shared_tokens_still_loads_the_rest_from_the_tier(tiny_dir, tmp_path):
    """Prompts that open alike (a BOS and a common first word) find a few tokens in the radix tree:
    the tier still serves the rest of their prefix (it reads that partial block whole)."""
    path = str(tiny_dir("llama"))
    prompts = [[1, 7, 7] + p for p in random_prompts(8, 90, 120, seed=5)]
    plain = LLM(path, dtype="float32", num_kv_blocks=24, max_num_seqs=2, prefix_cache="radix")
    llm = tiered(path, tmp_path, "host", prefix_cache="radix")
    expected = [trace(o) for o in one_by_one(plain, prompts, GREEDY)]
    assert [trace(o) for o in one_by_one(llm, prompts, GREEDY)] == expected
    again = one_by_one(llm, prompts, GREEDY)
    assert [trace(o) for o in again] == expected
    assert all(o.num_cached_tokens >= 64 for o in again)
    assert llm.stats()["kv_tiers"]["host"]["hit_tokens"] >= 8 * 64


def test_a_sliding_groups_block_evicted_before_the_rest_comes_back_from_the_tier_alone(tiny_dir, tmp_path):
    """Gemma 3: the pool still holds a prompt's full-attention blocks, but a sliding group's block of
    its last window went down to the host tier: the tier fills that hole (one block read, the rest
    read where it is) and the hit is whole again, with the tokens of the first run."""
    path = str(tiny_dir("gemma3"))
    prompt = random_prompts(1, 100, 100, seed=12)[0]
    llm = tiered(path, tmp_path, "host", num_kv_blocks=120)
    first = one_by_one(llm, [prompt], GREEDY)[0]
    kv = llm.engine.kv
    sliding = next(g for g, group in enumerate(kv.groups) if group.window is not None)
    index = kv.groups[sliding].first_block(96, 16)  # the window before a hit at 96 (the prompt's whole blocks)
    (block,) = [b for b in kv.prefix_cache.blocks(sliding) if b.token_ids == tuple(prompt[index * 16 : (index + 1) * 16])]
    key, taken = block.block_hash, []
    kv.pool.refresh(block)
    kv.pool._free.move_to_end(block.block_id, last=False)  # the LRU queue's head: the first cached block the pool reuses
    while kv.prefix_cache.cached(sliding, key) is not None:
        taken += kv.pool.allocate(1, sliding)
    full = next(g for g, group in enumerate(kv.groups) if group.window is None)
    held = {b.token_ids for b in kv.prefix_cache.blocks(full)}
    assert taken[-1] is block and all(tuple(prompt[i * 16 : (i + 1) * 16]) in held for i in range(6))  # the hole is the window's only
    kv.pool.free(taken)
    kv.offloader.drain()
    assert kv.lookup("probe", prompt, None).num_tokens < 96
    again = one_by_one(llm, [prompt], GREEDY)[0]
    assert again.num_cached_tokens == 96 and trace(again) == trace(first)
    assert llm.stats()["kv_tiers"]["host"]["hit_tokens"] == 16


def test_blocks_marked_to_reuse_first_are_not_written_back(tiny_dir, tmp_path):
    """A block the pool reuses first (a sliding window's behind the window a hit at its prompt's end
    reads, an unloaded adapter's) is dropped when evicted, not copied down: few hits could use it.
    An ordinary cached block evicted beside it goes down to the host tier."""
    from kvserve.kv.tiers import record_key

    llm = tiered(str(tiny_dir("llama")), tmp_path, "host", num_kv_blocks=40)
    prompt = random_prompts(1, 100, 100, seed=13)[0]
    one_by_one(llm, [prompt], GREEDY)
    kv = llm.engine.kv
    early, ordinary = [b for b in kv.prefix_cache.blocks(0) if b.token_ids in (tuple(prompt[:16]), tuple(prompt[16:32]))]
    keys = [record_key(b.block_hash, 0) for b in (early, ordinary)]
    kv.pool.reuse_first(early)
    taken = kv.pool.allocate(kv.pool.num_free_blocks)
    kv.pool.free(taken)
    kv.offloader.drain()
    host = kv.offloader.stores[0]
    assert not host.contains(keys[0]) and host.contains(keys[1])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_waiting_requests_load_their_prefixes_once_each(tiny_dir, tmp_path, family):
    """Eight prompts asked again at once, through a pool that holds two: a load starts only for a
    request the pool can admit, so no load's blocks are evicted by another's before its request runs
    (before, loads started for every waiting request evicted each other: 13 loads for 8 prefixes).
    Each prefix comes back whole in one load, with the tokens of an engine without tiers."""
    path = str(tiny_dir(family))
    prompts = random_prompts(8, 90, 120, seed=3)
    plain = LLM(path, dtype="float32", num_kv_blocks=24, max_num_seqs=2)
    expected = [trace(o) for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = tiered(path, tmp_path, "host", max_num_seqs=2)
    assert [trace(o) for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    llm.engine.kv.offloader.drain()
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [trace(o) for o in again] == expected
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 16 * 16 for p in prompts]
    stats = llm.stats()
    assert stats["kv_offload_decisions_total"]["load"] == 8
    assert stats["kv_tiers"]["host"]["hit_tokens"] == sum(o.num_cached_tokens for o in again)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_host_tier_loads_are_admitted_in_the_step_that_finds_them(tiny_dir, tmp_path, tier):
    """A short load from the host tier is read on the step loop at once: two requests asked again run
    from their whole prefixes after one step, together; a disk tier's loads go to the tiers' worker
    and their requests wait for them. Tokens as without tiers either way."""
    from kvserve.engine.sequence import SequenceStatus

    path = str(tiny_dir("llama"))
    prompts = random_prompts(8, 90, 120, seed=3)
    plain = LLM(path, dtype="float32", num_kv_blocks=24, max_num_seqs=2)
    expected = [trace(o) for o in plain.generate(prompts[:2], GREEDY, use_tqdm=False)]
    llm = tiered(path, tmp_path, tier, max_num_seqs=2)
    llm.generate(prompts, GREEDY, use_tqdm=False)  # the first two are evicted to the tier by the six after them
    llm.engine.kv.offloader.drain()
    engine = llm.engine
    seqs = [engine.add_request(p, GREEDY) for p in prompts[:2]]
    engine.step()
    if tier == "host":
        assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 2 and not engine.scheduler.loading
        assert [s.num_cached_tokens for s in seqs] == [(len(p) - 1) // 16 * 16 for p in prompts[:2]]
    else:
        assert seqs[0].status is SequenceStatus.WAITING and seqs[0].request_id in engine.scheduler.loading
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [trace(outputs[s.request_id]) for s in seqs] == expected
    assert llm.stats()["kv_tiers"][tier]["hit_tokens"] == sum((len(p) - 1) // 16 * 16 for p in prompts[:2])


@pytest.mark.parametrize("tier", ["host", "disk", "both"])
@pytest.mark.parametrize("family, kv_dtype", [("llama", "float32"), ("gemma3", "float32"), ("llama", "int8"), ("gemma3", "bfloat16")])
def test_prefixes_evicted_from_the_pool_come_back_from_the_tiers_with_the_same_tokens(tiny_dir, tmp_path, tier, family, kv_dtype):
    """Eight prompts through a 24-block pool evict each other; run again, each comes back from the
    tiers (counted) with the tokens and logprobs of an engine without tiers and of its own first run,
    greedy and seeded; Gemma 3's sliding-window group included."""
    path = str(tiny_dir(family))
    prompts = random_prompts(8, 90, 120, seed=1)
    plain = LLM(path, dtype="float32", kv_cache_dtype=kv_dtype, num_kv_blocks=24, max_num_seqs=2)
    llm = tiered(path, tmp_path, tier, kv_cache_dtype=kv_dtype)
    for params in (GREEDY, SEEDED):
        expected = [trace(o) for o in one_by_one(plain, prompts, params)]
        assert [trace(o) for o in one_by_one(llm, prompts, params)] == expected
        again = one_by_one(llm, prompts, params)
        assert [trace(o) for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) >= 8 * 64  # not from the pool: it holds two prompts at most
    stats = llm.stats()
    assert sum(t["hit_tokens"] for t in stats["kv_tiers"].values()) >= 8 * 64
    assert stats["kv_offload_decisions_total"]["load"] >= 8
    if tier == "both":
        assert stats["kv_tiers"]["host"]["hit_tokens"] > 0 and stats["kv_tiers"]["disk"]["hit_tokens"] > 0
    usage = stats["kv_tiers"]
    assert all(t["usage_bytes"] <= t["capacity_bytes"] for t in usage.values())


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("family, kv_dtype, sink_block", [("qwen3", "int4", True), ("llama", "int2", True), ("qwen3", "int4", False)])
def test_kivi_blocks_come_back_from_the_tiers_as_they_would_from_the_pool(tiny_dir, tmp_path, tier, family, kv_dtype, sink_block):
    """int4 / int2: a prefix hit reads the residual window before its end in full precision and older
    blocks quantized, as computing the prompt does (kv/kivi_hits.py). Prompts evicted from a pool of 8
    full-precision blocks come back from the tiers (counted, both forms) with the tokens and logprobs
    a roomy pool's hits give, greedy and seeded, which are those of their cold runs."""
    path = str(tiny_dir(family))
    prompts = random_prompts(8, 150, 200, seed=7)
    kivi = dict(kv_cache_dtype=kv_dtype, kv_quant_residual=32, kv_quant_sink_block=sink_block, max_num_seqs=2)
    roomy = LLM(path, dtype="float32", num_kv_blocks=2000, **kivi)
    units = 8 * roomy.engine.kv_spec.residual_units  # the prefill of one prompt at full precision, with little to spare
    llm = tiered(path, tmp_path, tier, num_kv_blocks=units, **({"kv_offload_host_gib": 0.01} if tier == "host" else {}), **kivi)
    for params in (GREEDY, SEEDED):
        cold, hit = (one_by_one(roomy, prompts, params) for _ in range(2))
        assert all(o.num_cached_tokens > 0 for o in hit)
        assert [trace(o) for o in one_by_one(llm, prompts, params)] == [trace(o) for o in cold]
        again = one_by_one(llm, prompts, params)
        assert [trace(o) for o in again] == [trace(o) for o in hit] == [trace(o) for o in cold]
        assert [o.num_cached_tokens for o in again] == [o.num_cached_tokens for o in hit]
    stats = llm.stats()
    assert sum(t["hit_tokens"] for t in stats["kv_tiers"].values()) >= 8 * 64
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_a_record_larger_than_the_host_tier_goes_to_the_disk_tier(tiny_dir, tmp_path):
    """An int4 cache's full-precision sink record is several quantized records' size: a host tier
    too small for it (it still takes the quantized ones) hands it to the disk tier, so every prefix
    chain stays whole and comes back."""
    path = str(tiny_dir("qwen3"))
    prompts = random_prompts(6, 150, 200, seed=10)
    kivi = dict(kv_cache_dtype="int4", kv_quant_residual=32, max_num_seqs=2)
    roomy = LLM(path, dtype="float32", num_kv_blocks=2000, **kivi)
    spec = roomy.engine.kv_spec
    host_gib = 3 * spec.bytes_per_block / 2**30  # a few quantized records; the sink record is residual_units times larger
    assert spec.residual_block_bytes > 3 * spec.bytes_per_block
    llm = tiered(path, tmp_path, "both", num_kv_blocks=8 * spec.residual_units, kv_offload_host_gib=host_gib, **kivi)
    one_by_one(roomy, prompts, GREEDY)
    hits = one_by_one(roomy, prompts, GREEDY)
    one_by_one(llm, prompts, GREEDY)
    offloader, asked = llm.engine.kv.offloader, []
    weigh = offloader.worth_loading
    offloader.worth_loading = lambda tiers, sizes, tokens: asked.append(list(sizes)) or weigh(tiers, sizes, tokens)
    again = one_by_one(llm, prompts, GREEDY)
    assert [trace(o) for o in again] == [trace(o) for o in hits]
    assert [o.num_cached_tokens for o in again] == [o.num_cached_tokens for o in hits]
    # the load-or-recompute estimate counts the full-precision records (the sink block, the residual
    # window before the hit's end) at their own, larger size, the quantized ones between at theirs
    from_start = [sizes for sizes in asked if sizes[0] == spec.residual_block_bytes]
    assert from_start and all(set(sizes[1:]) == {spec.bytes_per_block, spec.residual_block_bytes} and sizes[1:] == sorted(sizes[1:])
                              for sizes in from_start)  # fmt: skip
    tiers = llm.stats()["kv_tiers"]
    assert tiers["disk"]["hit_tokens"] > 0 and tiers["host"]["usage_bytes"] <= tiers["host"]["capacity_bytes"]


def written_down(path, tmp_path, prompts) -> list:
    """The prompts' greedy traces from an engine that wrote every block to the disk tier (write-through), then stopped."""
    first = tiered(path, tmp_path, "disk", kv_offload_policy="write_through")
    expected = [trace(o) for o in one_by_one(first, prompts, GREEDY)]
    first.engine.kv.offloader.close()
    return expected


def test_a_restarted_engine_reuses_the_disk_tier_and_another_identity_never_does(tiny_dir, tmp_path):
    path = str(tiny_dir("llama"))
    prompts = random_prompts(4, 90, 120, seed=2)
    expected = written_down(path, tmp_path, prompts)
    again = tiered(path, tmp_path, "disk")
    outs = one_by_one(again, prompts, GREEDY)
    assert [trace(o) for o in outs] == expected and all(o.num_cached_tokens >= 80 for o in outs)
    for other in (dict(kv_cache_dtype="int8"), dict(dtype="bfloat16")):
        changed = tiered(path, tmp_path, "disk", **other)
        assert all(o.num_cached_tokens == 0 for o in one_by_one(changed, prompts, GREEDY)), other
        assert changed.stats()["kv_tiers"]["disk"]["hit_tokens"] == 0
    salted = [again.generate([p], GREEDY, use_tqdm=False, cache_salt="tenant-b")[0] for p in prompts]
    assert all(o.num_cached_tokens == 0 for o in salted) and [trace(o) for o in salted] == expected


def test_write_through_stores_every_computed_block_in_host_and_disk_alike(tiny_dir, tmp_path):
    """Found by QA: with host and disk tiers, write_through wrote to the host tier only, and a block
    reached the disk only when the host tier dropped it; a crash lost every block it still held."""
    path = str(tiny_dir("llama"))
    prompts = random_prompts(4, 90, 120, seed=31)
    first = tiered(path, tmp_path, "both", kv_offload_host_gib=0.05, kv_offload_policy="write_through")
    expected = [trace(o) for o in one_by_one(first, prompts, GREEDY)]
    # every step hands what it copied out to the worker when it ends: an idle engine holds nothing back
    assert not first.engine.kv.offloader._outbox
    first.engine.kv.offloader.drain()
    host, disk = first.engine.kv.offloader.local
    keys = [key for key, _ in host.records()]
    assert len(keys) >= 4 * 5 and all(disk.contains(key) for key in keys)  # the host tier dropped nothing; the disk has it all
    restarted = tiered(path, tmp_path, "disk")  # what a crash leaves: the disk alone
    outs = one_by_one(restarted, prompts, GREEDY)
    assert [trace(o) for o in outs] == expected and all(o.num_cached_tokens >= 80 for o in outs)


@pytest.mark.parametrize("tier", ["disk", "both"])
def test_a_graceful_shutdown_sends_the_pools_and_the_host_tiers_blocks_to_disk(tiny_dir, tmp_path, tier):
    """write_back keeps a block in the pool (and then the host tier) until it is evicted: persist, the
    drain's last step, writes what only they hold to the disk, so the restarted engine starts warm."""
    path = str(tiny_dir("llama"))
    prompts = random_prompts(6, 90, 120, seed=32)
    first = tiered(path, tmp_path, tier, num_kv_blocks=64, **({"kv_offload_host_gib": 0.0004} if tier == "both" else {}))
    expected = [trace(o) for o in one_by_one(first, prompts, GREEDY)]
    kv = first.engine.kv
    disk = kv.offloader.local[-1]
    kv.offloader.drain()
    assert disk.usage().entries < 6 * 5  # write_back: most blocks are still above the disk
    assert kv.persist_to_tiers(timeout=30) > 0
    cached = kv.prefix_cache.blocks()
    assert cached and all(disk.contains(record_key(b.block_hash, b.group)) for b in cached)
    assert all(disk.contains(key) for store in kv.offloader.local[:-1] for key, _ in store.records())
    assert kv.persist_to_tiers(timeout=30) == 0  # nothing left to write
    restarted = tiered(path, tmp_path, "disk", num_kv_blocks=64)
    outs = one_by_one(restarted, prompts, GREEDY)
    assert [trace(o) for o in outs] == expected and all(o.num_cached_tokens >= 80 for o in outs)


def test_corrupt_truncated_and_deleted_records_are_misses_with_the_right_tokens(tiny_dir, tmp_path):
    path = str(tiny_dir("llama"))
    prompts = random_prompts(4, 90, 120, seed=3)
    expected = written_down(path, tmp_path, prompts)
    files = sorted((tmp_path / "disk").glob("*.kvb"))
    assert len(files) >= 20
    for i, file in enumerate(files):
        data = bytearray(file.read_bytes())
        if i % 3 == 0:
            data[len(data) // 2] ^= 0xFF  # damaged
            file.write_bytes(bytes(data))
        elif i % 3 == 1:
            file.write_bytes(bytes(data[: len(data) // 2]))  # truncated
        else:
            file.unlink()  # gone
    again = tiered(path, tmp_path, "disk")
    assert [trace(o) for o in one_by_one(again, prompts, GREEDY)] == expected
    assert again.stats()["kv_tiers"]["disk"]["corrupt_records"] >= 1


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_load_that_meets_a_bad_record_is_the_requests_last(tiny_dir, tmp_path, family):
    """Records deleted or damaged on disk between two passes: each request loads once, takes the
    prefix up to the first bad record and recomputes the rest (before, on Gemma 3 a request loaded
    again and again, up to six times, each load ending at the next bad record), with the tokens of
    an engine without tiers."""
    path = str(tiny_dir(family))
    prompts = random_prompts(8, 90, 120, seed=9)
    plain = LLM(path, dtype="float32", num_kv_blocks=24, max_num_seqs=2)
    expected = [trace(o) for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = tiered(path, tmp_path, "disk")
    assert [trace(o) for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    llm.engine.kv.offloader.drain()
    files = sorted((tmp_path / "disk").glob("*.kvb"))
    assert len(files) >= 24
    for i, file in enumerate(files):
        if i % 3 == 0:
            file.unlink()
        elif i % 3 == 1:
            data = bytearray(file.read_bytes())
            data[len(data) // 2] ^= 0xFF
            file.write_bytes(bytes(data))
    loads = llm.stats()["kv_offload_decisions_total"]["load"]
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [trace(o) for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) < sum((len(p) - 1) // 16 * 16 for p in prompts)  # the bad records were met
    assert 0 < llm.stats()["kv_offload_decisions_total"]["load"] - loads <= len(prompts)


def test_a_full_disk_tier_degrades_to_recompute(tiny_dir, tmp_path):
    path = str(tiny_dir("llama"))
    prompts = random_prompts(6, 90, 120, seed=4)
    plain = LLM(path, dtype="float32", num_kv_blocks=24, max_num_seqs=2)
    expected = [trace(o) for o in one_by_one(plain, prompts, GREEDY)]
    tiny = tiered(path, tmp_path, "disk", kv_offload_disk_gib=2e-5)  # ~21 KB: a record or two
    for _ in range(2):
        assert [trace(o) for o in one_by_one(tiny, prompts, GREEDY)] == expected
    disk = tiny.stats()["kv_tiers"]["disk"]
    assert disk["usage_bytes"] <= disk["capacity_bytes"]
    assert disk["write_failures"] == 0  # a record over the whole budget is not taken: not a failure of the medium


def test_a_preempted_sequence_resumes_from_the_tier_with_the_same_tokens(tiny_dir, tmp_path):
    """Eight long generations in a pool too small for them preempt each other; their published blocks
    go down when evicted, and each resumes by loading them (counted), giving an unpreempted run's tokens."""
    path = str(tiny_dir("llama"))
    prompts = random_prompts(8, 60, 80, seed=5)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    roomy = LLM(path, dtype="float32", num_kv_blocks=400)
    expected = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    llm = tiered(path, tmp_path, "host", num_kv_blocks=40, max_num_seqs=8, kv_offload_host_gib=0.01)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_tiers"]["host"]["hit_tokens"] > 0


@pytest.mark.parametrize("settings, message", [
    (dict(kv_offload_host_gib=-1.0), "kv_offload_host_gib"),
    (dict(kv_offload_host_gib=float("nan")), "kv_offload_host_gib"),
    (dict(kv_offload_disk_dir="/tmp/x", kv_offload_disk_gib=0.0), "kv_offload_disk_gib"),
    (dict(kv_offload_disk_gib=5.0), "give --kv-offload-disk-dir too"),
    (dict(kv_offload_disk_dir=""), "must name a directory"),
    (dict(kv_offload_disk_dir="/sys/kernel"), "cannot write a file there"),
    (dict(kv_offload_disk_dir="/etc/hostname"), "not a directory"),
    (dict(kv_offload_policy="sometimes"), "kv_offload_policy"),
    (dict(kv_offload_host_gib=1.0, enable_prefix_caching=False), "prefix caching"),
    # found by QA: a budget under a byte failed only after the model loaded; a policy without a tier did nothing
    (dict(kv_offload_host_gib=1e-12), "at least 1 KiB"),
    (dict(kv_offload_disk_dir="/tmp/x", kv_offload_disk_gib=1e-12), "at least 1 KiB"),
    (dict(kv_offload_policy="write_through"), "give one"),
    # found by QA: budgets no machine here has started without a word
    (dict(kv_offload_host_gib=1e12), "more than this machine gives this process"),
    (dict(kv_offload_disk_dir="/tmp/x", kv_offload_disk_gib=1e9), "more than the file system under /tmp/x holds"),
])  # fmt: skip
def test_bad_tier_settings_are_refused_by_name(tiny_dir, settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_dir("llama")), dtype="float32", num_kv_blocks=24, **settings)


def test_a_refused_tier_budget_creates_nothing_and_loads_nothing(tiny_dir, tmp_path, monkeypatch):
    """Found by QA: a disk tier refused for its size left the directories it had created; the
    budgets are now checked before the model loads and before anything is created."""
    target = tmp_path / "made" / "here"
    loaded = []
    monkeypatch.setattr(engine_module, "resolve_model_path", lambda *a: loaded.append(a))
    with pytest.raises(ValueError, match="more than the file system under"):
        LLM(str(tiny_dir("llama")), kv_offload_disk_dir=str(target), kv_offload_disk_gib=1e9)
    assert not (tmp_path / "made").exists() and not loaded


def test_host_and_tmpfs_disk_tiers_are_counted_together(tiny_dir, monkeypatch):
    """A disk tier on tmpfs is memory too: with the host tier they may not pass the machine's memory
    (found by QA: 20 + 20 GiB started on a 23.5 GiB machine)."""
    gib = 1 << 30
    monkeypatch.setattr(budgets, "device_memory_bytes", lambda device: 10 * gib)
    monkeypatch.setattr(budgets, "_disk_usage", lambda directory: shutil._ntuple_diskusage(8 * gib, 0, 8 * gib))
    monkeypatch.setattr(budgets, "_file_system_type", lambda path: "tmpfs")
    with pytest.raises(ValueError, match="tmpfs: memory too"):
        LLM(str(tiny_dir("llama")), kv_offload_host_gib=6.0, kv_offload_disk_dir="/dev/shm/kvserve-test", kv_offload_disk_gib=5.0)
    monkeypatch.setattr(budgets, "_file_system_type", lambda path: "ext4")  # on disk: each within its own limit
    budgets.check_tier_budgets(6.0, "/dev/shm/kvserve-test", 5.0)


def test_tier_budgets_past_what_is_left_start_with_a_warning(tiny_dir, tmp_path, monkeypatch, caplog):
    """Beside the weights and the pool, or above what is free now (ulimit -v counts what the process
    already maps): a warning, not a refusal, since the tiers fill only as blocks leave the pool."""
    gib = 1 << 30
    monkeypatch.setattr(budgets, "_free_memory_bytes", lambda: gib // 4)
    with caplog.at_level(logging.WARNING, logger=budgets.__name__):
        llm = LLM(str(tiny_dir("llama")), dtype="float32", num_kv_blocks=24, kv_offload_host_gib=0.5)
    assert "more than the 0.25 GiB of memory free now" in caplog.text
    total = 2 * gib
    monkeypatch.setattr(budgets, "device_memory_bytes", lambda device: total)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=budgets.__name__):
        budgets.warn_tier_budgets(1.9, None, None, llm.engine.weight_bytes + llm.engine.pool.nbytes + gib // 5)
    assert "together more than the 2.00 GiB this process may use" in caplog.text


def test_loading_is_chosen_only_where_it_beats_recompute():
    """The decision compares each tier's measured latency and bandwidth with the measured prefill rate;
    a tier is tried a few times first (so it gets measured), then skipped where it is slower."""
    from kvserve.kv.tiers.offload import KVOffloader

    store = HostStore(1 << 20)
    blocks = {7: bytes(1000)}
    offloader = KVOffloader([store], IDENTITY, lambda block_id: blocks[block_id], lambda block_id, data: None)
    key, record = a_record(0)
    offloader.offload(7, record.block_hash, 0, record.token_ids)
    offloader.drain()
    assert offloader.locate([key]) == [store]
    counters = offloader.counters["host"]
    counters.loads = 5  # measured: 1 ms latency, 1 MB/s
    counters.latency, counters.bandwidth = 1e-3, 1e6
    offloader.prefill_rate = 1e6  # 16 tokens recompute in 16 us: far faster than a 1 ms read
    assert not offloader.worth_loading([store], [1000], 16)
    offloader.prefill_rate = 100.0  # 160 ms to recompute
    assert offloader.worth_loading([store], [1000], 16)
    assert offloader.decisions == {"load": 1, "recompute": 1}
    # each record counts its own bytes (a KIVI cache's full-precision sink record is several
    # quantized records' size): 1 ms + 2 x 10 ms against 30 ms of recompute loads; 1 ms + 10 + 40 ms
    # against 40 ms recomputes
    assert offloader.load_seconds([store, store], [10_000, 10_000]) == (pytest.approx(0.021), False)
    assert offloader.worth_loading([store, store], [10_000, 10_000], 3)
    assert not offloader.worth_loading([store, store], [10_000, 40_000], 4)
    counters.loads = 0
    offloader.prefill_rate = 1e6
    assert offloader.worth_loading([store], [1000], 16)  # never measured: tried
    offloader.observe_prefill(1000, 0.5)
    assert offloader.prefill_rate < 1e6


def test_the_tiers_show_in_prometheus_and_in_top(tiny_dir, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.server.metrics import ServerMetrics
    from kvserve.server.top import render, tier_rows

    path = str(tiny_dir("llama"))
    llm = tiered(path, tmp_path, "both")
    prompts = random_prompts(6, 90, 120, seed=6)
    for _ in range(2):
        one_by_one(llm, prompts, GREEDY)
    metrics = ServerMetrics("tiny")
    metrics.update_from_stats(llm.stats())
    samples = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            key = f"{s.name}|{s.labels.get('tier', '')}|{s.labels.get('direction', s.labels.get('decision', ''))}"
            samples[key] = s.value
    tiers = llm.stats()["kv_tiers"]
    for tier in ("host", "disk"):
        assert samples[f"kvserve:kv_tier_capacity_bytes|{tier}|"] == tiers[tier]["capacity_bytes"]
        assert samples[f"kvserve:kv_offload_bytes_total|{tier}|out"] == tiers[tier]["bytes_written"] > 0
        assert samples[f"kvserve:kv_tier_hit_tokens_total|{tier}|"] == tiers[tier]["hit_tokens"]
    assert samples["kvserve:kv_offload_decisions_total||load"] >= 1
    assert samples["kvserve:kv_tier_query_tokens_total||"] > 0
    scraped = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            scraped[s.name] = scraped.get(s.name, 0.0) + s.value
            if "tier" in s.labels:
                scraped[f"{s.name}|{s.labels['tier']}"] = scraped.get(f"{s.name}|{s.labels['tier']}", 0.0) + s.value
    rows = dict(tier_rows(scraped))
    assert set(rows) == {"KV tier host", "KV tier disk"} and "tokens loaded" in rows["KV tier disk"]
    render("http://x", scraped, {"gen": 0.0, "prompt": 0.0})


def test_other_requests_keep_stepping_while_a_prefix_loads(tiny_dir, tmp_path, monkeypatch):
    """A load runs on the tiers' worker: a streaming request gets its tokens while another request's
    prefix is read from a (deliberately slow) disk tier, and the loaded request's tokens are right."""
    from kvserve.kv.tiers import offload

    monkeypatch.setattr(offload, "MIN_PATIENCE_S", 60.0)  # the slowness is the test's: the load is not cut
    path = str(tiny_dir("llama"))
    prefix, other = random_prompts(2, 100, 100, seed=8)
    plain = LLM(path, dtype="float32", num_kv_blocks=64)
    expected = plain.generate([prefix], GREEDY, use_tqdm=False)[0].token_ids
    llm = tiered(path, tmp_path, "disk", num_kv_blocks=64, max_num_seqs=4, kv_offload_policy="write_through")
    llm.generate([prefix], GREEDY, use_tqdm=False)
    llm.engine.kv.offloader.drain()
    llm.reset_prefix_cache()
    disk = llm.engine.kv.offloader.stores[0]
    read = disk.get

    def slow_get(key):
        time.sleep(0.2)  # seven blocks: 1.4 s, many decode steps of the tiny model even on a loaded machine
        return read(key)

    disk.get = slow_get
    engine = llm.engine
    streaming = engine.add_request(other, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), stream=True)
    loaded = engine.add_request(prefix, GREEDY)
    tokens_during_load = 0
    while engine.has_unfinished_requests():
        loading = loaded.request_id in engine.scheduler.loading
        for out in engine.step():
            if out.request_id == streaming.request_id and loading:
                tokens_during_load += len(out.token_ids)
    assert tokens_during_load >= 5
    assert loaded.num_cached_tokens >= 96 and list(loaded.output_token_ids) == list(expected)


def test_damaged_host_records_are_misses_with_the_right_tokens(tiny_dir, tmp_path):
    path = str(tiny_dir("llama"))
    prompts = random_prompts(4, 90, 120, seed=9)
    plain = LLM(path, dtype="float32", num_kv_blocks=64)
    expected = [trace(o) for o in one_by_one(plain, prompts, GREEDY)]
    llm = tiered(path, tmp_path, "host", num_kv_blocks=64, kv_offload_policy="write_through")
    one_by_one(llm, prompts, GREEDY)
    llm.reset_prefix_cache()
    host = llm.engine.kv.offloader.stores[0]
    for i, key in enumerate(list(host._records)):
        data = host._records[key]
        host._records[key] = [data[: len(data) // 2], data[:-1] + bytes([data[-1] ^ 1]), b""][i % 3]  # truncated, damaged, empty
    assert [trace(o) for o in one_by_one(llm, prompts, GREEDY)] == expected
    assert llm.stats()["kv_tiers"]["host"]["corrupt_records"] >= 1


def test_computed_blocks_wait_for_a_slow_writer_and_evicted_ones_are_dropped(monkeypatch):
    """Write-through (and the shared tier) exists to keep computed blocks: past the pending limit the
    step waits for the writer; an eviction burst drops the block instead (counted)."""
    from kvserve.kv.tiers import offload

    class SlowStore(HostStore):
        def put(self, key, record):
            time.sleep(0.01)
            return super().put(key, record)

    monkeypatch.setattr(offload, "MAX_PENDING_BYTES", 3000)
    store = SlowStore(1 << 22)
    offloader = offload.KVOffloader([store], IDENTITY, lambda block_id: bytes(1000), lambda block_id, data: None, "write_through")
    records = [a_record(i)[1] for i in range(20)]
    for i, record in enumerate(records[:10]):
        offloader.offload(i, record.block_hash, 0, record.token_ids, published=True)
    offloader.drain()
    assert store.usage().entries == 10 and offloader.dropped_blocks == 0 and offloader.waits_for_writer > 0
    back = offload.KVOffloader([store], IDENTITY, lambda block_id: bytes(1000), lambda block_id, data: None, "write_back")
    for i, record in enumerate(records[10:]):
        back.offload(i, record.block_hash, 0, record.token_ids)
    back.drain()
    assert back.dropped_blocks > 0 and store.usage().entries == 20 - back.dropped_blocks


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_tier_is_credited_only_with_the_prompt_tokens_requests_take(tiny_dir, tmp_path, family):
    """Loads cut past their patience: on Gemma 3 a cut publishes full-attention blocks whose sliding
    window was never read, which no hit can use; the tier's hit_tokens count only what the requests
    took (their cached tokens, every one from the tier here), not what the loads published."""
    path = str(tiny_dir(family))
    prompts = random_prompts(4, 100, 120, seed=7)
    llm = tiered(path, tmp_path, "disk", kv_offload_policy="write_through")
    one_by_one(llm, prompts, GREEDY)
    offloader = llm.engine.kv.offloader
    counters = offloader.counters["disk"]
    counters.loads, counters.latency, counters.bandwidth = 10, 1e-4, 1e10
    store = offloader.stores[0]
    slow_get = store.get
    store.get = lambda key: (time.sleep(0.03), slow_get(key))[1]
    llm.reset_prefix_cache()
    outs = one_by_one(llm, prompts, GREEDY)
    assert offloader.loads_cut >= 1
    assert counters.hit_tokens == sum(o.num_cached_tokens for o in outs)
    if family == "llama":
        assert counters.hit_tokens > 0


def test_a_load_past_its_patience_is_cut_and_the_request_takes_a_partial_hit(tiny_dir, tmp_path):
    """A tier that reads far slower than measured: the load is cut after 3x its estimate, the request
    takes the blocks loaded so far (a partial hit, counted) and recomputes the rest, same tokens.
    (A disk tier: a short load from the host tier is read on the step loop at once, never cut.)"""
    path = str(tiny_dir("llama"))
    prompts = random_prompts(4, 100, 120, seed=7)
    plain = LLM(path, dtype="float32", num_kv_blocks=24, max_num_seqs=2)
    expected = [trace(o) for o in one_by_one(plain, prompts, GREEDY)]
    llm = tiered(path, tmp_path, "disk", kv_offload_policy="write_through")
    assert [trace(o) for o in one_by_one(llm, prompts, GREEDY)] == expected
    offloader = llm.engine.kv.offloader
    offloader.drain()
    store = offloader.stores[0]
    counters = offloader.counters["disk"]
    counters.loads, counters.latency, counters.bandwidth = 10, 1e-4, 1e10  # measured fast: a few hundred microseconds expected
    slow_get = store.get
    store.get = lambda key: (time.sleep(0.03), slow_get(key))[1]  # 30 ms a record: far past 3x the estimate
    llm.reset_prefix_cache()
    outs = one_by_one(llm, prompts, GREEDY)
    assert [trace(o) for o in outs] == expected
    assert offloader.loads_cut >= 1
    assert all(0 < o.num_cached_tokens < len(p) - 16 for o, p in zip(outs, prompts))  # partial: some blocks, not all
