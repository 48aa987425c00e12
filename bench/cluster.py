"""Scale-out: two kvserve replicas behind smg (`kvserve cluster`), cache_aware against round_robin,
without and with the shared Redis tier; and what the router costs a request.

Workload (seeded, the same for every setup): `--tenants` tenants, each with its own long prefix
(a distinct slice of real prose, `--prefix-chars` characters: about a quarter as many tokens),
each asked `--questions` questions, in a shuffled order by `--concurrency` clients, streamed,
`--max-tokens` tokens each. Each replica's pool (`--kv-cache-memory`) holds about half of the
tenants' prefixes: all of them do not fit in one replica, their half does. Reported per setup:
the share of prompt tokens served from a cache (the replicas' pools, and the Redis tier), TTFT
p50/p99, and generated tok/s over the job. Then the router's overhead: the median latency of a
one-token request sent to a replica directly and through smg, the replicas idle.

    .venv/bin/python bench/cluster.py                     # Gemma 3 270M, 8 tenants x 5 questions
    .venv/bin/python bench/cluster.py --model smollm2-135m-instruct --kv-cache-memory 0.1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import PROSE_FILES, percentile  # noqa: E402
from redis_server import RedisServer  # noqa: E402


def metrics(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("kvserve:"):
            name, _, value = line.rpartition(" ")
            key = re.sub(r"\{.*\}", "", name) + ("{remote}" if 'tier="remote"' in name else "")
            values[key] = values.get(key, 0.0) + float(value)
    return values


class Cluster:
    """`kvserve cluster` as a subprocess: its router URL and replicas, then SIGTERM."""

    def __init__(self, args, policy: str, remote_url: str | None) -> None:
        self.log = Path(tempfile.mkstemp(prefix="kvserve-bench-cluster-", suffix=".log")[1])
        command = [sys.executable, "-m", "kvserve.cli", "cluster", "--replicas", "2", "--router-policy", policy, "--port", "0",
                   "--model", args.model, "--kv-cache-memory", str(args.kv_cache_memory), "--served-model-name", "bench",
                   "--max-num-seqs", str(args.concurrency)]  # fmt: skip
        if remote_url is not None:
            command += ["--kv-remote-url", remote_url]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while "kvserve cluster: serving" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the cluster did not start:\n" + self.log.read_text()[-3000:])
            time.sleep(0.5)
        text = self.log.read_text()
        self.replicas = re.findall(r"kvserve cluster: replica \d+ on (\S+) ", text)
        self.url = re.search(r"kvserve cluster: serving .* on (http://\S+) ", text).group(1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.unlink(missing_ok=True)


def tenant_prefixes(count: int, chars: int) -> list[str]:
    text = " ".join(" ".join(Path(f).read_text().split()) for f in PROSE_FILES)
    if count * chars > len(text):
        raise SystemExit(f"--tenants x --prefix-chars is more than the {len(text)} characters of prose at hand")
    return [f"Document {t}:\n{text[t * chars : (t + 1) * chars]}\n\n" for t in range(count)]


async def ask(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(TTFT, tokens generated) of one streamed completion."""
    start = time.perf_counter()
    first, generated = None, 0
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"]:
                    first = first or time.perf_counter()
                    generated += 1
    return first - start, generated


