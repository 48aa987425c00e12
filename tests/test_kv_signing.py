"""KV records that leave the process are signed (kv/tiers/signing.py): a record planted in the shared
Redis tier or the disk tier with a valid checksum but without the engines' secret is refused, in
the tiers, migration and prefill hand-overs, against a real redis-server."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from conftest import random_prompts
from redis_server import RedisServer
from kvserve import LLM, SamplingParams
from kvserve.engine.migration import RequestState
from kvserve.kv.hashing import root_hash
from kvserve.kv.tiers.record import _HEADER, BlockRecord, CorruptRecord, decode_record, encode_record, record_key
from kvserve.kv.tiers.remote import KEY_PREFIX
from kvserve.kv.tiers.signing import KEY_ENV, RecordSigner, load_signer

GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
BLOCK = 16


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def keys(tmp_path):
    paths = {}
    for name, secret in (("ours", "a shared secret of the engines, 32+ bytes"), ("theirs", "another secret entirely, 32+ bytes!")):
        paths[name] = tmp_path / f"{name}.key"
        paths[name].write_text(secret + "\n")
    return {name: str(path) for name, path in paths.items()}


def trace(output) -> tuple:
    return tuple(output.token_ids), tuple((lp.token_id, lp.logprob) for lp in output.logprobs or ())


def engine(path: str, **settings) -> LLM:
    llm = LLM(path, **({"dtype": "float32", "num_kv_blocks": 24, "max_num_seqs": 2} | settings))
    if llm.engine.kv.offloader is not None:  # a tiny model recomputes faster than a tier reads: make loads win
        llm.engine.kv.offloader.prefill_rate = 1.0
        llm.engine.kv.offloader.observe_prefill = lambda tokens, seconds: None
    return llm


def generate(llm: LLM, prompt) -> tuple:
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    if llm.engine.kv.offloader is not None:
        llm.engine.kv.offloader.drain()
    return trace(out), out.num_cached_tokens


def rejected(llm: LLM, tier: str) -> dict[str, int]:
    return llm.stats()["kv_tiers"][tier]["records_rejected"]


def test_records_round_trip_signed_and_every_forgery_is_refused():
    ours, theirs = RecordSigner(b"0123456789abcdef-ours"), RecordSigner(b"0123456789abcdef-theirs")
    record = BlockRecord(block_hash=7 << 100, group=0, token_ids=tuple(range(16)), payload=bytes(range(256)) * 4)
    key = record_key(record.block_hash, record.group)
    signed = encode_record(record, 5, ours)
    assert decode_record(signed, 5, key, ours) == record
    for data, signer, reason in [
        (signed, None, "bad_signature"),  # an engine without the secret cannot check it: no checksum to fall back on
        (encode_record(record, 5), ours, "unsigned"),  # a valid checksum is not enough
        (encode_record(record, 5, theirs), ours, "bad_signature"),
        (signed[:-1] + bytes([signed[-1] ^ 1]), ours, "bad_signature"),
        (signed[:100] + bytes([signed[100] ^ 1]) + signed[101:], ours, "bad_signature"),  # the MAC is the checksum
        (signed[:-1], ours, "damaged"),  # truncated
        (encode_record(record, 5)[:-1] + bytes([encode_record(record, 5)[-1] ^ 1]), None, "damaged"),
    ]:
        with pytest.raises(CorruptRecord) as refused:
            decode_record(data, 5, key, signer)
        assert refused.value.reason == reason
    with pytest.raises(CorruptRecord) as moved:  # the same signed bytes stored under another block's key
        decode_record(signed, 5, record_key(8 << 100, 0), ours)
    assert moved.value.reason == "bad_signature"


def test_the_secret_comes_from_a_file_or_the_environment_never_both(tmp_path, keys):
    assert load_signer(None, {}) is None
    assert load_signer(keys["ours"], {}) is not None and load_signer(None, {KEY_ENV: "x" * 32}) is not None
    short = tmp_path / "short.key"
    short.write_text("tooshort")
    for key_file, environ, message in [(keys["ours"], {KEY_ENV: "x" * 32}, "both"), (str(short), {}, "at least 16 bytes"),
                                       (str(tmp_path / "missing"), {}, "cannot read"), (None, {KEY_ENV: "short"}, KEY_ENV),
                                       (None, {KEY_ENV: ""}, "at least 16 bytes"), ("/dev/zero", {}, "not a regular file"),
                                       (str(tmp_path), {}, "not a regular file")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            load_signer(key_file, environ)
    assert "secret" not in repr(load_signer(keys["ours"], {})).replace("<secret>", "")


def read_unchecked(data: bytes, key: str) -> BlockRecord:
    """A signed record's block as anyone who can read the tier sees it: nothing in it is encrypted."""
    _, _, group, count, payload, _, block = _HEADER.unpack_from(data)
    tokens = np.frombuffer(data, dtype="<u4", count=count, offset=_HEADER.size)
    start = _HEADER.size + 4 * count
    return BlockRecord(int.from_bytes(block, "little"), group, tuple(tokens.tolist()), data[start : start + payload])


