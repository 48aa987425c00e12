"""Online serving load: Poisson arrivals against a real `kvserve serve`, streaming, several rates.

Prompt and output lengths follow a seeded chat-like distribution (log-normal, clipped), prompts are
slices of real prose. Reports throughput, TTFT p50/p95 and TPOT p50/p95 per rate.

    .venv/bin/python bench/serve.py --rates 0.25,0.5,1 --requests 24
    .venv/bin/python bench/serve.py --url http://127.0.0.1:8000   # against a server already running
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from common import prose_token_ids  # noqa: E402


def chat_like_lengths(rng: random.Random) -> tuple[int, int]:
    prompt = int(min(max(rng.lognormvariate(5.0, 0.6), 16), 1024))  # median ~150 tokens
    output = int(min(max(rng.lognormvariate(4.3, 0.5), 8), 256))  # median ~75 tokens
    return prompt, output


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one_request(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    stamps = []
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code}
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    end = time.perf_counter()
    ttft = stamps[0] - start if stamps else float("nan")
    tpot = (stamps[-1] - stamps[0]) / (max_tokens - 1) if len(stamps) > 1 else float("nan")
    return {"status": 200, "ttft": ttft, "tpot": tpot, "latency": end - start, "tokens": max_tokens}


async def run_rate(url: str, rate: float, workload: list[tuple[list[int], int]], seed: int) -> dict:
    rng = random.Random(seed)
    results = []
    bar = tqdm(total=len(workload), desc=f"rate {rate}/s", unit="req")
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as http:
        tasks = []
        start = time.perf_counter()
        for prompt, out in workload:
            task = asyncio.ensure_future(one_request(http, url, prompt, out))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    bar.close()
    ok = [r for r in results if r["status"] == 200]
    return {
        "rate": rate,
        "completed": len(ok),
        "rejected": len(results) - len(ok),
        "throughput_tok_s": sum(r["tokens"] for r in ok) / elapsed,
        "ttft_p50": percentile([r["ttft"] for r in ok], 50),
        "ttft_p95": percentile([r["ttft"] for r in ok], 95),
        "tpot_p50": percentile([r["tpot"] for r in ok], 50),
        "tpot_p95": percentile([r["tpot"] for r in ok], 95),
    }


def _launch(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", model, "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for line in proc.stdout:
        if line.startswith("kvserve: serving"):
            url = line.split(" on ")[1].split()[0]
            break
    else:
        raise RuntimeError("server did not start")
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="an already running server; default: start one")
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--rates", default="0.25,0.5,1.0", help="comma-separated request rates (req/s)")
    parser.add_argument("--requests", type=int, default=24, help="requests per rate")
    parser.add_argument("--seed", type=int, default=0)
    args, server_flags = parser.parse_known_args()

    from kvserve.model.registry import resolve_model_path
    from kvserve.model.tokenizer import load_tokenizer
    from kvserve.model.loader import load_checkpoint

    path = resolve_model_path(args.model)
    tok = load_tokenizer(path, load_checkpoint(path).config.architecture)
    ids = prose_token_ids(tok)
    rng = random.Random(args.seed)
    workload = []
    for _ in range(args.requests):
        p, o = chat_like_lengths(rng)
        s = rng.randrange(0, len(ids) - p)
        workload.append((ids[s : s + p], o))

    proc = None
    url = args.url
    if url is None:
        proc, url = _launch(args.model, server_flags)
    try:
        rows = [asyncio.run(run_rate(url, float(r), workload, args.seed)) for r in args.rates.split(",")]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print("\n| rate (req/s) | completed | throughput (gen tok/s) | TTFT p50 | TTFT p95 | TPOT p50 | TPOT p95 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rate']} | {r['completed']} | {r['throughput_tok_s']:.1f} | {r['ttft_p50']:.2f} s | {r['ttft_p95']:.2f} s "
              f"| {r['tpot_p50'] * 1000:.0f} ms | {r['tpot_p95'] * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
