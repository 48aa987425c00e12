"""Soak: hundreds of concurrent clients against a real `kvserve serve` on a tiny model whose KV pool
forces preemption, for minutes, then checks that nothing leaked and nothing was half-answered.

The mix, per request a client sends: streamed and plain greedy completions and chats (each must
equal its solo run), seeded n > 1 sampling, streams the client leaves after their first chunk
(with the plain requests it gives up on, a third of the load), and bad requests of ten kinds
(each must get its own 4xx code). A 503 (overloaded) is documented behaviour: the client backs
off and tries again. A separate process polls /health throughout.

After a warm-up (same load, then idle) the soak measures: requests by outcome, rejections by
status and code, 5xx that are not the documented 503, blocks leaked, TTFT p50/p99, generated
tokens/s, the worst /health latency, the server's RSS after warm-up and at the end (and its slope
per 1,000 requests, overall and, from samples every 10 s, over each half of the load: growth that
levels off shows a second-half slope near zero); and checks
that every 200 stream ended with [DONE], every greedy output equals its solo run, every block is
free, and the server's counters (rejected by reason, aborted, finished) equal what clients saw.
Every request carries its own X-Request-Id, so each rejection a client saw is matched to the
server's one log line for it; for a request the client left (it cannot know what became of it),
the log says whether the server aborted it, had already finished it, or rejected it.

    .venv/bin/python bench/soak.py                              # 150 clients, 2 minutes, the tiny Llama
    .venv/bin/python bench/soak.py --duration 30 --json out.json

tests/test_soak.py runs it (`run_soak`) and asserts its checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 256 * 1024
GREEDY_TOKENS = 24
LONG_TOKENS = 200  # disconnecting and abandoned requests: far more than they live for
GIVE_UP_S = 1.0  # a plain request the client abandons; a rejection comes long before
WORDS = ("the license program work copy source code free software terms conditions modify convey patent "
         "distribute covered object recipients rights notice warranty").split()  # fmt: skip


@dataclass(frozen=True)
class SoakConfig:
    model: str | None = None  # None: the tests' tiny random Llama, built once under the kvserve cache
    duration: float = 120.0
    warmup: float = 20.0
    clients: int = 150
    num_kv_blocks: int = 64  # 1,024 token slots for up to 32 running sequences: preemption is routine
    max_num_seqs: int = 32
    max_waiting_requests: int = 64
    seed: int = 0
    tracemalloc: str | None = None  # a file: the server traces Python allocations; the growth after warm-up is written there


@dataclass
class Record:
    kind: str
    rid: str  # the X-Request-Id it was sent with: the server's log lines name it
    status: int = 0
    code: str | None = None  # the error body's code
    done: bool = False  # a 200 that ended as it should ([DONE], or every choice finished)
    disconnected: bool = False  # the client left on purpose
    mismatch: str | None = None  # what differed from the solo run, or a malformed answer
    ttft: float | None = None
    completion_tokens: int = 0
    choices: int = 1


# ---------------------------------------------------------------------------- the server
def tiny_model() -> Path:
    # run as a script, bench/ leads sys.path: keep its modules from shadowing packages transformers imports (such as `kernels`)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import tiny_model_dir

    from kvserve.cache_dir import cache_root

    return tiny_model_dir("llama", str(cache_root() / "soak-models"))


# `kvserve serve` with tracemalloc: the first SIGUSR1 (the soak sends one after warm-up) starts tracing
# (tracing from the start made torch's import alone take minutes) and takes a snapshot; each later one
# writes the allocations made since then and still alive, grouped by traceback, to argv[1].
TRACED_SERVER = """
import gc, signal, sys, tracemalloc
out, snapshots = sys.argv.pop(1), []
def snapshot(*_):
    gc.collect()
    if not tracemalloc.is_tracing():
        tracemalloc.start(12)
    snapshots.append(tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)]))
    if len(snapshots) > 1:
        grown = snapshots[-1].compare_to(snapshots[0], "traceback")
        total = sum(s.size_diff for s in grown)
        with open(out, "w") as f:
            f.write(f"traced Python memory grew {total / 2**20:+.2f} MiB since the first snapshot\\n")
            for stat in grown[:30]:
                f.write(f"\\n{stat.size_diff / 1024:+.1f} KiB in {stat.count_diff:+d} blocks\\n")
                f.write("\\n".join(stat.traceback.format(limit=12)) + "\\n")
