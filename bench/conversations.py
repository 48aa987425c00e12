"""Multi-turn conversations: the Responses API with the conversation's KV kept between turns
(`previous_response_id`, its blocks pinned in the pool) against the same turns sent as whole chat
histories to /v1/chat/completions (the prefix cache alone), with other traffic between turns.

Each conversation's turn is ~200 tokens of real prose (a question about it, 32 greedy tokens of
answer); conversations take turns round robin, and after every turn one unrelated long request runs
(`--other-tokens`), so between two turns of a conversation the pool sees every other conversation's
turn and as many unrelated prompts. Both modes run the same turns on a fresh server each (same
flags), streamed; reported per mode: TTFT p50 / p99 of turns 2 and on, and the share of their prompt
tokens served from the cache (usage's cached_tokens), and the share of the conversation so far (the
previous turn's prompt and answer: what a follow-up can reuse; its new turn cannot be) served from it.

    .venv/bin/python bench/conversations.py --model smollm2-135m-instruct --other-tokens 2000 --kv-cache-memory 1.25 --conversation-kv-share 0.95
    .venv/bin/python bench/conversations.py --model gemma-3-270m --other-tokens 2000 --kv-cache-memory 0.38 --conversation-kv-share 0.88
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from common import percentile  # noqa: E402

PROSE = Path("/usr/share/common-licenses")
INSTRUCTIONS = "You answer questions about licenses in one or two sentences."
# Gemma 3's turn format, for its base model file (it ships no chat template)
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
                  "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")  # fmt: skip


def turns_text(count: int, words_per_turn: int) -> list[str]:
    """`count` turns of distinct prose: licenses, then Python's own documentation (pydoc's topics)."""
    words = " ".join((PROSE / name).read_text() for name in ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-3", "Artistic")).split()
    words += " ".join(topics[key] for key in sorted(topics)).split()
    if count * words_per_turn > len(words):
        raise SystemExit(f"{count} turns of {words_per_turn} words need {count * words_per_turn} words of prose; there are {len(words)}")
    return [" ".join(words[i * words_per_turn : (i + 1) * words_per_turn]) + "\n\nWhat does this part say?" for i in range(count)]


def launch(model: str, flags: list[str]) -> tuple[subprocess.Popen, str, Path]:
    log = Path(tempfile.mkstemp(prefix="kvserve-conversations-", suffix=".log")[1])
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--model", model, "--port", "0", *flags],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        lines = [line for line in log.read_text().splitlines() if line.startswith("kvserve: serving")]
        if lines:
            url = lines[0].split(" on ")[1].split()[0]
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url, log
        if proc.poll() is not None:
            raise RuntimeError("server did not start:\n" + log.read_text()[-3000:])
        time.sleep(0.5)
    raise RuntimeError("server did not start in time")


def stream_turn(http: httpx.Client, url: str, path: str, body: dict) -> tuple[float, dict, str, str | None]:
    """(TTFT, usage, answer text, response id) of one streamed turn."""
    start, first, text, usage, rid = time.perf_counter(), None, [], None, None
    with http.stream("POST", url + path, json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if path == "/v1/responses":
                if event["type"] == "response.output_text.delta":
                    first = first or time.perf_counter()
                    text.append(event["delta"])
                elif event["type"] == "response.completed":
                    usage, rid = event["response"]["usage"], event["response"]["id"]
                    usage = {"prompt_tokens": usage["input_tokens"], "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
                             "completion_tokens": usage["output_tokens"]}  # fmt: skip
            elif event.get("choices"):
                delta = event["choices"][0]["delta"].get("content")
                if delta:
                    first = first or time.perf_counter()
                    text.append(delta)
            elif event.get("usage"):
                usage = {"prompt_tokens": event["usage"]["prompt_tokens"], "completion_tokens": event["usage"]["completion_tokens"],
                         "cached_tokens": event["usage"]["prompt_tokens_details"]["cached_tokens"]}  # fmt: skip
    return (first or time.perf_counter()) - start, usage, "".join(text), rid


def run_mode(mode: str, url: str, args, turns: list[str], others: list[str]) -> dict:
    http = httpx.Client(timeout=600)
    histories = [[{"role": "system", "content": INSTRUCTIONS}] for _ in range(args.conversations)]
    previous: list[str | None] = [None] * args.conversations
    ttft, prompt, cached, history = [], 0, 0, 0
    last: list[int] = [0] * args.conversations  # each conversation's previous prompt and answer, in tokens
    steps = args.conversations * args.turns
    with tqdm(total=steps, desc=mode, unit="turn") as bar:
        for turn in range(args.turns):
            for c in range(args.conversations):
                ask = turns[(c * args.turns + turn) % len(turns)]
                sampling = {"temperature": 0, "cache_salt": f"{mode}-{args.salt}"}
                if mode == "responses":
                    body = {"input": ask, "instructions": INSTRUCTIONS, "max_output_tokens": args.output_tokens,
                            "previous_response_id": previous[c], **sampling}  # fmt: skip
                    seconds, usage, text, previous[c] = stream_turn(http, url, "/v1/responses", body)
                else:
                    histories[c].append({"role": "user", "content": ask})
                    body = {"messages": histories[c], "max_tokens": args.output_tokens, "stream_options": {"include_usage": True}, **sampling}
                    seconds, usage, text, _ = stream_turn(http, url, "/v1/chat/completions", body)
                    histories[c].append({"role": "assistant", "content": text})
                if turn > 0:
                    ttft.append(seconds)
                    prompt += usage["prompt_tokens"]
                    cached += usage["cached_tokens"]
                    history += last[c]
                last[c] = usage["prompt_tokens"] + usage["completion_tokens"]
                # its own first words: no two unrelated requests share a block, so they take the pool's room
                other = f"Note {turn}.{c}: " + others[(turn * args.conversations + c) % len(others)]
                http.post(url + "/v1/completions", json={"prompt": other, "max_tokens": 1, "cache_salt": f"other-{args.salt}"}).raise_for_status()
                bar.update(1)
    return {"ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "reuse": cached / max(prompt, 1),
            "history_reuse": min(cached / max(history, 1), 1.0), "prompt_tokens": prompt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-words", type=int, default=150, help="words of prose per turn (~200 tokens)")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--other-tokens", type=int, default=1500, help="words of prose per unrelated request between turns")
    parser.add_argument("--kv-cache-memory", type=float, default=None, help="GiB of KV (default: the server's; pick one the traffic between turns overruns)")
    parser.add_argument("--conversation-kv-share", type=float, default=0.8)
    parser.add_argument("--flags", default="", help="more `kvserve serve` flags, in one string")
    parser.add_argument("--salt", default=str(os.getpid()))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench stops its server too (the finally below)
    turns = turns_text(args.conversations * args.turns, args.turn_words)
    words = " ".join((PROSE / name).read_text() for name in ("GPL-2", "LGPL-2.1", "GFDL-1.3", "CC0-1.0")).split()
    others = [" ".join(words[i * args.other_tokens : (i + 1) * args.other_tokens]) for i in range(len(words) // args.other_tokens)]
    flags = ["--conversation-kv-share", str(args.conversation_kv_share), *args.flags.split()]
    if args.kv_cache_memory is not None:
        flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if "gemma" in args.model:
        flags += ["--chat-template", GEMMA_TEMPLATE]
    results = {}
    for mode in ("responses", "chat"):
        proc, url, log = launch(args.model, flags)
        try:
            banner = next(line for line in log.read_text().splitlines() if line.startswith("kvserve: serving"))
            results[mode] = run_mode(mode, url, args, turns, others)
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"\n{banner}\n{args.conversations} conversations x {args.turns} turns, ~{args.turn_words} words a turn, "
          f"{args.output_tokens} tokens answered, one {args.other_tokens}-word request after each turn")
    print("| mode | TTFT p50 (s) | TTFT p99 (s) | prompt tokens from the cache | the conversation so far from the cache |\n|---|---:|---:|---:|---:|")
    for mode, r in results.items():
        print(f"| {mode} | {r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | {100 * r['reuse']:.1f}% | {100 * r['history_reuse']:.1f}% |")
    ratio = results["responses"]["ttft_p50"] / results["chat"]["ttft_p50"]
    print(f"TTFT p50 ratio (responses / chat): {ratio:.2f}x (target <= 0.3x); the conversation so far from the cache: "
          f"{100 * results['responses']['history_reuse']:.1f}% (target >= 90%)")


if __name__ == "__main__":
    main()