def plant(client, path: str, victim: list[int], donor: list[int], signer: RecordSigner | None) -> str:
    """Overwrite the victim prompt's first block in Redis with a record of the donor's K/V: a valid
    checksum, the right key and identity, what an attacker with write access to Redis can make."""
    llm = engine(path)
    identity = root_hash(llm.engine.cache_identity)
    records = {}
    for raw_key in client.keys(KEY_PREFIX + "*"):
        data = client.get(raw_key)
        record = read_unchecked(data, raw_key.decode().removeprefix(KEY_PREFIX))
        records[record.token_ids] = record
    target, donor_block = records[tuple(victim[:BLOCK])], records[tuple(donor[:BLOCK])]
    key = record_key(target.block_hash, target.group)
    forged = BlockRecord(target.block_hash, target.group, target.token_ids, donor_block.payload)
    client.set(KEY_PREFIX + key, encode_record(forged, identity, signer))
    return key


@pytest.mark.parametrize("forger", ["unsigned", "another key"])
def test_a_forged_record_in_redis_is_refused_by_every_engine_with_the_key(tiny_dir, redis_server, keys, forger, caplog):
    path = str(tiny_dir("llama"))
    redis_server.client().flushall()
    victim, donor = random_prompts(2, 90, 90, seed=61)
    cold = engine(path)
    want = generate(cold, victim)[0]
    writer = engine(path, kv_remote_url=redis_server.url, kv_remote_key_file=keys["ours"])
    generate(writer, victim)
    generate(writer, donor)
    plant(redis_server.client(), path, victim, donor, None if forger == "unsigned" else RecordSigner(b"another secret entirely!"))
    for _ in range(2):  # every replica that holds the key
        reader = engine(path, kv_remote_url=redis_server.url, kv_remote_key_file=keys["ours"])
        got, cached = generate(reader, victim)
        assert got == want and cached == 0  # the forgery ends the prefix at its first block: all recomputed
        assert rejected(reader, "remote")["unsigned" if forger == "unsigned" else "bad_signature"] == 1
        # the reader dropped the forgery and sent its own signed records; the forger plants again
        plant(redis_server.client(), path, victim, donor, None if forger == "unsigned" else RecordSigner(b"another secret entirely!"))
    # what the key prevents: an engine without one serves the forged K/V as the victim's prefix
    with caplog.at_level(logging.WARNING):
        keyless = engine(path, kv_remote_url=redis_server.url)
    assert "not authenticated" in caplog.text and "--kv-remote-key-file" in caplog.text
    got, cached = generate(keyless, victim)
    if forger == "unsigned":
        assert cached >= BLOCK and got != want
    else:  # a signed record carries no checksum for an engine without the key to fall back on
        assert cached == 0 and got == want and rejected(keyless, "remote")["bad_signature"] >= 1


def test_a_forged_record_in_the_disk_tier_is_refused(tiny_dir, tmp_path, keys):
    path = str(tiny_dir("llama"))
    victim, donor = random_prompts(2, 90, 90, seed=62)
    want = generate(engine(path), victim)[0]
    disk = dict(kv_offload_disk_dir=str(tmp_path / "disk"), kv_offload_disk_gib=0.05, kv_offload_policy="write_through")
    writer = engine(path, kv_remote_key_file=keys["ours"], **disk)
    generate(writer, victim)
    generate(writer, donor)
    store = writer.engine.kv.offloader.local[0]
    identity = root_hash(writer.engine.cache_identity)
    records = {}
    for path_ in (tmp_path / "disk").glob("*.kvb"):
        key = path_.name.removesuffix(".kvb")
        records[read_unchecked(path_.read_bytes(), key).token_ids] = (key, read_unchecked(path_.read_bytes(), key))
    key, target = records[tuple(victim[:BLOCK])]
    forged = BlockRecord(target.block_hash, target.group, target.token_ids, records[tuple(donor[:BLOCK])][1].payload)
    (tmp_path / "disk" / f"{key}.kvb").write_bytes(encode_record(forged, identity))
    assert store.contains(key)
    reader = engine(path, kv_remote_key_file=keys["ours"], **disk)
    got, cached = generate(reader, victim)
    assert got == want and cached == 0 and rejected(reader, "disk")["unsigned"] == 1


