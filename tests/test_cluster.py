"""`kvserve cluster`: two replicas of a tiny model behind the real smg router (PyPI, the version
pyproject's `cluster` extra pins). Requests sharing a prefix stick to one replica and answer as a
single server does; /v1/loads says what the engine counts and smg reads it as such; /flush_cache
through the router empties every replica's prefix cache; a killed replica is routed around; SIGTERM
stops the router and every replica. If a future smg changes what it calls or reads, these fail."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from redis_server import free_port
from server_process import launch_server, stop_server

from kvserve.server.cluster import SMG_VERSION, find_smg, replica_flags

API_KEY = "cluster-test-key-0123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "0.05", "--max-model-len", "512", "--served-model-name", "tiny"]
# two long prefixes (about 150 tokens each for the tiny tokenizer), each asked several questions
PREFIX = {
    "A": "The quick brown fox jumps over the lazy dog near the river bank, and the dog does not mind at all. " * 4,
    "B": "Paged attention splits the KV cache into fixed-size blocks of tokens, as virtual memory splits pages. " * 4,
}


def metrics(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvserve:"):
            name, _, value = line.rpartition(" ")
            values[re.sub(r"\{.*\}", "", name)] = values.get(re.sub(r"\{.*\}", "", name), 0.0) + float(value)
    return values


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    response = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


class RunningCluster:
    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc, self.log = proc, log
        text = log.read_text()
        self.replicas = [(m.group(1), int(m.group(2))) for m in re.finditer(r"kvserve cluster: replica \d+ on (\S+) \(pid (\d+)", text)]
        serving = re.search(r"kvserve cluster: serving 2 replicas behind smg \(cache_aware, pid (\d+)\) on (\S+) "
                            r"\(router metrics: (\S+);", text)  # fmt: skip
        self.router_pid, self.url, self.router_metrics = int(serving.group(1)), serving.group(2), serving.group(3)
        self.replica_urls = [url for url, _ in self.replicas]

    def output(self) -> str:
        return self.log.read_text()

    def served_by(self, send) -> tuple[int, dict]:
        """Which replica answered a request (its success count moved), and the answer."""
        before = [metrics(u)["kvserve:request_success_total"] for u in self.replica_urls]
        answer = send()
        after = [metrics(u)["kvserve:request_success_total"] for u in self.replica_urls]
        moved = [i for i, (a, b) in enumerate(zip(after, before)) if a > b]
        assert len(moved) == 1, (before, after)
        return moved[0], answer


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir):
    find_smg(None)  # smg missing fails here (make setup installs the cluster extra), never skips
    log = Path(tempfile.mkstemp(prefix="kvserve-cluster-", suffix=".log")[1])
    # the router polls every replica's /v1/loads each second here (smg's default: 10 s); the API key
    # (from the environment, as a deployment would) guards the replicas and the router alike
    command = [sys.executable, "-m", "kvserve.cli", "cluster", "--replicas", "2", "--port", "0", "--model", str(model_dir),
               *MODEL_FLAGS, "--router-args", "--load-monitor-interval 1", "--log-level", "debug"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "KVSERVE_API_KEY": API_KEY})  # fmt: skip
    deadline = time.monotonic() + 180
    while "kvserve cluster: serving" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    running = RunningCluster(proc, log)
    yield running
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for _, pid in running.replicas:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.kill(running.router_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def single(model_dir):
    """One `kvserve serve` with the same flags (and every core's threads): the outputs to match."""
    proc, url = launch_server(["--model", str(model_dir), "--port", "0", *MODEL_FLAGS, "--api-key", API_KEY])
    yield url
    stop_server(proc)


def test_smg_is_the_tested_version():
    out = subprocess.run([find_smg(None), "--version"], capture_output=True, text=True, timeout=30)
    assert SMG_VERSION in out.stdout + out.stderr, out.stdout + out.stderr


def test_requests_sharing_a_prefix_stick_to_one_replica_and_answer_as_one_server(cluster, single):
    where: dict[str, set[int]] = {"A": set(), "B": set()}
    for i in range(4):
        for name, prefix in PREFIX.items():
            prompt = f"{prefix}Question {i}: what happens next?"
            replica, answer = cluster.served_by(lambda: complete(cluster.url, prompt))
            where[name].add(replica)
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            # the first request computes the prefix; every later one finds it where it was computed
            assert (cached == 0) if i == 0 else (cached >= 128), (name, i, cached)
            assert answer["choices"][0]["text"] == complete(single, prompt)["choices"][0]["text"], (name, i)
    assert len(where["A"]) == 1 and len(where["B"]) == 1, where
    # streamed through the router: the same text, and the prefix still found on its replica
    prompt = f"{PREFIX['A']}Question 9: what happens next?"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    text, usage = "", None
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                text += "".join(c["text"] for c in event["choices"])
                usage = event.get("usage") or usage
    assert text == complete(single, prompt)["choices"][0]["text"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 128
    # without the key, neither the router nor a replica answers
    for url in (cluster.url, cluster.replica_urls[0]):
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401, url
    # a field the router or a newer client adds is accepted, and logged once at debug level
    for _ in range(2):
        complete(cluster.url, "hello", router_hint_for_test=1)
    assert cluster.output().count("ignoring request field 'router_hint_for_test'") == 1


def test_loads_say_what_the_engine_counts_and_smg_reads_them(cluster):
    # the replica the earlier tests' shared prefixes were routed to (which one is the router's choice) has prefix hits
    replica = max(cluster.replica_urls, key=lambda url: metrics(url)["kvserve:prefix_cache_hits_total"])
    time.sleep(1.5)  # quiet: no request running, the idle engine's snapshot refreshed
    report = httpx.get(replica + "/v1/loads", headers=AUTH, timeout=10).json()
    m = metrics(replica)
    (load,) = report["loads"]
    assert report["dp_rank_count"] == 1
    capacity = int(m["kvserve:kv_cache_blocks_total"]) * 16
    used_blocks = m["kvserve:kv_cache_blocks_total"] - m["kvserve:kv_cache_blocks_free"]
    assert load["num_running_reqs"] == m["kvserve:num_requests_running"] == 0
    assert load["num_waiting_reqs"] == m["kvserve:num_requests_waiting"] == 0
    assert load["max_total_num_tokens"] == load["memory"]["token_capacity"] == capacity
    assert load["token_usage"] == round(m["kvserve:kv_cache_usage_perc"], 4) == round(used_blocks / m["kvserve:kv_cache_blocks_total"], 4)
    assert load["num_used_tokens"] == round(m["kvserve:kv_cache_usage_perc"] * capacity)  # held by requests (cached blocks are free)
    assert load["cache_hit_rate"] == round(m["kvserve:prefix_cache_hits_total"] / m["kvserve:prefix_cache_queries_total"], 4) > 0
    assert load["max_running_requests"] == 64 and load["disagg_mode"] == "null"
    assert report["aggregate"]["total_used_tokens"] == load["num_used_tokens"]
    core = httpx.get(replica + "/v1/loads?include=core", headers=AUTH, timeout=10).json()["loads"][0]
    assert "memory" not in core and core["num_used_tokens"] == load["num_used_tokens"]
    bad = httpx.get(replica + "/v1/loads?include=core,gpu", headers=AUTH, timeout=10)
    assert bad.status_code == 400 and "'gpu'" in bad.json()["error"]["message"]
    # smg polls /v1/loads?include=core,disagg,queues,memory and reports what it parsed on /get_loads
    deadline = time.monotonic() + 15
    while True:
        seen = {entry["worker"]: entry for entry in httpx.get(cluster.url + "/get_loads", headers=AUTH, timeout=10).json()["loads"]}
        if replica in seen and seen[replica]["num_used_tokens"] == load["num_used_tokens"]:
            break
        assert time.monotonic() < deadline, seen
        time.sleep(0.5)
    for field in ("max_total_num_tokens", "token_usage", "cache_hit_rate", "max_running_requests", "num_waiting_reqs"):
        assert seen[replica][field] == load[field], field
    assert seen[replica]["memory"]["kv_cache_gb"] == load["memory"]["kv_cache_gb"]
    assert "smg_" in httpx.get(cluster.router_metrics, timeout=10).text

    # POST /flush_cache on the router reaches every replica: their prefix caches are empty
    for name, prefix in PREFIX.items():
        assert complete(cluster.url, f"{prefix}Question 5: what happens next?")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert httpx.post(replica + "/flush_cache", timeout=30).status_code == 401  # the replicas' own guard
    flushed = httpx.post(cluster.url + "/flush_cache", headers=AUTH, timeout=30)
    assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2, flushed.text
    for name, prefix in PREFIX.items():
        assert complete(cluster.url, f"{prefix}Question 6: what happens next?")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_hostile_corpus_through_the_router_is_never_a_5xx(cluster):
    from hostile_bodies import try_every_shape

    statuses = try_every_shape(cluster.url, {"Authorization": f"Bearer {API_KEY}"}, model="tiny")
    assert all(400 <= s < 500 for s in statuses), statuses


def test_a_killed_replica_is_routed_around(cluster, single):
    prompt = f"{PREFIX['A']}Question 1: what happens next?"
    victim, _ = cluster.served_by(lambda: complete(cluster.url, prompt))
    os.kill(cluster.replicas[victim][1], signal.SIGKILL)
    for i in range(3):
        for name, prefix in PREFIX.items():
            prompt = f"{prefix}Question {i}: and after that?"
            assert complete(cluster.url, prompt)["choices"][0]["text"] == complete(single, prompt)["choices"][0]["text"]
    deadline = time.monotonic() + 10
    while f"replica {victim} ({cluster.replica_urls[victim]}) exited" not in cluster.output():
        assert time.monotonic() < deadline, cluster.output()
        time.sleep(0.2)
    assert cluster.proc.poll() is None  # the other replica still serves


def test_sigterm_stops_the_router_and_every_replica(cluster):
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(timeout=90) == 0, cluster.output()
    for pid in [cluster.router_pid, *(pid for _, pid in cluster.replicas)]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _cluster_cli(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **({"PATH": path} if path is not None else {})}
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "cluster", *args], capture_output=True, text=True, timeout=120, env=env)


