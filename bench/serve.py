"""Online serving load: Poisson arrivals against a real `kvserve serve`, streaming, several rates.

Prompt and output lengths follow a seeded chat-like distribution (log-normal, clipped), prompts are
slices of real prose. Each rate runs greedy and at the API's default sampling (temperature 1.0,
top-p 1.0: the request sends no sampling field). Reports throughput, TTFT p50/p95 and TPOT
p50/p95 per rate and setting.

    .venv/bin/python bench/serve.py --rates 0.25,0.5,1 --requests 24
    .venv/bin/python bench/serve.py --url http://127.0.0.1:8000   # against a server already running
    .venv/bin/python bench/serve.py --stream-overhead 4000          # streaming's host cost per step

--stream-overhead N serves a tiny random model that uses Gemma 3's tokenizer (262K tokens; the
model's own time stays small, so host work shows) and runs 64 concurrent requests of N output
tokens streamed, then 64 not streamed: the difference of their mean time per step is what
streaming (incremental detokenization, SSE chunks) adds to every step.
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


SETTINGS = {"greedy": {"temperature": 0}, "API default (temperature 1.0)": {}}


async def one_request(
    http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, sampling: dict, stream: bool = True, light: bool = False
) -> dict:
    """One request's timings; `light` skips parsing the chunks' JSON (the client shares the server's cores)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True, **sampling}
    start = time.perf_counter()
    stamps = []
    if not stream:
        resp = await http.post(url + "/v1/completions", json=body)
        end = time.perf_counter()
        return {"status": resp.status_code, "latency": end - start, "tokens": max_tokens}
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code}
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and (not light or '"text": ""' not in line):
                if light or json.loads(line[6:])["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    end = time.perf_counter()
    ttft = stamps[0] - start if stamps else float("nan")
    tpot = (stamps[-1] - stamps[0]) / (max_tokens - 1) if len(stamps) > 1 else float("nan")
    return {"status": 200, "ttft": ttft, "tpot": tpot, "latency": end - start, "tokens": max_tokens}


async def run_rate(url: str, rate: float, workload: list[tuple[list[int], int]], seed: int, sampling: dict) -> dict:
    rng = random.Random(seed)
    results = []
    bar = tqdm(total=len(workload), desc=f"rate {rate}/s", unit="req")
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as http:
        tasks = []
        start = time.perf_counter()
        for prompt, out in workload:
            task = asyncio.ensure_future(one_request(http, url, prompt, out, sampling))
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


def tiny_gemma_tokenizer_model(root: Path) -> Path:
    """A 2-layer random Gemma 3 text model (hidden 64) over Gemma 3 270M's real tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from kvserve.model.registry import resolve_model_path
    from kvserve.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path("gemma-3-270m"), "gemma3")
    config = Gemma3TextConfig(vocab_size=len(tokenizer._tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=8192,
                              sliding_window=512, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root)
    tokenizer._tok.save_pretrained(root)
    shutil.rmtree(root / "chat_template.jinja", ignore_errors=True)
    return root


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of a server's threads by role: the event loop (HTTP, SSE), the engine thread
    (scheduling, the model's Python side, detokenization) and the kernels' worker threads."""
    roles = {"event loop": 0.0, "engine": 0.0, "kernel workers": 0.0}
    threads = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            head, fields = (task / "stat").read_text().rsplit(")", 1)
        except OSError:
            continue  # a thread that ended
        fields = fields.split()
        threads.append((int(task.name), head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")))
    # the kernels' threads start from the engine thread and inherit its name: the engine thread is the first
    engine = min((tid for tid, name, _ in threads if name.startswith("kvserve-engine")), default=None)
    for tid, _, seconds in threads:
        roles["event loop" if tid == pid else "engine" if tid == engine else "kernel workers"] += seconds
    return roles


async def stream_overhead(url: str, pid: int, tokens: int, clients: int = 64) -> dict[bool, dict[str, float]]:
    """Seconds per step of `clients` concurrent requests of `tokens` output tokens each, streamed
    and not: wall time, and the server's CPU time by thread role. The clients run on the same
    cores, so wall time includes their parsing."""
    per_step = {}
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=512)) as http:
        for stream in (True, False):
            start, cpu, threads = time.perf_counter(), cpu_seconds(pid), thread_cpu_seconds(pid)
            results = await asyncio.gather(*(
                one_request(http, url, [2, 100 + i, 200 + i, 300 + i], tokens, {"temperature": 0}, stream, light=True)
                for i in range(clients)
            ))  # fmt: skip
            elapsed, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
            threads = {role: seconds - threads[role] for role, seconds in thread_cpu_seconds(pid).items()}
            assert all(r["status"] == 200 for r in results), results[:2]
            per_step[stream] = {"wall": elapsed / tokens, "server CPU": cpu / tokens, **{role: s / tokens for role, s in threads.items()}}
            print(f"{'streamed' if stream else 'not streamed'}: {clients} x {tokens} tokens in {elapsed:.1f} s, "
                  + ", ".join(f"{key} {value * 1000:.2f}" for key, value in per_step[stream].items()) + " ms per step", flush=True)
    return per_step


def _launch(model: str, extra: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", model, "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
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
    parser.add_argument("--stream-overhead", type=int, default=0, metavar="TOKENS",
                        help="measure streaming's host cost per step at this many output tokens (tiny model, Gemma tokenizer)")
    args, server_flags = parser.parse_known_args()

    if args.stream_overhead:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            model = tiny_gemma_tokenizer_model(Path(tmp))
            flags = ["--max-model-len", str(args.stream_overhead + 64), "--max-num-seqs", "64", *server_flags]
            # idle kernel threads sleep instead of spinning, so CPU time counts work, not waiting for the client's share of the cores
            proc, url = _launch(str(model), flags, {"OMP_WAIT_POLICY": "PASSIVE"})
            try:
                per_step = asyncio.run(stream_overhead(url, proc.pid, args.stream_overhead))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        keys = list(per_step[True])
        print(f"\n| 64 requests x {args.stream_overhead} tokens | " + " | ".join(f"{key} ms/step" for key in keys) + " |")
        print("|---|" + "---:|" * len(keys))
        for label, row in (("not streamed", per_step[False]), ("streamed", per_step[True])):
            print(f"| {label} | " + " | ".join(f"{row[key] * 1000:.2f}" for key in keys) + " |")
        print("| streaming adds | " + " | ".join(f"{(per_step[True][key] - per_step[False][key]) * 1000:.2f}" for key in keys) + " |")
        host = sum(per_step[True][key] - per_step[False][key] for key in ("event loop", "engine"))
        print(f"host time streaming adds per step (event loop + engine thread): {host * 1000:.2f} ms")
        return

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
        rows = []
        for r in args.rates.split(","):
            for name, sampling in SETTINGS.items():
                # every run computes its prompts: the same workload would otherwise come from the prefix cache after the first
                httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()
                rows.append((name, asyncio.run(run_rate(url, float(r), workload, args.seed, sampling))))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print("\n| rate (req/s) | sampling | completed | throughput (gen tok/s) | TTFT p50 | TTFT p95 | TPOT p50 | TPOT p95 |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {r['rate']} | {name} | {r['completed']} | {r['throughput_tok_s']:.1f} | {r['ttft_p50']:.2f} s | {r['ttft_p95']:.2f} s "
              f"| {r['tpot_p50'] * 1000:.0f} ms | {r['tpot_p95'] * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
