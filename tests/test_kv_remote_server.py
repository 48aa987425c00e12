"""Server processes sharing one real redis-server: a second server reuses what the first computed,
salts stay apart, and `kvserve pd-proxy` in front of a producer and a consumer answers as one
instance does, streamed or not, with the hand-over in the consumer's cached tokens."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from conftest import random_prompts
from redis_server import RedisServer
from server_process import launch_server, server_log, stop_server

BLOCK = 16
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def start(model_dir, *extra: str):
    # a generous deadline for Redis calls: a busy machine can hold one past the default 200 ms, and the tier would then
    # be down for a second and the hand-over a recompute (the deadline itself is tests/test_kv_remote.py's)
    return launch_server(["--model", str(model_dir), "--port", "0", "--dtype", "float32", "--kv-cache-memory", "0.05",
                          "--max-model-len", "512", "--chat-template", CHAT_TEMPLATE, "--served-model-name", "m",
                          "--kv-remote-timeout-ms", "10000", *extra])  # fmt: skip


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    proc, url = start(model_dir)
    yield url
    stop_server(proc)


def complete(url: str, prompt, **fields) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0} | fields
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(url: str, path: str, body: dict) -> tuple[str, dict]:
    """The text of a streamed answer and its usage (stream_options.include_usage)."""
    text, usage = [], None
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text), usage


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def loaded(url: str, tokens: int, at_least: int) -> bool:
    """The request's prefix came from the remote tier (at least `at_least` cached tokens), or the load was cut for
    time, the designed fallback when the tiers' low-priority worker is starved (a machine busy on every core):
    the request then recomputed, with the same tokens, which the caller checks."""
    if tokens >= at_least:
        return True
    text = httpx.get(url + "/metrics", timeout=30).text
    return any(line.startswith("kvserve:kv_offload_loads_cut_total") and float(line.rsplit(" ", 1)[1]) > 0 for line in text.splitlines())


def stored(redis_server, records: int, deadline_s: float = 120.0) -> None:
    """Wait until the shared tier holds `records` records: an engine stores what it computed off its step loop (at a
    lower priority), so an answer can come back before its last blocks reach Redis."""
    client = redis_server.client()
    deadline = time.monotonic() + deadline_s
    while client.dbsize() < records:
        assert time.monotonic() < deadline, f"Redis holds {client.dbsize()} records, not the {records} written"
        time.sleep(0.05)


def test_a_second_server_reuses_the_first_servers_prefix_and_salts_stay_apart(model_dir, redis_server, reference):
    redis_server.client().flushdb()
    first, first_url = start(model_dir, "--kv-remote-url", redis_server.url)
    second, second_url = start(model_dir, "--kv-remote-url", redis_server.url)
    try:
        prompt, salted = random_prompts(2, 300, 300, seed=21)
        want = complete(reference, prompt)["choices"][0]["text"]
        assert complete(first_url, prompt)["choices"][0]["text"] == want
        assert cached(complete(first_url, salted, cache_salt="tenant-a")) == 0
        stored(redis_server, 2 * (300 // BLOCK))  # both prompts' whole blocks (the tiny llama has one KV group)
        again = complete(second_url, prompt)
        assert again["choices"][0]["text"] == want and loaded(second_url, cached(again), 300 - 2 * BLOCK)
        assert cached(complete(second_url, salted, cache_salt="tenant-b")) == 0  # another tenant's blocks are not its
        assert loaded(second_url, cached(complete(second_url, salted, cache_salt="tenant-a")), 300 - 2 * BLOCK)
        metrics = httpx.get(second_url + "/metrics").text
        assert 'kvserve:kv_remote_up{model_name=' in metrics and "} 1.0" in metrics.split("kvserve:kv_remote_up{")[1][:200]
        assert 'kvserve:kv_tier_hit_tokens_total{model_name="' in metrics and 'tier="remote"' in metrics
        assert "KV tiers: remote redis://:***@" in server_log(second) and redis_server.password not in server_log(second)
    finally:
        stop_server(first)
        stop_server(second)


@pytest.fixture(scope="module")
def pd(model_dir, redis_server):
    producer, producer_url = start(model_dir, "--kv-remote-url", redis_server.url, "--kv-role", "producer")
    consumer, consumer_url = start(model_dir, "--kv-remote-url", redis_server.url, "--kv-role", "consumer")
    proxy, proxy_url = launch_server(["--prefill", producer_url, "--decode", consumer_url, "--port", "0", "--prefill-timeout", "300"],
                                     subcommand="pd-proxy")  # fmt: skip
    yield proxy_url, producer_url, consumer_url
    for proc in (proxy, producer, consumer):
        stop_server(proc)


def test_pd_proxy_answers_as_one_instance_with_the_prompt_handed_over(pd, reference):
    proxy_url, producer_url, consumer_url = pd
    prompts = random_prompts(3, 200, 260, seed=22)
    answer = complete(proxy_url, prompts[0])
    assert answer["choices"][0]["text"] == complete(reference, prompts[0])["choices"][0]["text"]
    assert loaded(consumer_url, cached(answer), (len(prompts[0]) - 1) // BLOCK * BLOCK)  # every reusable full block
    body = {"model": "m", "prompt": prompts[1], "max_tokens": 12, "temperature": 0}
    text, usage = streamed(proxy_url, "/v1/completions", body)
    assert text == streamed(reference, "/v1/completions", body)[0]
    assert loaded(consumer_url, usage["prompt_tokens_details"]["cached_tokens"], (len(prompts[1]) - 1) // BLOCK * BLOCK)
    chat = {"model": "m", "messages": [{"role": "user", "content": "a long question " * 40}], "max_tokens": 12, "temperature": 0}
    response = httpx.post(proxy_url + "/v1/chat/completions", json=chat, timeout=120).json()
    want = httpx.post(reference + "/v1/chat/completions", json=chat, timeout=120).json()
    assert response["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert loaded(consumer_url, cached(response), response["usage"]["prompt_tokens"] - 2 * BLOCK)
    seeded = chat | {"temperature": 0.9, "seed": 5, "messages": [{"role": "user", "content": "another question " * 30}]}
    assert streamed(proxy_url, "/v1/chat/completions", seeded)[0] == streamed(reference, "/v1/chat/completions", seeded)[0]
    stats = httpx.get(proxy_url + "/pd/stats").json()
    assert stats == {"prefilled": 4, "prefill_failed": 0, "prefill_skipped": 0}
    producer_metrics = httpx.get(producer_url + "/metrics").text
    assert "kvserve:kv_handovers_published_total" in producer_metrics


def test_pd_proxy_refuses_bad_input_and_survives_a_dead_producer(pd, model_dir, redis_server, reference):
    proxy_url, _, consumer_url = pd
    assert httpx.post(proxy_url + "/v1/completions", content=b"{not json", timeout=30).status_code == 400
    assert httpx.post(proxy_url + "/v1/completions", json=[1, 2], timeout=30).status_code == 400
    nan = httpx.post(proxy_url + "/v1/completions", content=b'{"model": "m", "prompt": "x", "temperature": NaN}', timeout=30)
    assert nan.status_code == 400 and "NaN" in nan.text
    bad = httpx.post(proxy_url + "/v1/completions", json={"model": "m", "prompt": "x", "temperature": -3}, timeout=30)
    assert bad.status_code == 400 and "temperature" in bad.text  # the producer's verdict, relayed
    assert httpx.get(proxy_url + "/v1/models", timeout=30).status_code == 200
    proxy, dead_url = launch_server(["--prefill", "http://127.0.0.1:9", "--decode", consumer_url, "--port", "0"], subcommand="pd-proxy",
                                    health=False)  # fmt: skip
    try:
        prompt = random_prompts(1, 100, 100, seed=23)[0]
        assert complete(dead_url, prompt)["choices"][0]["text"] == complete(reference, prompt)["choices"][0]["text"]
        assert httpx.get(dead_url + "/pd/stats").json()["prefill_failed"] == 1
        health = httpx.get(dead_url + "/health")  # requests succeed without the producer: the proxy stays in service
        assert health.status_code == 200 and health.json() == {"prefill": "unreachable", "decode": "ok"}
        nested = httpx.post(dead_url + "/v1/completions", content=b"[" * 100000 + b"]" * 100000, timeout=30)
        assert nested.status_code == 400
        host, port = dead_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:  # declares 1 GB, sends 2 bytes
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 999999999\r\n\r\n{}")
            assert conn.recv(100).startswith(b"HTTP/1.1 413")
        assert "Traceback" not in server_log(proxy)
    finally:
        stop_server(proxy)


def metric(url: str, prefix: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def running(url: str) -> float:
    return metric(url, "kvserve:num_requests_running{")


def test_pd_proxy_skips_a_hung_producer_and_aborts_what_its_clients_leave(pd, reference):
    """Found by QA: a producer that accepted and never answered held every request for --timeout (600 s), and a
    non-streamed request whose client left decoded to its end."""
    proxy_url, _, consumer_url = pd
    with socket.socket() as hung:  # accepts connections, answers nothing
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        proxy, url = launch_server(["--prefill", f"http://127.0.0.1:{hung.getsockname()[1]}", "--decode", consumer_url, "--port", "0",
                                    "--prefill-timeout", "1"], subcommand="pd-proxy", health=False)  # fmt: skip
        try:
            prompts = random_prompts(3, 60, 80, seed=24)
            for prompt in prompts:
                assert complete(url, prompt)["choices"][0]["text"] == complete(reference, prompt)["choices"][0]["text"]
            stats = httpx.get(url + "/pd/stats").json()
            assert stats["prefill_failed"] == 1 and stats["prefill_skipped"] == 2, stats  # the first waited 1 s, the rest none
        finally:
            stop_server(proxy)
    aborted = 'kvserve:request_aborted_total{model_name="m",reason="client_disconnected"}'
    before = metric(consumer_url, aborted)
    body = json.dumps({"model": "m", "prompt": random_prompts(1, 60, 60, seed=25)[0], "max_tokens": 450, "n": 16, "ignore_eos": True})
    host, port = proxy_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:  # not streamed; the client leaves once decoding runs
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())  # fmt: skip
        deadline = time.monotonic() + 30
        while not running(consumer_url) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert running(consumer_url), "the consumer decodes the request"
    deadline = time.monotonic() + 20
    while running(consumer_url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running(consumer_url) == 0 and metric(consumer_url, aborted) == before + 1  # aborted, not decoded to its end
    assert httpx.get(proxy_url + "/pd/stats").json()["prefill_failed"] == 0


def test_the_hostile_corpus_through_the_pd_proxy_is_never_a_5xx(pd):
    from hostile_bodies import try_every_shape

    proxy_url, _, _ = pd
    statuses = try_every_shape(proxy_url)
    assert all(400 <= s < 500 for s in statuses), statuses