def _cluster_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """`kvserve cluster ARGS` in this process (its refusals come before anything starts: no subprocess needed)."""
    from kvserve.cli import main

    try:
        code = main(["cluster", *args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["kvserve", "cluster", *args], code, out.out, out.err)


def test_cluster_refuses_bad_flags_before_starting_anything(tmp_path, capsys):
    cases = [
        (["--replicas", "0"], "--replicas must be in [1, 64]"),
        (["--router-policy", "power_of_two", "--replicas", "1"], "give --replicas 2 or more"),
        (["--smg", str(tmp_path / "nothing")], "pip install 'kvserve[cluster]'"),
        (["--cache-threshold", "1.5"], "--cache-threshold must be in [0, 1]"),
        (["--router-args", "--policy 'unclosed"], "--router-args"),
        (["--threads", "0"], "--threads (threads) must be an integer"),
        (["--kv-cache-dtype", "int8", "--kv-remote-url", "http://x"], "--kv-remote-url"),
    ]
    for args, message in cases:
        out = _cluster_main(capsys, *args)
        assert out.returncode == 2 and message in out.stderr and out.stderr.count("\n") == 1, (args, out.stderr)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = _cluster_cli("--port", str(taken.getsockname()[1]))
        assert out.returncode == 2 and "cannot listen on --host 127.0.0.1" in out.stderr, out.stderr
        assert "[replica" not in out.stdout  # refused before a model was loaded
        port = str(taken.getsockname()[1])
        out = _cluster_cli("--router-prometheus-port", port)  # found by QA: it named --host/--port
        assert out.returncode == 2 and f"cannot listen on --router-prometheus-port {port}" in out.stderr, out.stderr


def test_find_smg_names_the_extra_when_smg_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match=r"pip install 'kvserve\[cluster\]'"):
        find_smg(None)


