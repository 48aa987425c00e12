"""Hardening regressions against a real `kvserve serve`: keys and hosts, limits, hostile templates,
all-or-nothing admission, streams that end cleanly, faults, deadlines, drain, logs and counters."""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import LLM, SamplingParams
from server_process import launch_server, server_log, stop_server

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
FAULT_SERVE = [sys.executable, str(Path(__file__).parent / "fault_serve.py")]
POISON, FATAL, SLOW = 477, 478, 479  # tests/fault_serve.py
SECRET = "ZEBRA-PROMPT-TEXT"  # appears in rejected prompts; must never reach a log line


def start(model_dir, *extra: str, command=None, env=None):
    return launch_server(["--model", str(model_dir), "--port", "0", "--dtype", "float32", "--kv-cache-memory", "0.05",
                          "--max-model-len", "512", *extra], command=command, env=env)  # fmt: skip


def metrics(url: str) -> dict[str, float]:
    """Samples by name and labels other than model_name (`name{reason=x}`), plus each name summed."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if "le" in sample.labels or sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            if labels:
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def sse(resp: httpx.Response) -> list[str]:
    return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


def wait_idle(url: str, headers=None) -> dict:
    deadline = time.monotonic() + 60
    while True:
        m = metrics(url)
        idle = m["kvserve:kv_cache_blocks_free"] == m["kvserve:kv_cache_blocks_total"] and m["kvserve:num_requests_running"] == 0
        if idle and m["kvserve:num_requests_waiting"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


class HealthProbe:
    """Polls /health from a thread; `worst` is the slowest answer seen."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.count, self._stop = url, 0.0, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                start = time.perf_counter()
                assert http.get(self.url + "/health").status_code == 200
                self.worst = max(self.worst, time.perf_counter() - start)
                self.count += 1
                time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def guarded(model_dir):
    """API key, the loopback Host default, a 6 MiB body limit, the model-side template only."""
    proc, url = start(model_dir, "--api-key", KEY, "--chat-template", CHAT_TEMPLATE, "--max-request-bytes", str(6 * 2**20))
    yield proc, url
    stop_server(proc)


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=0.02)


def post(url: str, body, path: str = "/v1/completions", headers=AUTH, **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={**headers, "content-type": "application/json"}, timeout=60, **kw)
    return httpx.post(url + path, json=body, headers=headers, timeout=60, **kw)


# ---------------------------------------------------------------------------- access
def test_the_start_up_log_says_how_the_weights_and_the_kv_cache_are_held(guarded, reference):
    """Which form the weights are held in and their bytes (the same model loaded here holds as many), the pool's size."""
    proc, _ = guarded
    stats = reference.stats()
    line = next(line for line in server_log(proc).splitlines() if "weights held as" in line)
    assert f"weights held as float32 (float32 activations), {stats['weight_bytes'] / 2**20:.1f} MiB; KV cache " in line
    assert "blocks" in line and "MiB (float32)" in line