async def workload(url: str, jobs: list[str], args) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in jobs:
        queue.put_nowait(prompt)
    ttfts: list[float] = []
    generated = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal generated
        while not queue.empty():
            ttft, tokens = await ask(http, url, queue.get_nowait(), args.max_tokens)
            ttfts.append(ttft)
            generated += tokens

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=900) as http:
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - start
    return {"ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99), "tok_s": generated / elapsed, "seconds": elapsed}


def run_setup(args, policy: str, remote_url: str | None, jobs: list[str]) -> dict:
    cluster = Cluster(args, policy, remote_url)
    try:
        for replica in cluster.replicas:  # warm every replica's kernels on a text no tenant shares
            httpx.post(replica + "/v1/completions", json={"model": "bench", "prompt": "Warm up. " * 20, "max_tokens": 4}, timeout=300)
        before = [metrics(u) for u in cluster.replicas]
        result = asyncio.run(workload(cluster.url, jobs, args))
        after = [metrics(u) for u in cluster.replicas]

        def moved(key: str) -> float:
            return sum(a.get(key, 0.0) - b.get(key, 0.0) for a, b in zip(after, before))

        prompt_tokens = moved("kvserve:prompt_tokens_total")
        # a prefix loaded from Redis is a prefix-cache hit once in the pool: hits count both, the tier's own counter the loads
        hits, loaded = moved("kvserve:prefix_cache_hits_total"), moved("kvserve:kv_tier_hit_tokens_total{remote}")
        split = [a["kvserve:prompt_tokens_total"] - b["kvserve:prompt_tokens_total"] for a, b in zip(after, before)]
        return {**result, "reuse": hits / prompt_tokens, "pool_reuse": (hits - loaded) / prompt_tokens, "redis_reuse": loaded / prompt_tokens,
                "prompt_tokens": prompt_tokens, "split": split}  # fmt: skip
    finally:
        cluster.stop()


def router_overhead(args) -> dict:
    """One-token requests, each sent to a replica directly and then through the router (round robin
    over the same replicas), interleaved so that both see the same machine; medians of each."""
    cluster = Cluster(args, "round_robin", None)
    try:
        body = {"model": "bench", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        direct, routed = [], []
        with httpx.Client(timeout=60) as http:

            def timed(url: str) -> float:
                start = time.perf_counter()
                assert http.post(url + "/v1/completions", json=body).status_code == 200
                return time.perf_counter() - start

            for url in [*cluster.replicas, cluster.url, cluster.url]:  # warm-up
                timed(url)
            for i in range(args.overhead_requests):
                direct.append(timed(cluster.replicas[i % len(cluster.replicas)]))
                routed.append(timed(cluster.url))
        d, r = percentile(direct, 50), percentile(routed, 50)
        return {"direct_ms": d * 1e3, "routed_ms": r * 1e3, "overhead_ms": (r - d) * 1e3}
    finally:
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--questions", type=int, default=5, help="questions per tenant")
    parser.add_argument("--prefix-chars", type=int, default=2000, help="characters of each tenant's prefix")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=float, default=0.075, help="GiB of each replica's pool")
    parser.add_argument("--overhead-requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    prefixes = tenant_prefixes(args.tenants, args.prefix_chars)
    jobs = [f"{prefixes[t]}Question {q}: what does the text above say about item {q + 1}?\nAnswer:"
            for t in range(args.tenants) for q in range(args.questions)]  # fmt: skip
    random.Random(args.seed).shuffle(jobs)
    results = {}
    for policy in ("cache_aware", "round_robin"):
        results[policy] = run_setup(args, policy, None, jobs)
        print(policy, results[policy], flush=True)
    for policy in ("cache_aware", "round_robin"):
        with RedisServer(maxmemory="1gb") as redis:
            results[f"{policy} + redis"] = run_setup(args, policy, redis.url, jobs)
        print(f"{policy} + redis", results[f"{policy} + redis"], flush=True)
    overhead = router_overhead(args)

    print(f"\n{args.model}: 2 replicas ({args.kv_cache_memory:g} GiB pool each), {args.tenants} tenants x {args.questions} "
          f"questions, ~{args.prefix_chars} characters of prefix each, {args.concurrency} clients, {args.max_tokens} tokens\n")  # fmt: skip
    print("| setup | reused prompt tokens | found in the pool | loaded from Redis | TTFT p50 | TTFT p99 | generated tok/s | prompt tokens per replica |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['reuse']:.1%} | {r['pool_reuse']:.1%} | {r['redis_reuse']:.1%} | {r['ttft_p50']:.3f} s | "
              f"{r['ttft_p99']:.3f} s | {r['tok_s']:.1f} | {' / '.join(f'{s:.0f}' for s in r['split'])} |")  # fmt: skip
    ca, rr = results["cache_aware"], results["round_robin"]
    print(f"\ncache_aware / round_robin: reuse {ca['reuse'] / max(rr['reuse'], 1e-9):.2f}x, TTFT p50 "
          f"{ca['ttft_p50'] / rr['ttft_p50']:.2f}x, tok/s {ca['tok_s'] / rr['tok_s']:.2f}x")  # fmt: skip
    print(f"router overhead: {overhead['routed_ms']:.1f} ms through smg against {overhead['direct_ms']:.1f} ms direct "
          f"(median of {args.overhead_requests} one-token requests): {overhead['overhead_ms']:+.1f} ms")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "overhead": overhead}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