def test_replicas_get_the_flags_given_and_never_the_api_key():
    from kvserve.cli import build_parser
    from kvserve.engine_args import add_engine_args
    from kvserve.server.args import add_server_args
    from kvserve.server.cluster import ROUTER_SERVER_FLAGS

    args = build_parser().parse_args(["cluster", "--kv-cache-dtype", "int8", "--no-enable-prefix-caching", "--max-num-seqs", "8",
                                      "--api-key", "secret-key", "--trust-request-chat-template", "--port", "9"])  # fmt: skip
    engine = replica_flags(args, add_engine_args, skip=("threads",))
    server = replica_flags(args, lambda p: add_server_args(p, skip=ROUTER_SERVER_FLAGS), skip=("api_key",))
    assert engine == ["--kv-cache-dtype", "int8", "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    assert server == ["--trust-request-chat-template"]
    assert isinstance(args, argparse.Namespace)


def test_replicas_share_a_kv_record_key_drawn_for_them_unless_one_is_given(monkeypatch):
    from kvserve.kv.tiers.signing import KEY_ENV, load_signer
    from kvserve.server.cluster import Cluster

    monkeypatch.delenv(KEY_ENV, raising=False)
    drawn = Cluster(argparse.Namespace(), "smg", ["--kv-remote-url", "redis://127.0.0.1:1"], 1, None)
    env = drawn._env()
    assert load_signer(None, env) is not None and env[KEY_ENV] == drawn._env()[KEY_ENV]  # one key, every replica
    assert env[KEY_ENV] != Cluster(argparse.Namespace(), "smg", [], 1, None)._env()[KEY_ENV]  # drawn per cluster
    assert KEY_ENV not in Cluster(argparse.Namespace(), "smg", ["--kv-remote-key-file", "/k"], 1, None)._env()
    monkeypatch.setenv(KEY_ENV, "the operator's own key, 32 bytes")
    assert Cluster(argparse.Namespace(), "smg", [], 1, None)._env()[KEY_ENV] == "the operator's own key, 32 bytes"


def test_the_routers_ports_stay_taken_while_the_replicas_start():
    """The router's ports are held by listening sockets until smg starts: a replica binding port 0
    meanwhile cannot be given one of them (a port released early was, once, and smg failed to bind).
    A listening socket refuses every other bind of its port, SO_REUSEADDR or not."""
    from kvserve.server.cluster import _reserved_port
    from kvserve.server.shutdown import bound_socket

    held = _reserved_port("127.0.0.1", 0)
    port = held.getsockname()[1]
    with pytest.raises(ValueError, match="cannot listen"):
        bound_socket("127.0.0.1", port)
    others = [bound_socket("127.0.0.1", 0) for _ in range(200)]
    assert port not in {sock.getsockname()[1] for sock in others}
    for sock in others:
        sock.close()
    held.close()
    bound_socket("127.0.0.1", port).close()  # free again once released


def test_a_killed_cluster_takes_its_replicas_and_router_with_it(model_dir):
    """SIGKILL (or the OOM killer) gives the cluster no chance to stop anything: the parent-death
    signal must, or replicas would go on serving with no router in front."""
    log = Path(tempfile.mkstemp(prefix="kvserve-cluster-", suffix=".log")[1])
    command = [sys.executable, "-m", "kvserve.cli", "cluster", "--replicas", "1", "--port", "0", "--model", str(model_dir),
               *MODEL_FLAGS]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 180
        while "kvserve cluster: serving" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
        assert len(pids) == 2, text  # the replica and the router
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids):
            assert time.monotonic() < deadline, [pid for pid in pids if _alive(pid)]
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its new parent) is gone for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_smg_retries_an_overloaded_workers_503_on_another_worker(tmp_path):
    """What kvserve's 503 + Retry-After (--max-waiting-requests, tests/test_hardening.py) relies on:
    smg sends the request to another worker. One worker here always answers as an overloaded
    kvserve does; every request through smg must still succeed, by way of the other."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    hits = {"overloaded": 0, "ok": 0}

    def worker(kind: str) -> ThreadingHTTPServer:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, code: int, body: dict, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                for name, value in {"content-type": "application/json", "content-length": str(len(data)), **(headers or {})}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.startswith("/v1/models"):
                    return self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 512}]})
                return self._send(200 if self.path in ("/health", "/version") else 404, {})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                hits[kind] += 1
                if kind == "overloaded":
                    return self._send(503, {"error": {"message": "server overloaded", "type": "server_overloaded", "code": "overloaded"}},
                                      {"Retry-After": "1"})  # fmt: skip
                return self._send(200, {"id": "c", "object": "text_completion", "model": "tiny", "choices": [
                    {"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}]})  # fmt: skip

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    workers = [worker("overloaded"), worker("ok")]
    port, metrics_port = free_port(), free_port()
    urls = [f"http://127.0.0.1:{w.server_address[1]}" for w in workers]
    router = subprocess.Popen([find_smg(None), "launch", "--worker-urls", *urls, "--policy", "round_robin", "--host", "127.0.0.1",
                               "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                               "--log-level", "warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=2).json().get("healthy_workers") == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for i in range(6):
            body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": 2}
            assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).status_code == 200
        assert hits["overloaded"] >= 1 and hits["ok"] == 6, hits
    finally:
        router.terminate()
        router.wait(timeout=30)
        for w in workers:
            w.shutdown()
