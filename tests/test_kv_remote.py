"""The shared remote KV tier (kv/tiers/remote.py) against a real redis-server: engines reuse each
other's prefixes with the same tokens, salts and identities stay apart, damaged records are misses,
an outage degrades to recompute and heals itself, and --kv-role hands prompts over."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from conftest import random_prompts
from redis_server import RedisServer, free_port
from kvserve import LLM, SamplingParams
from kvserve.kv.tiers.remote import KEY_PREFIX, RemoteStore, masked_url

GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=11, logprobs=2)


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


def trace(output) -> tuple:
    return tuple(output.token_ids), tuple((lp.token_id, lp.logprob) for lp in output.logprobs or ())


def run(llm: LLM, prompts, params, **kwargs) -> list:
    outs = [llm.generate([p], params, use_tqdm=False, **kwargs)[0] for p in prompts]
    if llm.engine.kv.offloader is not None:
        llm.engine.kv.offloader.drain()
    return outs


def remote(path: str, url: str, **settings) -> LLM:
    llm = LLM(path, **({"dtype": "float32", "num_kv_blocks": 24, "max_num_seqs": 2, "kv_remote_url": url} | settings))
    # a tiny model recomputes faster than any tier reads: pin the prefill rate low so loads win (the
    # decision is test_kv_tiers.py's test_loading_is_chosen_only_where_it_beats_recompute)
    llm.engine.kv.offloader.prefill_rate = 1.0
    llm.engine.kv.offloader.observe_prefill = lambda tokens, seconds: None
    return llm


def top_rows(llm: LLM) -> dict[str, str]:
    """`kvserve top`'s tier rows for the engine's metrics, as a scrape of /metrics gives them."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.server.metrics import ServerMetrics
    from kvserve.server.top import tier_rows

    metrics = ServerMetrics("tiny")
    metrics.update_from_stats(llm.stats())
    scraped: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            scraped[sample.name] = scraped.get(sample.name, 0.0) + sample.value
            if "tier" in sample.labels:
                key = f"{sample.name}|{sample.labels['tier']}"
                scraped[key] = scraped.get(key, 0.0) + sample.value
    return dict(tier_rows(scraped))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_second_engine_reuses_what_the_first_computed_with_the_same_tokens(tiny_dir, redis_server, family):
    path = str(tiny_dir(family))
    prompts = random_prompts(4, 90, 120, seed=5)
    plain = LLM(path, dtype="float32", num_kv_blocks=24, max_num_seqs=2)
    first = remote(path, redis_server.url)
    for params in (GREEDY, SEEDED):
        expected = [trace(o) for o in run(plain, prompts, params)]
        assert [trace(o) for o in run(first, prompts, params)] == expected
    assert redis_server.client().dbsize() >= 4 * 5
    second = remote(path, redis_server.url)
    for params in (GREEDY, SEEDED):
        expected = [trace(o) for o in run(plain, prompts, params)]
        outs = run(second, prompts, params)
        assert [trace(o) for o in outs] == expected
        assert all(o.num_cached_tokens >= (len(p) - 1) // 16 * 16 - 16 for o, p in zip(outs, prompts))
    tier = second.stats()["kv_tiers"]["remote"]
    assert tier["hit_tokens"] >= 4 * 80 and tier["requests_served"] >= 4 and tier["bytes_read"] > 0 and tier["up"]
    salted = run(remote(path, redis_server.url), prompts, GREEDY, cache_salt="tenant-b")
    assert all(o.num_cached_tokens == 0 for o in salted)
    assert [trace(o) for o in salted] == [trace(o) for o in run(plain, prompts, GREEDY)]
    other = remote(path, redis_server.url, kv_cache_dtype="int8")  # another cache identity: nothing to read
    assert all(o.num_cached_tokens == 0 for o in run(other, prompts, GREEDY))


def test_int4_blocks_computed_by_one_engine_serve_another_as_its_own_pool_would(tiny_dir, redis_server):
    """int4 (KIVI) blocks are published once quantized, and the sink block as it is: a second engine
    reading them from the shared tier gives the tokens a hit on the same blocks in one pool gives."""
    path = str(tiny_dir("qwen3"))
    prompts = random_prompts(4, 150, 200, seed=8)
    kivi = dict(kv_cache_dtype="int4", kv_quant_residual=32, max_num_seqs=2)
    roomy = LLM(path, dtype="float32", num_kv_blocks=2000, **kivi)
    units = 8 * roomy.engine.kv_spec.residual_units
    first = remote(path, redis_server.url, num_kv_blocks=units, **kivi)
    for params in (GREEDY, SEEDED):
        assert [trace(o) for o in run(first, prompts, params)] == [trace(o) for o in run(roomy, prompts, params)]
    second = remote(path, redis_server.url, num_kv_blocks=units, **kivi)
    for params in (GREEDY, SEEDED):
        hits = run(roomy, prompts, params)
        outs = run(second, prompts, params)
        assert [trace(o) for o in outs] == [trace(o) for o in hits]
        assert [o.num_cached_tokens for o in outs] == [o.num_cached_tokens for o in hits] and all(o.num_cached_tokens >= 96 for o in outs)
    assert second.stats()["kv_tiers"]["remote"]["hit_tokens"] >= 4 * 96


def test_entries_have_the_ttl_and_hold_no_prompt_text(tiny_dir, redis_server):
    path = str(tiny_dir("llama"))
    llm = remote(path, redis_server.url, kv_remote_ttl=120)
    run(llm, random_prompts(1, 100, 100, seed=6), GREEDY)
    client = redis_server.client()
    keys = client.keys("*")
    assert keys and all(k.startswith(KEY_PREFIX.encode()) for k in keys)
    assert all(0 < client.ttl(k) <= 120 for k in keys)


def test_damaged_truncated_and_foreign_records_are_misses_with_the_right_tokens(tiny_dir, redis_server):
    path = str(tiny_dir("llama"))
    prompts = random_prompts(3, 90, 120, seed=7)
    first = remote(path, redis_server.url)
    expected = [trace(o) for o in run(first, prompts, GREEDY)]
    client = redis_server.client()
    keys = sorted(client.keys("*"))
    assert len(keys) >= 15
    for i, key in enumerate(keys):
        data = client.get(key)
        if i % 3 == 0:
            client.set(key, data[:-1] + bytes([data[-1] ^ 1]))  # damaged
        elif i % 3 == 1:
            client.set(key, data[: len(data) // 2])  # truncated
        else:
            client.set(key, client.get(keys[(i + 1) % len(keys)]))  # another block's record under this key
    second = remote(path, redis_server.url)
    assert [trace(o) for o in run(second, prompts, GREEDY)] == expected
    tier = second.stats()["kv_tiers"]["remote"]
    assert tier["corrupt_records"] >= 1 and tier["hit_tokens"] == 0
    third = remote(path, redis_server.url)  # the recomputed blocks replaced every damaged copy behind the first found
    outs = run(third, prompts, GREEDY)
    assert [trace(o) for o in outs] == expected and all(o.num_cached_tokens >= 80 for o in outs)
    assert third.stats()["kv_tiers"]["remote"]["corrupt_records"] == 0


def test_an_outage_degrades_to_recompute_once_logged_and_heals_itself(tiny_dir, redis_server, caplog):
    path = str(tiny_dir("llama"))
    prompts = random_prompts(4, 90, 120, seed=8)
    plain = LLM(path, dtype="float32", num_kv_blocks=24, max_num_seqs=2)
    expected = [trace(o) for o in run(plain, prompts, GREEDY)]
    llm = remote(path, redis_server.url)
    assert [trace(o) for o in run(llm, prompts[:2], GREEDY)] == expected[:2]
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.tiers.remote"):
        started = time.monotonic()
        assert [trace(o) for o in run(llm, prompts[2:], GREEDY)] == expected[2:]
        assert [trace(o) for o in run(llm, prompts, GREEDY)] == expected
        assert time.monotonic() - started < 30
    tier = llm.stats()["kv_tiers"]["remote"]
    assert not tier["up"] and tier["outages"] == 1
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1  # one line per outage, not per request
    assert "DOWN" in top_rows(llm)["KV tier remote"]
    redis_server.start()  # empty again, same port and password
    deadline = time.monotonic() + 10
    while not llm.stats()["kv_tiers"]["remote"]["up"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert llm.stats()["kv_tiers"]["remote"]["up"]
    assert "DOWN" not in top_rows(llm)["KV tier remote"]
    fresh = random_prompts(2, 90, 120, seed=18)
    run(llm, fresh, GREEDY)  # new blocks are written again
    assert redis_server.client().dbsize() > 0
    outs = run(remote(path, redis_server.url), fresh, GREEDY)
    assert [trace(o) for o in outs] == [trace(o) for o in run(plain, fresh, GREEDY)] and all(o.num_cached_tokens >= 64 for o in outs)


def test_a_bad_url_or_password_is_one_error_naming_the_flag(redis_server):
    wrong = redis_server.url.replace(redis_server.password, "not-the-password")
    query = f"redis://127.0.0.1:{redis_server.port}/0?password=not-the-password"
    for url in (wrong, f"redis://127.0.0.1:{free_port()}/0", query, "redis://:not-the-password@127.0.0.1:99999/0"):
        with pytest.raises(ValueError, match="--kv-remote-url") as error:
            RemoteStore(url, timeout_ms=200)
        assert "not-the-password" not in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match="--kv-remote-url"):
        RemoteStore("http://127.0.0.1:1/")
    assert masked_url("redis://") == "redis://" and masked_url("redis:///0") == "redis:///0"  # (QA: printed as "redis::")
    with pytest.raises(ValueError, match="--kv-remote-ca-file /nonexistent.pem: No such file"):
        RemoteStore("rediss://127.0.0.1:1/0", ca_file="/nonexistent.pem")


@pytest.mark.parametrize("settings, message", [
    (dict(kv_remote_url="http://x"), "--kv-remote-url"),
    (dict(kv_role="producer"), "--kv-remote-url"),
    (dict(kv_role="decoder"), "--kv-role"),
    (dict(kv_remote_url="redis://127.0.0.1:1/0", kv_remote_timeout_ms=0), "--kv-remote-timeout-ms"),
    (dict(kv_remote_url="redis://127.0.0.1:1/0", kv_remote_ttl=-1), "--kv-remote-ttl"),
    (dict(kv_remote_url="redis://127.0.0.1:1/0", kv_remote_ca_file="/x.pem"), "rediss"),
    (dict(kv_remote_url="redis://127.0.0.1:1/0", enable_prefix_caching=False), "prefix caching"),
])  # fmt: skip
def test_bad_remote_settings_are_refused_by_name(tiny_dir, settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_dir("llama")), dtype="float32", num_kv_blocks=24, **settings)


def test_a_producer_answers_once_its_blocks_are_stored_and_a_consumer_never_writes(tiny_dir, redis_server):
    path = str(tiny_dir("llama"))
    prompts = random_prompts(3, 90, 120, seed=9)
    plain = LLM(path, dtype="float32", num_kv_blocks=24, max_num_seqs=2)
    expected = [trace(o) for o in run(plain, prompts, GREEDY)]
    producer = remote(path, redis_server.url, kv_role="producer")
    consumer = remote(path, redis_server.url, kv_role="consumer")
    for prompt, want in zip(prompts, expected):
        producer.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)  # no drain: answered once stored
        out = consumer.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert trace(out) == want
        assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16  # every full block of the prompt that can be reused
    assert producer.stats()["kv_handovers_published_total"] == 3
    assert consumer.stats()["kv_tiers"]["remote"]["requests_served"] == 3
    keys = redis_server.client().dbsize()
    run(consumer, random_prompts(2, 90, 120, seed=10), GREEDY)
    assert redis_server.client().dbsize() == keys  # the consumer wrote nothing


def test_a_stalled_server_costs_one_deadline_then_requests_recompute(tiny_dir, redis_server):
    """Redis slow rather than gone (the process stopped): a call runs into --kv-remote-timeout-ms once,
    the tier is marked down, later requests do not wait on it, and it comes back when Redis does."""
    path = str(tiny_dir("llama"))
    prompts = random_prompts(4, 90, 120, seed=12)
    plain = LLM(path, dtype="float32", num_kv_blocks=24, max_num_seqs=2)
    expected = [trace(o) for o in run(plain, prompts, GREEDY)]
    llm = remote(path, redis_server.url, kv_remote_timeout_ms=100)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert [trace(o) for o in run(llm, prompts, GREEDY)] == expected
        assert time.monotonic() - started < 5
        tier = llm.stats()["kv_tiers"]["remote"]
        assert tier["timeouts"] == 1 and tier["outages"] == 1 and not tier["up"]
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not llm.stats()["kv_tiers"]["remote"]["up"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert llm.stats()["kv_tiers"]["remote"]["up"]


def test_a_tls_server_is_reached_with_its_ca_and_refused_without(tiny_dir):
    """rediss:// with --kv-remote-ca-file (a throwaway CA made by openssl): the engines share a prefix;
    without the CA the certificate fails verification, a one-line error naming the flag."""
    path = str(tiny_dir("llama"))
    prompts = random_prompts(2, 90, 120, seed=13)
    with RedisServer(tls=True) as server:
        first = remote(path, server.url, kv_remote_ca_file=server.ca_file)
        expected = [trace(o) for o in run(first, prompts, GREEDY)]
        second = remote(path, server.url, kv_remote_ca_file=server.ca_file)
        outs = run(second, prompts, GREEDY)
        assert [trace(o) for o in outs] == expected and all(o.num_cached_tokens >= 80 for o in outs)
        with pytest.raises(ValueError, match="--kv-remote-url rediss://:\\*\\*\\*@.*CERTIFICATE_VERIFY_FAILED") as error:
            RemoteStore(server.url)
        assert server.password not in str(error.value)
