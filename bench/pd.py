"""Disaggregated prefill on this machine: decode streams while long prompts arrive, served by one
instance doing both against a producer + consumer pair behind `kvserve pd-proxy`, sharing a Redis.

Workload: `--streams` decode requests (short prompts, `--decode-tokens` tokens each, streamed) run
from the start; meanwhile `--long` requests of `--long-tokens`-token prompts (real prose, each a
different slice) arrive one every `--gap` seconds and ask for 16 tokens. Reported per setup: the
decode streams' inter-token latency p50/p99 and the long requests' TTFT p50/p99, and the whole
job's generated tok/s.

The single instance gets both cores. The pair is pinned one core each (taskset, one OpenMP
thread): the producer prefills, the consumer decodes and loads prompts from Redis.

    .venv/bin/python bench/pd.py                            # Gemma 3 270M, 4 streams, 4 x 4K prompts
    .venv/bin/python bench/pd.py --model smollm2-135m-instruct --long-tokens 2048
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import percentile, prose_token_ids  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from server_process import launch_server, stop_server  # noqa: E402


async def stream(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of a streamed request's chunks, the request's start first."""
    stamps = [time.perf_counter()]
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    return stamps


async def workload(url: str, ids: list[int], args) -> dict:
    async with httpx.AsyncClient(timeout=600) as http:
        await stream(http, url, ids[:64], 4)  # warm-up
        decodes = [asyncio.ensure_future(stream(http, url, ids[100 * i : 100 * i + 48], args.decode_tokens)) for i in range(args.streams)]
        longs = []
        start = time.perf_counter()
        for i in range(args.long):
            await asyncio.sleep(max(0.0, start + 1.0 + i * args.gap - time.perf_counter()))
            offset = 5000 + i * (args.long_tokens + 500)
            longs.append(asyncio.ensure_future(stream(http, url, ids[offset : offset + args.long_tokens], 16)))
        decoded = await asyncio.gather(*decodes)
        answered = await asyncio.gather(*longs)
        seconds = time.perf_counter() - start
    gaps = [b - a for s in decoded for a, b in zip(s[1:], s[2:])]
    ttfts = [s[1] - s[0] for s in answered]
    generated = sum(len(s) - 1 for s in (*decoded, *answered))
    return {"itl50": percentile(gaps, 50), "itl99": percentile(gaps, 99), "ttft50": percentile(ttfts, 50), "ttft99": percentile(ttfts, 99),
            "tok_s": generated / seconds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=4096)
    parser.add_argument("--gap", type=float, default=3.0, help="seconds between long prompts")
    args = parser.parse_args()
    from kvserve.engine.llm import LLM

    tokenizer = LLM(args.model, num_kv_blocks=16).tokenizer
    ids = prose_token_ids(tokenizer)
    while len(ids) < 5000 + args.long * (args.long_tokens + 500):
        ids += ids
    common = ["--model", args.model, "--port", "0", "--max-model-len", str(args.long_tokens + 256), "--kv-cache-memory", "2"]
    one_core = {"OMP_NUM_THREADS": "1"}
    kvserve = [sys.executable, "-m", "kvserve.cli"]
    rows = []
    with RedisServer(maxmemory="4gb") as redis_server:
        proc, url = launch_server(common, timeout=300)
        try:
            rows.append(("one instance (2 cores)", asyncio.run(workload(url, ids, args))))
        finally:
            stop_server(proc)
        remote = ["--kv-remote-url", redis_server.url]
        producer, producer_url = launch_server([*common, *remote, "--kv-role", "producer"], command=["taskset", "-c", "0", *kvserve],
                                               env=one_core, timeout=300)  # fmt: skip
        consumer, consumer_url = launch_server([*common, *remote, "--kv-role", "consumer"], command=["taskset", "-c", "1", *kvserve],
                                               env=one_core, timeout=300)  # fmt: skip
        proxy, proxy_url = launch_server(["--prefill", producer_url, "--decode", consumer_url, "--port", "0"], subcommand="pd-proxy")
        try:
            rows.append(("producer + consumer (1 core each)", asyncio.run(workload(proxy_url, ids, args))))
            hits = httpx.get(consumer_url + "/metrics").text
            handed = [line for line in hits.splitlines() if line.startswith("kvserve:kv_tier_hit_tokens_total{") and 'tier="remote"' in line]
        finally:
            for p in (proxy, producer, consumer):
                stop_server(p)
    print(f"{args.model}: {args.streams} decode streams x {args.decode_tokens} tokens; {args.long} prompts of {args.long_tokens:,} "
          f"tokens, one every {args.gap:g} s\n")  # fmt: skip
    print("| setup | decode ITL p50 (ms) | decode ITL p99 (ms) | long TTFT p50 (s) | long TTFT p99 (s) | tok/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in rows:
        print(f"| {label} | {r['itl50'] * 1e3:.1f} | {r['itl99'] * 1e3:.1f} | {r['ttft50']:.2f} | {r['ttft99']:.2f} | {r['tok_s']:.1f} |")
    print(f"\nconsumer's prompt tokens loaded from Redis: {handed[0].rsplit(' ', 1)[1] if handed else 0}")


if __name__ == "__main__":
    main()