signal.signal(signal.SIGUSR1, snapshot)
from kvserve.cli import main
sys.argv[0] = "kvserve"
sys.exit(main())
"""


def start_server(cfg: SoakConfig, model: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    args = ["--model", model, "--port", "0", "--dtype", "float32", "--num-kv-blocks", str(cfg.num_kv_blocks), "--block-size", "16",
            "--max-num-seqs", str(cfg.max_num_seqs), "--max-model-len", str(MAX_MODEL_LEN), "--max-waiting-requests",
            str(cfg.max_waiting_requests), "--api-key", KEY, "--chat-template", CHAT_TEMPLATE, "--max-request-bytes",
            str(MAX_REQUEST_BYTES), "--log-level", "info"]  # fmt: skip
    out = open(log_path, "w")
    command = [sys.executable, "-m", "kvserve.cli", "serve", *args]
    if cfg.tracemalloc:
        command = [sys.executable, "-c", TRACED_SERVER, cfg.tracemalloc, "serve", *args]
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if line.startswith("kvserve: serving"):
                url = line.split(" on ")[1].split()[0]
                while httpx.get(url + "/health", timeout=5).status_code != 200:
                    time.sleep(0.2)
                return proc, url
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start:\n" + log_path.read_text())


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if "le" in sample.labels or sample.name.endswith("_created"):
                continue
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            if "reason" in sample.labels:
                name = f"{sample.name}{{{sample.labels['reason']}}}"
                out[name] = out.get(name, 0.0) + sample.value
    return out


def _outcomes(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith(("kvserve:request_success_total", "kvserve:request_aborted_total",
                                                         "kvserve:request_rejected_total")))  # fmt: skip


def wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    """Metrics once nothing runs or waits and no request's outcome has changed for a second: a
    request a client left may still be on its way in (body, tokenizer) when the engine is idle."""
    deadline = time.monotonic() + timeout
    previous = None
    while True:
        m = metrics(url)
        busy = m["kvserve:num_requests_running"] or m["kvserve:num_requests_waiting"]
        settled = not busy and previous is not None and _outcomes(m) == _outcomes(previous)
        if settled or time.monotonic() > deadline:
            return m
        previous = None if busy else m
        time.sleep(1.0 if not busy else 0.2)


RSS_SAMPLE_S = 10.0


def least_squares_slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def poll_health(url: str, pid: int, stop, result) -> None:
    """In its own process: /health every 100 ms (the worst latency and any non-200), and the server's RSS every
    RSS_SAMPLE_S seconds, so that a long run shows whether the RSS levels off."""
    worst, count, failures = 0.0, 0, 0
    began, rss = time.monotonic(), []
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            now = time.monotonic() - began
            if not rss or now - rss[-1][0] >= RSS_SAMPLE_S:
                rss.append((now, rss_bytes(pid) / 2**20))
            start = time.perf_counter()
            try:
                ok = http.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            worst = max(worst, time.perf_counter() - start)
            count, failures = count + 1, failures + (not ok)
            stop.wait(0.1)
    result.put({"worst": worst, "count": count, "failures": failures, "rss": rss})


# ---------------------------------------------------------------------------- the workload
class Workload:
    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.id_prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(6, 40))] for _ in range(16)]
        self.text_prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for _ in range(8)]
        self.chats = [[{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))}] for _ in range(6)]
        self.solo: dict[str, str] = {}  # prompt key -> greedy text of its solo run

    @staticmethod
    def key(prompt) -> str:
        return json.dumps(prompt)

    def prompts(self) -> list:
        return self.id_prompts + self.text_prompts

    async def run_solo(self, http: httpx.AsyncClient, url: str) -> None:
        """Each greedy request once, alone: the reference its soak runs must equal."""
        for prompt in self.prompts():
            resp = await http.post(url + "/v1/completions", json=greedy_body(prompt), headers=AUTH)
            self.solo[self.key(prompt)] = resp.json()["choices"][0]["text"]
        for messages in self.chats:
            resp = await http.post(url + "/v1/chat/completions", json=greedy_chat(messages), headers=AUTH)
            self.solo[self.key(messages)] = resp.json()["choices"][0]["message"]["content"]


def greedy_body(prompt) -> dict:
    return {"prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}


def greedy_chat(messages) -> dict:
    return {"messages": messages, "max_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}


def bad_requests(url: str) -> list[tuple[str, dict, int, str]]:
    """(name, httpx request kwargs, expected status, expected error code)."""
    port = url.rsplit(":", 1)[1]
    json_headers = {**AUTH, "content-type": "application/json"}
    return [
        ("nan temperature", {"content": b'{"prompt": "hi", "temperature": NaN}', "headers": json_headers}, 400, "invalid_request"),
        ("seed 2^64", {"json": {"prompt": "hi", "seed": 2**64}, "headers": AUTH}, 400, "invalid_request"),
        ("bad json", {"content": b'{"prompt": "hi", ', "headers": json_headers}, 400, "invalid_request"),
        ("unknown model", {"json": {"prompt": "hi", "model": "gpt-9"}, "headers": AUTH}, 404, "model_not_found"),
        ("wrong key", {"json": {"prompt": "hi"}, "headers": {"Authorization": "Bearer nope"}}, 401, "invalid_api_key"),
        ("body too large", {"json": {"prompt": "x" * MAX_REQUEST_BYTES}, "headers": AUTH}, 413, "request_too_large"),
        ("foreign host", {"json": {"prompt": "hi"}, "headers": {**AUTH, "Host": f"rebind.example:{port}"}}, 400, "host_not_allowed"),
        ("too many choices", {"json": {"prompt": [[5, 6]] * 30, "n": 3}, "headers": AUTH}, 400, "invalid_request"),
        ("request template", {"json": {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'a' * 9 }}"},
                              "headers": AUTH, "path": "/v1/chat/completions"}, 400, "invalid_request"),  # fmt: skip
        ("stop id outside vocab", {"json": {"prompt": "hi", "stop_token_ids": [10**6]}, "headers": AUTH}, 400, "invalid_request"),
    ]


KINDS = (  # (kind, weight): a third of the load leaves early (disconnect, give_up)
    ("stream", 20), ("plain", 16), ("chat_stream", 8), ("n", 8), ("disconnect", 30), ("give_up", 4), ("bad", 14),
)  # fmt: skip


async def sse_events(resp: httpx.Response):
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            yield line[6:]


async def one(http: httpx.AsyncClient, url: str, work: Workload, kind: str, rng: random.Random, rid: str) -> Record:
    rec = Record(kind, rid)
    auth = {**AUTH, "X-Request-Id": rid}
    start = time.perf_counter()
    if kind == "bad":
        name, kwargs, status, code = rng.choice(bad_requests(url))
        rec.kind = f"bad: {name}"
        kwargs = {**kwargs, "headers": {**kwargs["headers"], "X-Request-Id": rid}}
        resp = await http.post(url + kwargs.pop("path", "/v1/completions"), **kwargs)
        rec.status, rec.code = resp.status_code, resp.json()["error"]["code"]
        if (resp.status_code, rec.code) != (status, code):
            rec.mismatch = f"expected {status} {code}, got {resp.status_code} {rec.code}"
        return rec
    if kind in ("stream", "plain", "disconnect", "give_up"):
        prompt = rng.choice(work.prompts())
        path, body = "/v1/completions", greedy_body(prompt)
        expected = work.solo[work.key(prompt)]
    elif kind == "chat_stream":
        messages = rng.choice(work.chats)
        path, body = "/v1/chat/completions", greedy_chat(messages)
        expected = work.solo[work.key(messages)]
    else:  # n > 1: seeded samples of one prompt, streamed or not
        rec.choices = rng.randint(2, 3)
        path, expected = "/v1/completions", None
        body = {"prompt": rng.choice(work.prompts()), "n": rec.choices, "max_tokens": 16, "temperature": 0.8, "seed": rng.randrange(2**32),
                "stream": rng.random() < 0.5}  # fmt: skip
    if kind in ("disconnect", "give_up"):
        body = {**body, "max_tokens": LONG_TOKENS}
    stream = kind in ("stream", "chat_stream", "disconnect") or body.get("stream", False)
    body = {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    if kind == "give_up":
        try:
            resp = await http.post(url + path, json=body, headers=auth, timeout=GIVE_UP_S)
        except httpx.TimeoutException:
            rec.disconnected = True
            return rec
        rec.status = resp.status_code  # answered within GIVE_UP_S: a rejection, or (a quiet server) all of it
        rec.code = resp.json()["error"]["code"] if resp.status_code != 200 else None
        rec.done = resp.status_code == 200
        return rec
    if not stream:
        resp = await http.post(url + path, json=body, headers=auth)
        rec.status = resp.status_code
        if resp.status_code != 200:
            rec.code = resp.json()["error"]["code"]
            return rec
        out = resp.json()
        rec.completion_tokens = out["usage"]["completion_tokens"]
        rec.done = len(out["choices"]) == rec.choices and all(c["finish_reason"] in ("stop", "length") for c in out["choices"])
        if expected is not None and out["choices"][0]["text"] != expected:
            rec.mismatch = "greedy text differs from its solo run"
        return rec
    async with http.stream("POST", url + path, json=body, headers=auth) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            rec.code = json.loads(await resp.aread())["error"]["code"]
            return rec
        texts: dict[int, str] = {}
        finished: set[int] = set()
        last = None
        async for data in sse_events(resp):
            if rec.ttft is None:
                rec.ttft = time.perf_counter() - start
            if kind == "disconnect":
                rec.disconnected = True
                return rec  # leaving the block closes the connection mid-stream
            last = data
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                rec.mismatch = f"error event: {event['error']}"
                continue
            if event.get("usage"):
                rec.completion_tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
                texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
                if choice["finish_reason"]:
                    finished.add(choice["index"])
        rec.done = last == "[DONE]" and len(finished) == rec.choices
        if not rec.done and rec.mismatch is None:
            rec.mismatch = "stream did not end with [DONE] after every choice finished"
        if expected is not None and texts.get(0) != expected:
            rec.mismatch = "streamed greedy text differs from its solo run"
    return rec


async def client(http: httpx.AsyncClient, url: str, work: Workload, name: str, until: float, records: list[Record]) -> None:
    rng = random.Random(name)
    kinds, weights = zip(*KINDS)
    count = 0
    while time.monotonic() < until:
        count += 1
        rec = await one(http, url, work, rng.choices(kinds, weights)[0], rng, f"{name}-{count}")
        records.append(rec)
        if rec.status == 503:
            await asyncio.sleep(rng.uniform(0.1, 0.5))  # back off, as a client of an overloaded server should


async def load(url: str, work: Workload, cfg: SoakConfig, seconds: float, phase: str) -> list[Record]:
    records: list[Record] = []
    # idle connections expire here before uvicorn's 5 s keep-alive closes them: reusing one the
    # server is closing at that instant reads a reset (httpx.ReadError), a race of the client's
    limits = httpx.Limits(max_connections=cfg.clients * 2, max_keepalive_connections=cfg.clients, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        until = time.monotonic() + seconds
        await asyncio.gather(*(client(http, url, work, f"{phase}{cfg.seed}-c{i}", until, records) for i in range(cfg.clients)))
    return records


# ---------------------------------------------------------------------------- the soak
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


@dataclass
class SoakReport:
    config: dict
    duration_s: float
    requests: int
    completed: int
    disconnected: int
    disconnected_outcomes: dict[str, int]  # what the server's log says became of the requests clients left
    rejected: dict[str, int]  # "status code" -> count
    server_errors: int  # 5xx other than the documented 503 overloaded
    unfinished_streams: int  # 200 streams (not left on purpose) without [DONE]
    mismatches: list[str]
    blocks_leaked: int
    num_preemptions: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    generated_tokens_per_s: float
    client_completion_tokens: int
    health_worst_s: float
    health_polls: int
    health_failures: int
    rss_after_warmup_mib: float
    rss_end_mib: float
    rss_samples: list[tuple[float, float]]  # (seconds into the measured load, server RSS in MiB)
    counters: dict[str, tuple[float, float]]  # metric -> (server delta, what clients saw)
    log_problems: list[str] = field(default_factory=list)
    # clients that left leaving no line in the server's log: finished there first (a success), or never read by it
    # (gone before the server took the request off the socket: nothing to count); request_success_total may fall short by these
    untraced: int = 0

    @property
    def rss_growth(self) -> float:
        return self.rss_end_mib / self.rss_after_warmup_mib - 1

    @property
    def rss_slope_mib_per_1k(self) -> float:
        """The server's RSS change after warm-up per 1,000 requests sent (a leak shows as a slope)."""
        return (self.rss_end_mib - self.rss_after_warmup_mib) / max(1, self.requests) * 1000

    def rss_half_slopes_mib_per_1k(self) -> tuple[float, float] | None:
        """Least-squares RSS slope per 1,000 requests over the first and the second half of the measured load (requests
        taken as even in time): growth that levels off shows as a second slope near zero. None under 8 samples."""
        if len(self.rss_samples) < 8:
            return None
        per_request_s = self.duration_s / max(1, self.requests)
        half = len(self.rss_samples) // 2
        return tuple(least_squares_slope(part) * per_request_s * 1000 for part in (self.rss_samples[:half], self.rss_samples[half:]))

    def failures(self) -> list[str]:
        problems = []
        if self.server_errors:
            problems.append(f"{self.server_errors} 5xx other than 503 overloaded")
        if self.unfinished_streams:
            problems.append(f"{self.unfinished_streams} streams without [DONE]")
        problems += self.mismatches
        if self.blocks_leaked:
            problems.append(f"{self.blocks_leaked} KV blocks not free at the end")
        if self.num_preemptions == 0:
            problems.append("the pool never forced a preemption")
        for name, (server, clients) in self.counters.items():
            slack = self.untraced if name == "request_success_total" else 0
            if not clients - slack <= server <= clients:
                problems.append(f"{name}: server counted {server:g}, clients saw {clients:g}" + (f" ({slack} untraced)" if slack else ""))
        if abs(self.rss_growth) > 0.10:
            problems.append(f"RSS moved {self.rss_growth:+.1%} from after warm-up")
        if self.health_worst_s >= 1.0 or self.health_failures:
            problems.append(f"/health: worst {self.health_worst_s:.3f} s, {self.health_failures} failures")
        return problems + self.log_problems

    def table(self) -> str:
        rejected = ", ".join(f"{k}: {v}" for k, v in sorted(self.rejected.items())) or "none"
        rows = [
            ("requests", f"{self.requests:,}"),
            ("completed", f"{self.completed:,}"),
            ("disconnected (left mid-stream or gave up)", f"{self.disconnected:,} ("
             + ", ".join(f"{v:,} {k}" for k, v in sorted(self.disconnected_outcomes.items())) + ")"),
            ("rejected, by status and code", rejected),
            ("5xx other than 503 overloaded", str(self.server_errors)),
            ("KV blocks leaked", str(self.blocks_leaked)),
            ("preemptions", f"{self.num_preemptions:,}"),
            ("TTFT p50 / p99 (streams)", f"{self.ttft_p50_s:.3f} s / {self.ttft_p99_s:.3f} s"),
            ("generated tokens/s (server counter)", f"{self.generated_tokens_per_s:.1f}"),
            ("worst /health latency", f"{self.health_worst_s * 1000:.0f} ms ({self.health_polls:,} polls)"),
            ("server RSS after warm-up / at the end", f"{self.rss_after_warmup_mib:.0f} MiB / {self.rss_end_mib:.0f} MiB "
                                                      f"({self.rss_growth:+.1%}; {self.rss_slope_mib_per_1k:+.2f} MiB per 1,000 requests)"),  # fmt: skip
        ]
        if halves := self.rss_half_slopes_mib_per_1k():
            rows.append(("RSS slope, first / second half of the load", f"{halves[0]:+.2f} / {halves[1]:+.2f} MiB per 1,000 requests "
                         f"({len(self.rss_samples)} samples, every {RSS_SAMPLE_S:.0f} s)"))  # fmt: skip
        return "| figure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def run_soak(cfg: SoakConfig) -> SoakReport:
    model = cfg.model or str(tiny_model())
    log_path = Path(tempfile.mkstemp(prefix="kvserve-soak-", suffix=".log")[1])
    proc, url = start_server(cfg, model, log_path)
    ctx = multiprocessing.get_context("fork")
    stop, result = ctx.Event(), ctx.Queue()
    poller = None
    try:
        work = Workload(cfg.seed)

        async def warm_up() -> list[Record]:
            async with httpx.AsyncClient(timeout=300) as http:
                await work.run_solo(http, url)
            return await load(url, work, cfg, cfg.warmup, "warm")

        warm = asyncio.run(warm_up())
        before = wait_idle(url)
        rss_warm = rss_bytes(proc.pid)
        if cfg.tracemalloc:
            proc.send_signal(signal.SIGUSR1)
        poller = ctx.Process(target=poll_health, args=(url, proc.pid, stop, result), daemon=True)
        poller.start()
        start = time.monotonic()
        records = asyncio.run(load(url, work, cfg, cfg.duration, "soak"))
        elapsed = time.monotonic() - start
        stop.set()
        health = result.get(timeout=60)
        after = wait_idle(url)
        rss_end = rss_bytes(proc.pid)
        if cfg.tracemalloc:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(30)  # a snapshot of a big heap takes a while
        log = log_path.read_text()
    finally:
        stop.set()
        if poller is not None:
            poller.join(timeout=10)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_path.unlink(missing_ok=True)
    return report(cfg, records, warm, before, after, elapsed, health, rss_warm, rss_end, log)


