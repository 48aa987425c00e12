"""Live migration between server processes (server/migration.py): a streaming request, greedy and
seeded, moved after 20 tokens gives its client the text of an unmigrated run; so does a non-streamed
one; the target counts the migration; a dead target leaves the request finishing at the source;
refusals are clear. The servers run tests/fault_serve.py, whose SLOW token makes every step of a
request take 50 ms, so there is time to move it."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import random_prompts
from redis_server import free_port
from server_process import launch_server, server_log, stop_server

FAULT_SERVE = [sys.executable, str(Path(__file__).parent / "fault_serve.py")]
SLOW = 479  # tests/fault_serve.py
KEY = "a-shared-migration-secret"


def start(model_dir, *extra: str):
    return launch_server(["--model", str(model_dir), "--port", "0", "--dtype", "float32", "--kv-cache-memory", "0.05",
                          "--max-model-len", "512", "--served-model-name", "m", *extra], command=FAULT_SERVE)  # fmt: skip


@pytest.fixture(scope="module")
def servers(tiny_dir):
    model_dir = tiny_dir("llama")
    dead = f"http://127.0.0.1:{free_port()}"
    reference, reference_url = start(model_dir)
    target, target_url = start(model_dir, "--migration-key", KEY)
    source, source_url = start(model_dir, "--migration-targets", f"{target_url},{dead}", "--migration-key", KEY)
    yield {"reference": reference_url, "target": target_url, "source": source_url, "dead": dead, "source_proc": source}
    for proc in (reference, target, source):
        stop_server(proc)


def a_prompt(seed: int) -> list[int]:
    prompt = random_prompts(1, 60, 60, seed=seed)[0]
    prompt[3] = SLOW
    return prompt


def body(prompt, **fields) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 60, "ignore_eos": True, "logprobs": 1} | fields


def stream_text(url: str, payload: dict, request_id: str, migrate_to: str | None = None, after: int = 20) -> tuple[str, list, dict | None]:
    """The streamed text and token logprobs; with migrate_to, POST /v1/kv/migrate once `after` tokens arrived."""
    text, logprobs, answer = [], [], None
    with httpx.stream("POST", url + "/v1/completions", json=payload | {"stream": True}, headers={"x-request-id": request_id},
                      timeout=120) as response:  # fmt: skip
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text.append(choice["text"])
                logprobs += (choice["logprobs"] or {}).get("token_logprobs", [])
            if migrate_to is not None and answer is None and len(logprobs) >= after:
                answer = httpx.post(url + "/v1/kv/migrate", json={"request_id": chunk["id"], "target": migrate_to}, timeout=60)
    return "".join(text), logprobs, answer


def metric(url: str, name: str, event: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and f'event="{event}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def counter(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 17}], ids=["greedy", "seeded"])
def test_a_streaming_request_migrated_after_20_tokens_reads_as_if_it_never_moved(servers, sampling):
    payload = body(a_prompt(40), **sampling)
    want_text, want_logprobs, _ = stream_text(servers["reference"], payload, "ref")
    before = metric(servers["target"], "kvserve:kv_migrations_total", "in")
    text, logprobs, answer = stream_text(servers["source"], payload, f"mig-{sampling['temperature']}", servers["target"])
    assert answer is not None and answer.status_code == 200, answer.text
    assert answer.json()["migrated_samples"] == 1
    assert text == want_text and logprobs == want_logprobs and len(logprobs) == 60
    assert metric(servers["target"], "kvserve:kv_migrations_total", "in") == before + 1
    assert metric(servers["source"], "kvserve:kv_migrations_total", "out") >= 1


def test_a_non_streamed_request_migrates_too(servers):
    payload = body(a_prompt(41), temperature=0.7, seed=3)
    want = httpx.post(servers["reference"] + "/v1/completions", json=payload, timeout=120).json()["choices"][0]
    result = {}

    def client():
        result["answer"] = httpx.post(servers["source"] + "/v1/completions", json=payload, headers={"x-request-id": "mig-plain"},
                                      timeout=120).json()  # fmt: skip

    generated = counter(servers["source"], "kvserve:generation_tokens_total")
    thread = threading.Thread(target=client)
    thread.start()
    deadline = time.monotonic() + 60
    while counter(servers["source"], "kvserve:generation_tokens_total") < generated + 20:  # decoding, well before its 60 tokens
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    moved = httpx.post(servers["source"] + "/v1/kv/migrate", json={"request_id": "mig-plain", "target": servers["target"]}, timeout=60)
    thread.join(timeout=120)
    assert moved.status_code == 200, moved.text
    got = result["answer"]["choices"][0]
    assert got["text"] == want["text"] and got["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
    assert result["answer"]["usage"]["completion_tokens"] == 60


def test_a_dead_target_leaves_the_request_finishing_at_the_source(servers):
    payload = body(a_prompt(42), temperature=0)
    want_text, want_logprobs, _ = stream_text(servers["reference"], payload, "ref-dead")
    failed = metric(servers["source"], "kvserve:kv_migrations_total", "failed")
    text, logprobs, answer = stream_text(servers["source"], payload, "mig-dead", servers["dead"])
    assert answer.status_code == 502 and "goes on here" in answer.json()["error"]["message"]
    assert text == want_text and logprobs == want_logprobs
    assert metric(servers["source"], "kvserve:kv_migrations_total", "failed") == failed + 1


def test_migration_refusals_are_clear(servers):
    source = servers["source"]
    assert httpx.post(source + "/v1/kv/migrate", json={"request_id": "nope", "target": servers["target"]}).status_code == 404
    refused = httpx.post(source + "/v1/kv/migrate", json={"request_id": "nope", "target": "http://169.254.169.254"})
    assert refused.status_code == 403 and "--migration-targets" in refused.text
    off = httpx.post(servers["reference"] + "/v1/kv/migrate", json={"request_id": "x", "target": servers["target"]})
    assert off.status_code == 403 and "migration is off" in off.text
    assert httpx.post(source + "/v1/kv/migrate", json={"request_id": 5, "target": "x"}).status_code == 400
    keyed = {"x-kvserve-migration-key": KEY}
    junk = httpx.post(servers["target"] + "/v1/kv/import", content=b"\x10\x00\x00\x00not json at all!", headers=keyed)
    assert junk.status_code == 400 and "migration state" in junk.text
    assert "Traceback" not in server_log(servers["source_proc"])


def test_only_a_server_with_the_migration_key_can_put_a_request_and_its_kv_into_another(servers):
    """/v1/kv/import would let a client plant K/V in the prefix cache: it takes the group's secret,
    not the API key; a server without --migration-key takes none; hostile states get a 400 early."""
    from kvserve.engine.migration import RequestState
    from kvserve.sampling_params import SamplingParams

    state = RequestState([5] * 40, [], SamplingParams(max_tokens=4), 0, 0).to_bytes()
    import_ = lambda url, headers, content=state: httpx.post(url + "/v1/kv/import", content=content, headers=headers, timeout=60)  # noqa: E731
    assert import_(servers["target"], {}).status_code == 403
    assert import_(servers["target"], {"x-kvserve-migration-key": KEY + "x"}).status_code == 403
    off = import_(servers["reference"], {"x-kvserve-migration-key": KEY})
    assert off.status_code == 403 and "--migration-key" in off.text
    keyed = {"x-kvserve-migration-key": KEY}
    foreign = import_(servers["target"], keyed)  # identity 0: another model
    assert foreign.status_code == 400 and "another model" in foreign.text
    empty_records = state + b"\x00\x00\x00\x00" * 1000
    assert import_(servers["target"], keyed, empty_records).status_code == 400
    for bad in (b'{"version": 1, "params": "x"}', b'{"version": 1, "prompt_token_ids": [1], "output_token_ids": [], "params": null}'):
        response = import_(servers["target"], keyed, len(bad).to_bytes(4, "little") + bad)
        assert response.status_code == 400 and "migration state" in response.text, response.text
    assert "Traceback" not in server_log(servers["source_proc"])