def test_api_key_guards_v1_and_admin_routes(guarded):
    _, url = guarded
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        resp = post(url, body, headers=headers)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "invalid_api_key" and resp.json()["error"]["message"]
        assert resp.headers["www-authenticate"] == "Bearer"
    assert post(url, body).status_code == 200
    assert post(url, body, headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.post(url + "/reset_prefix_cache").status_code == 401
    for method, path, body in (("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}), ("GET", "/tokenizer_info", None)):
        assert httpx.request(method, url + path, json=body).status_code == 401, path
        assert httpx.request(method, url + path, json=body, headers=AUTH).status_code == 200, path
    assert httpx.post(url + "/reset_prefix_cache", headers=AUTH).status_code == 200
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + path).status_code == 200, path
    openai = pytest.importorskip("openai")
    ok = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).completions.create(model=None, prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).completions.create(model=None, prompt="hi", max_tokens=2)


def test_api_key_from_the_environment(monkeypatch):
    from kvserve.cli import build_parser
    from kvserve.server.config import ServerConfig

    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    assert ServerConfig.from_args(build_parser().parse_args(["serve"])).api_key == "from-env"
    assert ServerConfig.from_args(build_parser().parse_args(["serve", "--api-key", "flag"])).api_key == "flag"
    monkeypatch.delenv("KVSERVE_API_KEY")
    assert ServerConfig.from_args(build_parser().parse_args(["serve"])).api_key is None


def test_foreign_host_is_refused(guarded):
    _, url = guarded
    port = url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.2", f"attacker.localhost.example:{port}"):
        resp = post(url, {"prompt": "hi", "max_tokens": 2}, headers={**AUTH, "Host": host})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "host_not_allowed", (host, resp.text)
        assert httpx.get(url + "/health", headers={"Host": host}).status_code == 400
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost", f"[::1]:{port}"):
        assert post(url, {"prompt": "hi", "max_tokens": 2}, headers={**AUTH, "Host": host}).status_code == 200, host


def test_host_allow_list_parsing():
    from kvserve.server.config import ServerConfig

    loopback = ServerConfig(host="127.0.0.1")
    assert loopback.host_allowed("localhost:8000") and loopback.host_allowed("[::1]:80") and loopback.host_allowed("127.0.0.1")
    assert not loopback.host_allowed("example.com") and not loopback.host_allowed("")
    assert ServerConfig(host="0.0.0.0").host_allowed("example.com")  # bound to every address: any name, unless listed
    listed = ServerConfig(host="0.0.0.0", allowed_hosts=("api.example.com",))
    assert listed.host_allowed("API.example.com:443") and not listed.host_allowed("localhost")
    assert ServerConfig(allowed_hosts=("*",)).host_allowed("anything")


# ---------------------------------------------------------------------------- limits
def test_body_over_the_limit_is_413(guarded):
    _, url = guarded
    big = json.dumps({"prompt": "x" * (7 * 2**20)}).encode()
    resp = post(url, big)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for _ in range(8):
            yield b" " * 2**20

    resp = httpx.post(url + "/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_five_megabyte_prompt_is_refused_and_health_stays_fast(guarded):
    _, url = guarded
    with HealthProbe(url) as probe:
        resp = post(url, {"prompt": SECRET + " lorem ipsum " * (5 * 2**20 // 13), "max_tokens": 2})
        assert resp.status_code == 400 and "max_model_len" in resp.json()["error"]["message"]
        chat = post(url, {"messages": [{"role": "user", "content": "dolor sit " * (5 * 2**20 // 10)}]}, "/v1/chat/completions")
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        time.sleep(0.3)
    assert probe.count > 0 and probe.worst < 1.0, probe.worst


def test_request_supplied_chat_template_is_refused_by_default(guarded):
    proc, url = guarded
    before = rss_bytes(proc.pid)
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'ab' * 100000000 }}", "max_tokens": 2}
    resp = post(url, body, "/v1/chat/completions")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in resp.json()["error"]["message"]
    assert rss_bytes(proc.pid) - before < 50 * 2**20
    assert post(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "/v1/chat/completions").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "raw,field",
    [
        ('{"prompt": "hi", "temperature": NaN}', "temperature"),
        ('{"prompt": "hi", "temperature": Infinity}', "temperature"),
        ('{"prompt": "hi", "top_p": -Infinity}', "top_p"),
        ('{"prompt": "hi", "repetition_penalty": NaN}', "repetition_penalty"),
        ('{"prompt": "hi", "presence_penalty": NaN}', "presence_penalty"),
        ('{"prompt": "hi", "temperature": 1e400}', "temperature"),
        ('{"prompt": "hi", "temperature": %d}' % 10**400, "temperature"),
        ('{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
        ('{"prompt": "hi", "seed": 9223372036854775808}', "seed"),
        ('{"prompt": "hi", "seed": -1}', "seed"),
        ('{"prompt": "hi", "top_k": 4294967296}', "top_k"),
        ('{"prompt": "hi", "logprobs": 21}', "logprobs"),
        ('{"prompt": "hi", "n": 17}', "n"),
        ('{"prompt": "hi", "stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"]}', "stop"),
        ('{"prompt": "hi", "stop": ["%s"]}' % ("z" * 300), "stop"),
        ('{"prompt": "hi", "stop_token_ids": [512]}', "stop_token_ids"),
        ('{"prompt": [[1, 2], []]}', "prompt"),
        ('{"prompt": "hi", "kv_compression": "snap"}', "kv_compression"),
        ('{"prompt": "hi", "kv_compression": "snapkv"}', "kv_compression"),  # no budget: the engine has none
        ('{"prompt": "hi", "kv_compression": "snapkv", "kv_keep_ratio": NaN}', "kv_keep_ratio"),
        ('{"prompt": "hi", "snapkv_query": "question"}', "snapkv_query"),
        ('{"prompt": "hi", "snapkv_query": "generic"}', "snapkv_query"),  # the engine compresses nothing
        ('{"prompt": "hi", "kv_compress_from": -1}', "kv_compress_from"),
        ('{"prompt": "hi", "kv_compress_from": 4}', "kv_compress_from"),  # the engine compresses nothing
    ],
)
def test_bad_numbers_are_400_naming_the_field_before_any_stream(guarded, raw, field, stream):
    _, url = guarded
    body = raw[:-1] + ', "stream": true}' if stream else raw
    resp = post(url, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field or field in error["message"], error


def test_kv_compression_extension_field(guarded):
    _, url = guarded
    body = {"prompt": "Everyone is permitted to copy and distribute verbatim copies", "max_tokens": 6, "ignore_eos": True,
            "kv_compression": "snapkv", "kv_keep_ratio": 0.5}  # fmt: skip
    resp = post(url, body)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 6, resp.text
    resp = post(url, {**body, "snapkv_query": "generic"})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 6, resp.text


def test_a_compressing_chat_keeps_its_system_prompt_and_earlier_turns_whole_and_shared(guarded, reference):
    """kv_compression on a chat compresses its last turn only: the system prompt and earlier turns stay
    whole (kv_compress_from, set from the conversation) and out of the budget, where compressing the
    whole prompt (kv_compress_from 0) drops half of them; either way the prompt's blocks are never
    written, so the next turn reads the whole conversation from the cache; the answer is LLM.chat's."""
    _, url = guarded
    # the last turn is longer than two SnapKV windows (a shorter one is kept whole: nothing would be compressed)
    conversation = [{"role": "system", "content": "Everyone is permitted to copy and distribute verbatim copies of this license. " * 10},
                    {"role": "user", "content": "May I copy it?"}, {"role": "assistant", "content": "Yes, verbatim."},
                    {"role": "user", "content": "And may I change it, then give my changed copies to others under the same terms? " * 2}]  # fmt: skip
    squeeze = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "kv_compression": "snapkv", "kv_keep_ratio": 0.5}
    render = reference.get_tokenizer().apply_chat_template
    ids = render(conversation, chat_template=CHAT_TEMPLATE, add_generation_prompt=True)
    earlier = render(conversation[:3], chat_template=CHAT_TEMPLATE)
    shared = next(i for i, (a, b) in enumerate(zip([*earlier, -1], ids)) if a != b) // 16 * 16
    assert shared >= 0.7 * len(ids)
    cached, evicted = {}, {}
    for salt, extra in (("spared", {}), ("whole-prompt", {"kv_compress_from": 0})):
        before = metrics(url)["kvserve:kv_evicted_tokens_total"]
        first = post(url, {"messages": conversation, **squeeze, **extra, "cache_salt": salt}, "/v1/chat/completions")
        assert first.status_code == 200, first.text
        evicted[salt] = metrics(url)["kvserve:kv_evicted_tokens_total"] - before
        answer = first.json()["choices"][0]["message"]["content"]
        if not extra:
            offline = reference.chat(conversation, SamplingParams(**squeeze), chat_template=CHAT_TEMPLATE, use_tqdm=False)[0]
            assert answer == offline.text
        turn = conversation + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
        second = post(url, {"messages": turn, **squeeze, "cache_salt": salt}, "/v1/chat/completions")
        assert second.status_code == 200, second.text
        cached[salt] = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < evicted["spared"] <= (len(ids) - shared) / 2 + 1 and evicted["whole-prompt"] >= len(ids) / 2 - 1
    assert cached["spared"] >= shared and cached["whole-prompt"] >= shared


def test_temperature_below_the_greedy_threshold_is_greedy(guarded):
    _, url = guarded
    body = {"prompt": "Everyone is permitted to copy", "max_tokens": 12, "ignore_eos": True}
    greedy = post(url, {**body, "temperature": 0}).json()["choices"][0]["text"]
    for t in (1e-300, 1e-6, 5e-324):
        assert post(url, {**body, "temperature": t}).json()["choices"][0]["text"] == greedy, t


def test_stop_string_across_two_tokens_streams_only_final_text(guarded, reference):
    _, url = guarded
    prompt = "This License applies to any program or other work"
    full = reference.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    tok = reference.tokenizer
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    stop = None
    for i in range(5, len(pieces) - 1):
        a, b = pieces[i], pieces[i + 1]
        if len(a) > len(pieces[i - 1]) and len(b) > len(a) and b.startswith(a):
            candidate = a[-2:] + b[len(a) : len(a) + 2]  # two characters of each of two tokens
            if len(a) - len(pieces[i - 1]) >= 2 and len(b) - len(a) >= 2 and full.text.find(candidate) == len(a) - 2:
                stop = candidate
                break
    assert stop is not None, "no stop string spans two tokens in this output"
    expected = full.text[: full.text.index(stop)]
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    whole = post(url, body).json()["choices"][0]
    assert whole["text"] == expected and whole["finish_reason"] == "stop"
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=60) as resp:
        events = sse(resp)
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert "".join(deltas) == expected and stop not in "".join(deltas)
    streamed = ""
    for d in deltas:  # no prefix of the stream ever shows text the final output lacks
        streamed += d
        assert expected.startswith(streamed)


# ---------------------------------------------------------------------------- logs and counters
def test_rejections_and_aborts_are_logged_once_and_counted(guarded):
    proc, url = guarded
    before = metrics(url)
    ids = []
    for body in ({"prompt": SECRET, "max_tokens": -1}, {"prompt": SECRET, "temperature": "hot"}, b"{not json " + SECRET.encode()):
        resp = post(url, body)
        assert resp.status_code == 400
        ids.append(resp.headers["x-request-id"])
    unauth = post(url, {"prompt": SECRET}, headers={})
    assert unauth.status_code == 401

    async def disconnect(http: httpx.AsyncClient) -> str:
        body = {"prompt": [5, 6, 7], "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with http.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    return resp.headers["x-request-id"]  # leave mid-stream

    async def give_up(http: httpx.AsyncClient) -> None:
        body = {"prompt": [8, 9, 10], "max_tokens": 500, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            await http.post(url + "/v1/completions", json=body, headers=AUTH, timeout=0.2)

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            streamed = await asyncio.gather(disconnect(http), disconnect(http))
            await give_up(http)
            return streamed

    aborted_ids = asyncio.run(main())
    after = wait_idle(url)
    assert delta(after, before, "kvserve:request_rejected_total{reason=invalid_request}") == 3
    assert delta(after, before, "kvserve:request_rejected_total{reason=invalid_api_key}") == 1
    assert delta(after, before, "kvserve:request_aborted_total{reason=client_disconnected}") == 3
    # found by QA: aborted requests were left out of the latency histograms (the two streams had a first token)
    assert delta(after, before, "kvserve:time_to_first_token_seconds_count") >= 2
    assert delta(after, before, "kvserve:e2e_request_latency_seconds_count") == 3
    log = server_log(proc)
    for rid in ids + [unauth.headers["x-request-id"]]:
        lines = [line for line in log.splitlines() if rid in line]
        assert len(lines) == 1 and "rejected" in lines[0], lines
    for rid in aborted_ids:
        lines = [line for line in log.splitlines() if rid in line]
        assert len(lines) == 1 and "aborted" in lines[0] and "client_disconnected" in lines[0], lines
    for word in (SECRET, "Traceback", "Task exception", "CancelledError", "Exception in ASGI"):
        assert word not in log, word


# ---------------------------------------------------------------------------- templates from requests, when trusted
def test_trusted_request_templates_stay_bounded(model_dir):
    proc, url = start(model_dir, "--trust-request-chat-template", "--chat-template", CHAT_TEMPLATE)
    try:
        messages = [{"role": "user", "content": "hi"}]
        same = post(url, {"messages": messages, "max_tokens": 4, "temperature": 0, "chat_template": CHAT_TEMPLATE}, "/v1/chat/completions")
        assert same.status_code == 200
        default = post(url, {"messages": messages, "max_tokens": 4, "temperature": 0}, "/v1/chat/completions")
        assert same.json()["choices"][0]["message"] == default.json()["choices"][0]["message"]
        before = rss_bytes(proc.pid)
        hostile = {
            "{{ 'ab' * 100000000 }}": "limit",
            "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}": "too long",
            "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}": "limit",
            "{{ 10 ** 100000000 }}": "power",
            "{{ ''.__class__.__mro__[1].__subclasses__() }}": "",
            "{% for x in messages %}": "parse",
        }
        with HealthProbe(url) as probe:
            for template, words in hostile.items():
                resp = post(url, {"messages": messages, "max_tokens": 2, "chat_template": template}, "/v1/chat/completions")
                if resp.status_code == 200:  # the sandbox renders the dunder access as empty
                    assert not words
                    continue
                assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template", resp.text
                assert words in resp.json()["error"]["message"], resp.text
        assert probe.worst < 1.0, probe.worst
        assert rss_bytes(proc.pid) - before < 100 * 2**20
        assert post(url, {"messages": messages, "max_tokens": 2}, "/v1/chat/completions").status_code == 200
    finally:
        stop_server(proc)


# ---------------------------------------------------------------------------- all or nothing under overload
def test_overload_rejects_before_any_response_starts(model_dir):
    proc, url = start(model_dir, "--max-waiting-requests", "4", "--max-num-seqs", "1", "--chat-template", CHAT_TEMPLATE,
                      command=FAULT_SERVE)
    try:
        before = metrics(url)

        async def filler(http: httpx.AsyncClient, started: asyncio.Queue) -> int:
            body = {"prompt": [SLOW, 5, 6], "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with http.stream("POST", url + "/v1/completions", json=body) as resp:
                await started.put(resp.status_code)
                if resp.status_code == 200:
                    await asyncio.sleep(3600)  # held until cancelled: a disconnect
                return resp.status_code

        async def main():
            async with httpx.AsyncClient(timeout=60) as http:
                started: asyncio.Queue = asyncio.Queue()
                fillers = []
                while True:  # until the queue is full
                    fillers.append(asyncio.ensure_future(filler(http, started)))
                    if await started.get() == 503:
                        break
                checks = {
                    "n2_stream": {"prompt": "hi", "n": 2, "max_tokens": 4, "stream": True},
                    "n2": {"prompt": "hi", "n": 2, "max_tokens": 4},
                    "prompts3": {"prompt": ["a", "b", "c"], "max_tokens": 4},
                    "prompts3_stream": {"prompt": [[5], [6], [7]], "max_tokens": 4, "stream": True},
                    "chat_stream": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
                }
                results = {}
                for name, body in checks.items():
                    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                    resp = await http.post(url + path, json=body)
                    results[name] = (resp.status_code, resp.headers["content-type"], resp.json()["error"]["code"],
                                     resp.headers.get("retry-after"))  # fmt: skip
                too_many = await http.post(url + "/v1/completions", json={"prompt": "hi", "n": 5})
                for task in fillers:
                    task.cancel()
                await asyncio.gather(*fillers, return_exceptions=True)
                return len(fillers), results, too_many

        num_fillers, results, too_many = asyncio.run(main())
        for name, (status, content_type, code, retry_after) in results.items():
            # Retry-After: a router (smg) or client tries again, elsewhere or later
            assert (status, content_type, code, retry_after) == (503, "application/json", "overloaded", "1"), name
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        after = wait_idle(url)
        assert delta(after, before, "kvserve:request_rejected_total{reason=overloaded}") == len(results) + 1
        assert delta(after, before, "kvserve:request_aborted_total{reason=client_disconnected}") == num_fillers - 1
        assert delta(after, before, "kvserve:request_success_total") == 0  # no rejected choice ran
        assert after["kvserve:kv_cache_blocks_free"] == after["kvserve:kv_cache_blocks_total"]
    finally:
        stop_server(proc)


# ---------------------------------------------------------------------------- faults and deadlines
def test_step_faults_deadlines_and_a_dead_engine(model_dir):
    proc, url = start(model_dir, "--request-timeout", "2", command=FAULT_SERVE)
    try:
        before = metrics(url)
        # a step that raises fails its request (500 with a body) and the engine goes on
        resp = post(url, {"prompt": [5, POISON, 6], "max_tokens": 8}, headers={})
        assert resp.status_code == 500 and resp.json()["error"]["code"] == "engine_error", resp.text
        assert "injected step fault" in resp.json()["error"]["message"]
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": [5, POISON, 7], "max_tokens": 8, "stream": True},
                          timeout=60) as streamed:  # fmt: skip
            assert streamed.status_code == 200
            events = sse(streamed)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_error"  # then [DONE], as vLLM
        assert post(url, {"prompt": [5, 6, 7], "max_tokens": 8}, headers={}).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        # a request past --request-timeout is aborted: 504, or an error event in a stream
        resp = post(url, {"prompt": [SLOW, 6], "max_tokens": 400, "ignore_eos": True}, headers={})
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout", resp.text
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": [SLOW, 7], "max_tokens": 400, "ignore_eos": True,
                                                                 "stream": True}, timeout=60) as streamed:  # fmt: skip
            assert streamed.status_code == 200
            events = sse(streamed)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
        after = wait_idle(url)
        assert after["kvserve:kv_cache_blocks_free"] == after["kvserve:kv_cache_blocks_total"]
        assert delta(after, before, "kvserve:request_aborted_total{reason=engine_error}") == 2
        assert delta(after, before, "kvserve:request_aborted_total{reason=timeout}") == 2

        # the engine thread dies: waiters get an error at once, /health and new requests 503
        async def main():
            async with httpx.AsyncClient(timeout=60) as http:
                waiter = asyncio.ensure_future(http.post(url + "/v1/completions", json={"prompt": [SLOW, 8], "max_tokens": 400,
                                                                                      "ignore_eos": True}))  # fmt: skip
                await asyncio.sleep(0.3)
                killer = await http.post(url + "/v1/completions", json={"prompt": [FATAL, 5], "max_tokens": 4})
                return await waiter, killer

        waiter, killer = asyncio.run(main())
        for resp in (waiter, killer):
            assert resp.status_code == 500 and resp.json()["error"]["code"] in ("engine_dead", "engine_error"), resp.text
        assert killer.json()["error"]["code"] == "engine_dead"
        assert httpx.get(url + "/health").status_code == 503
        late = post(url, {"prompt": [5, 6], "max_tokens": 2}, headers={})
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_unavailable"
    finally:
        stop_server(proc)


# ---------------------------------------------------------------------------- graceful shutdown
def test_sigterm_drains_within_the_timeout_and_exits_zero(model_dir):
    proc, url = start(model_dir, "--shutdown-timeout", "3", command=FAULT_SERVE)
    try:
        async def stream(http: httpx.AsyncClient, prompt, max_tokens: int, started: asyncio.Event) -> list[str]:
            body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            events = []
            async with http.stream("POST", url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
            return events

        async def main():
            async with httpx.AsyncClient(timeout=60) as http:
                flags = [asyncio.Event() for _ in range(3)]
                # every step sleeps 50 ms while a SLOW prompt runs: 20 tokens take ~1 s, 400 take ~20 s
                tasks = [asyncio.ensure_future(stream(http, [SLOW, 5], 400, flags[0])),
                         asyncio.ensure_future(stream(http, [SLOW, 6], 400, flags[1])),
                         asyncio.ensure_future(stream(http, [5, 6, 7], 20, flags[2]))]  # fmt: skip
                for flag in flags:
                    await flag.wait()
                signalled = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                refused = await http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                health = await http.get(url + "/health")
                return await asyncio.gather(*tasks), refused, health, signalled

        (slow_a, slow_b, short), refused, health, signalled = asyncio.run(main())
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert health.status_code == 503
        assert short[-1] == "[DONE]"
        for events in (slow_a, slow_b):
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutdown"
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 3 + 5  # the drain's 3 s, then closing connections
        log = server_log(proc)
        assert log.count("aborted") == 2 and "Traceback" not in log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_signal_exits_at_once(model_dir):
    proc, url = start(model_dir, "--shutdown-timeout", "120", command=FAULT_SERVE)
    try:
        def hold():
            body = {"prompt": [SLOW, 5], "max_tokens": 400, "ignore_eos": True, "stream": True}
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
                for _ in resp.iter_lines():
                    pass  # until the server exits under it

        client = threading.Thread(target=hold, daemon=True)
        client.start()
        deadline = time.monotonic() + 60
        while metrics(url)["kvserve:num_requests_running"] < 1:  # the request runs: the first signal starts a drain
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # draining
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        assert "second SIGTERM" in server_log(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_help_documents_every_new_flag():
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--help"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "200"}).stdout  # fmt: skip
    for flag in ("--api-key", "--allowed-hosts", "--max-request-bytes", "--request-timeout", "--shutdown-timeout",
                 "--trust-request-chat-template", "--skip-tokenizer-init", "KVSERVE_API_KEY"):  # fmt: skip
        assert flag in out, flag


def test_the_api_pages_are_behind_the_key_and_can_be_turned_off(guarded, model_dir):
    """/docs, /redoc and /openapi.json list every route and field: with --api-key they need it, as
    the endpoints do, and --disable-fastapi-docs (vLLM's flag) serves none of them."""
    _, url = guarded
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(url + path, timeout=30).status_code == 401
        assert httpx.get(url + path, headers=AUTH, timeout=30).status_code == 200
    assert "/v1/completions" in httpx.get(url + "/openapi.json", headers=AUTH, timeout=30).json()["paths"]
    proc, plain = start(model_dir, "--disable-fastapi-docs")
    try:
        assert [httpx.get(plain + path, timeout=30).status_code for path in ("/docs", "/redoc", "/openapi.json")] == [404] * 3
        assert httpx.get(plain + "/health", timeout=30).status_code == 200
    finally:
        stop_server(proc)