@pytest.mark.parametrize("target_key", ["ours", "theirs"])
def test_a_migrated_requests_records_are_checked_against_the_targets_key(tiny_dir, keys, target_key, caplog):
    path = str(tiny_dir("llama"))
    prompt = random_prompts(1, 70, 70, seed=63)[0]
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=2)
    want = trace(engine(path, num_kv_blocks=64).generate([prompt], params, use_tqdm=False)[0])
    source = engine(path, num_kv_blocks=64, kv_remote_key_file=keys["ours"])
    seq = source.engine.add_request(prompt, params)
    while seq.num_output_tokens < 20:
        source.engine.step()
    state = RequestState.from_bytes(source.export_request(seq.request_id).to_bytes())
    target = engine(path, num_kv_blocks=64, kv_remote_key_file=keys[target_key])
    with caplog.at_level(logging.WARNING):
        out = target.import_request(state)
    assert trace(out) == want  # the request runs on either way, with the same tokens
    migrations = target.stats()["kv_migrations_total"]
    if target_key == "ours":
        assert migrations["records_rejected"] == 0 and migrations["hit_tokens"] >= 80
    else:
        assert migrations["records_rejected"] == len(state.records) > 0 and migrations["hit_tokens"] == 0
        assert "do not share one --kv-remote-key-file" in caplog.text


@pytest.mark.parametrize("consumer_key", ["ours", "theirs"])
def test_prefill_hand_overs_need_the_same_key_on_both_sides(tiny_dir, redis_server, keys, consumer_key):
    path = str(tiny_dir("llama"))
    redis_server.client().flushall()
    prompt = random_prompts(1, 90, 90, seed=64)[0]
    want = generate(engine(path), prompt)[0]
    producer = engine(path, kv_remote_url=redis_server.url, kv_role="producer", kv_remote_key_file=keys["ours"])
    consumer = engine(path, kv_remote_url=redis_server.url, kv_role="consumer", kv_remote_key_file=keys[consumer_key])
    producer.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    got, cached = generate(consumer, prompt)
    assert got == want
    if consumer_key == "ours":
        assert cached >= 80
    else:
        assert cached == 0 and rejected(consumer, "remote")["bad_signature"] == 1


def test_the_host_tier_serves_its_own_signed_records_and_redis_junk_is_not_an_outage(tiny_dir, redis_server, keys):
    """A keyed engine signs every record it writes, host tier included; the host tier's records never
    left the process, so they are served without a check (not refused as unverifiable). A value of
    another Redis type under a record's key is a damaged record, deleted, not a tier outage."""
    path = str(tiny_dir("llama"))
    prompts = random_prompts(20, 40, 40, seed=63)  # 60 blocks through a 24-block pool
    want = generate(engine(path), prompts[0])[0]
    host = engine(path, kv_remote_key_file=keys["ours"], kv_offload_host_gib=0.01)
    for prompt in prompts:
        generate(host, prompt)
    got, cached = generate(host, prompts[0])
    assert got == want and cached >= 2 * BLOCK
    assert sum(rejected(host, "host").values()) == 0 and host.stats()["kv_tiers"]["host"]["hit_tokens"] >= 2 * BLOCK
    client = redis_server.client()
    client.flushall()
    writer = engine(path, kv_remote_url=redis_server.url, kv_remote_key_file=keys["ours"])
    generate(writer, prompts[1])
    generate(writer, prompts[2])
    victim = next(iter(client.keys(KEY_PREFIX + "*")))
    client.delete(victim)
    client.rpush(victim, b"not a record")
    reader = engine(path, kv_remote_url=redis_server.url, kv_remote_key_file=keys["ours"])
    for prompt in prompts[1:3]:
        generate(reader, prompt)
    tier = reader.stats()["kv_tiers"]["remote"]
    assert tier["records_rejected"]["damaged"] == 1 and tier.get("outages", 0) == 0
    assert client.type(victim) != b"list"  # deleted (or stored again), not left to fail the next read
