"""llama.cpp's own n-gram speculation on bench/speculative.py's edit and chat prompts, for comparison.

Starts `llama-server` (from a llama.cpp build: see ../shared/FACTS.md for how it is built here) on the
same GGUF file twice, without speculation and with `--spec-type ngram-simple` (lookup n-gram
--size-n, drafts of up to --size-m tokens), sends each prompt greedy through /completion as the
chat template renders it, and prints llama.cpp's own decode tok/s (timings.predicted_per_second),
their ratio, and whether the tokens are the same.

    .venv/bin/python bench/llamacpp_speculative.py --server /path/to/llama.cpp/build/bin/llama-server [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from speculative import CHAT_PROMPT, edit_prompt  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server: str, model: Path, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([server, "-m", str(model), "--port", str(port), "--host", "127.0.0.1", "-t", str(threads), "-c", "4096",
                             "-np", "1", "--no-warmup", *extra], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited: {Path(log.name).read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("llama-server never became healthy")


def complete(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int], dict]:
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "cache_prompt": False, "return_tokens": True}
    r = httpx.post(url + "/completion", json=body, timeout=600).json()
    return r["timings"]["predicted_per_second"], r.get("tokens", []), r["timings"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, help="llama-server binary")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--size-n", type=int, default=3, help="--spec-ngram-simple-size-n: the lookup n-gram")
    parser.add_argument("--size-m", type=int, default=4, help="--spec-ngram-simple-size-m: tokens drafted")
    args = parser.parse_args()
    from kvserve.model.registry import resolve_model_path
    from kvserve.model.tokenizer import load_tokenizer
    from kvserve.model.loader import gguf_index, model_config_from_index

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path, model_config_from_index(gguf_index(path)).architecture)
    prompts = {"edit": tokenizer.apply_chat_template([{"role": "user", "content": edit_prompt()}], add_generation_prompt=True),
               "chat": tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True)}  # fmt: skip
    spec = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.size_n), "--spec-ngram-simple-size-m", str(args.size_m),
            "--spec-draft-n-max", str(args.size_m)]  # fmt: skip
    rows = []
    servers = {"plain": start(args.server, path, args.threads, []), "ngram": start(args.server, path, args.threads, spec)}
    try:
        for name, prompt in prompts.items():
            speeds: dict[str, list[float]] = {"plain": [], "ngram": []}
            tokens: dict[str, list[int]] = {}
            for r in range(args.rounds):
                for which in ("plain", "ngram") if r % 2 == 0 else ("ngram", "plain"):
                    tps, toks, _ = complete(servers[which][1], prompt, args.max_tokens)
                    speeds[which].append(tps)
                    tokens[which] = toks
            plain, ngram = statistics.median(speeds["plain"]), statistics.median(speeds["ngram"])
            row = {"workload": name, "plain_tok_s": plain, "ngram_tok_s": ngram, "ratio": ngram / plain,
                   "generated": len(tokens["plain"]), "same_tokens": tokens["plain"] == tokens["ngram"]}  # fmt: skip
            rows.append(row)
            print(f"llama.cpp {name}: {row['generated']} tokens, plain {plain:.1f} tok/s, ngram-simple n={args.size_n} m={args.size_m} "
                  f"{ngram:.1f} tok/s, ratio {ngram / plain:.2f}x, same tokens: {row['same_tokens']}", flush=True)  # fmt: skip
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