_REJECTED = re.compile(r"kvserve\.server: rejected (\S+) \S+ \S+: (\d+) (\S+):")
_ABORTED = re.compile(r"kvserve\.server\.\w+: aborted (\S+): (\S+):")


def server_outcomes(log: str) -> tuple[dict[str, list[tuple[int, str]]], dict[str, list[str]]]:
    """The server's log lines by request id: (status, code) of each rejection, reason of each abort."""
    rejected: dict[str, list[tuple[int, str]]] = {}
    aborted: dict[str, list[str]] = {}
    for line in log.splitlines():
        if m := _REJECTED.search(line):
            rejected.setdefault(m.group(1), []).append((int(m.group(2)), m.group(3)))
        elif m := _ABORTED.search(line):
            aborted.setdefault(m.group(1), []).append(m.group(2))
    return rejected, aborted


def report(cfg, records, warm, before, after, elapsed, health, rss_warm, rss_end, log) -> SoakReport:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    rejected_log, aborted_log = server_outcomes(log)
    problems = [f"server log has {w!r}" for w in ("Traceback", "Task exception", "CancelledError", "Exception in ASGI") if w in log]
    # what each request came to: what its client saw, and for those it left, what the server's log says
    expect_rejected: Counter = Counter()
    expect_aborted = expect_success = 0
    left: Counter = Counter()
    for r in records:
        logged_r, logged_a = rejected_log.get(r.rid, []), aborted_log.get(r.rid, [])
        if r.status >= 400:
            expect_rejected[r.code] += 1
            if logged_r != [(r.status, r.code)] or logged_a:
                problems.append(f"{r.rid} ({r.kind}): client saw {r.status} {r.code}, server logged {logged_r} {logged_a}")
        elif r.status == 200 and r.done:
            expect_success += r.choices
            if logged_r or logged_a:
                problems.append(f"{r.rid} ({r.kind}) completed, but the server logged {logged_r} {logged_a}")
        elif r.disconnected:
            if len(logged_r) + len(logged_a) > 1 or any(reason != "client_disconnected" for reason in logged_a):
                problems.append(f"{r.rid} ({r.kind}) left: server logged {logged_r} {logged_a}")
            elif logged_a:
                left["aborted"] += 1
                expect_aborted += 1
            elif logged_r:
                left["rejected before the client heard"] += 1
                expect_rejected[logged_r[0][1]] += 1
            else:
                left["finished on the server first, or never read"] += 1
                expect_success += 1
    rejected = Counter(f"{r.status} {r.code}" for r in records if r.status >= 400)
    completed = [r for r in records if r.status == 200 and r.done]
    streams_left = [r for r in records if r.status == 200 and not r.done and not r.disconnected]
    codes = {n[len("kvserve:request_rejected_total{"):-1] for n in after if n.startswith("kvserve:request_rejected_total{")}
    counters = {f"request_rejected_total{{reason={code}}}": (delta(f"kvserve:request_rejected_total{{{code}}}"), float(expect_rejected[code]))
                for code in sorted(set(expect_rejected) | codes)}  # fmt: skip
    counters["request_aborted_total"] = (delta("kvserve:request_aborted_total"), float(expect_aborted))
    counters["request_success_total"] = (delta("kvserve:request_success_total"), float(expect_success))
    ttfts = [r.ttft for r in records if r.ttft is not None]
    return SoakReport(
        config=asdict(cfg),
        duration_s=elapsed,
        requests=len(records),
        completed=len(completed),
        disconnected=sum(r.disconnected for r in records),
        disconnected_outcomes=dict(left),
        rejected=dict(rejected),
        server_errors=sum(r.status >= 500 and not (r.status == 503 and r.code == "overloaded") for r in records),
        unfinished_streams=len(streams_left),
        mismatches=[f"{r.rid} ({r.kind}): {r.mismatch}" for r in warm + records if r.mismatch],
        blocks_leaked=int(after["kvserve:kv_cache_blocks_total"] - after["kvserve:kv_cache_blocks_free"]),
        num_preemptions=int(delta("kvserve:num_preemptions_total")),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        generated_tokens_per_s=delta("kvserve:generation_tokens_total") / elapsed,
        client_completion_tokens=sum(r.completion_tokens for r in records),
        health_worst_s=health["worst"],
        health_polls=health["count"],
        health_failures=health["failures"],
        rss_after_warmup_mib=rss_warm / 2**20,
        rss_end_mib=rss_end / 2**20,
        rss_samples=[tuple(p) for p in health["rss"]],
        counters=counters,
        untraced=left["finished on the server first, or never read"],
        log_problems=problems,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = SoakConfig()
    parser.add_argument("--model", default=None, help="model to serve (default: the tests' tiny random Llama)")
    parser.add_argument("--duration", type=float, default=defaults.duration, help="seconds of measured load")
    parser.add_argument("--warmup", type=float, default=defaults.warmup, help="seconds of the same load before measuring")
    parser.add_argument("--clients", type=int, default=defaults.clients, help="concurrent clients")
    parser.add_argument("--num-kv-blocks", type=int, default=defaults.num_kv_blocks, help="KV blocks of 16 tokens")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-waiting-requests", type=int, default=defaults.max_waiting_requests)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--tracemalloc", default=None, metavar="FILE",
                        help="run the server under tracemalloc (slower) and write where traced Python memory grew after warm-up to FILE")
    args = parser.parse_args()
    cfg = SoakConfig(**{k: v for k, v in vars(args).items() if k != "json"})
    rep = run_soak(cfg)
    print(rep.table())
    failures = rep.failures()
    for problem in failures:
        print(f"FAIL: {problem}")
    if args.json:
        Path(args.json).write_text(json.dumps({**asdict(rep), "rss_slope_mib_per_1k": rep.rss_slope_mib_per_1k,
                                               "rss_half_slopes_mib_per_1k": rep.rss_half_slopes_mib_per_1k(), "failures": failures}, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
