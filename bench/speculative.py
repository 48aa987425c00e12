"""Speculative decoding (n-gram prompt lookup) against plain decoding, same engine settings, one process.

Workloads, each on an engine with and one without `speculative_config`, in alternating rounds:
- edit: one stream, a 50-line stdlib function (json.decoder.py_scanstring, docstring removed) and
  "add a docstring, return the whole function" through the chat template: the answer copies the prompt.
- chat: one stream, free writing ("write a short story..."), greedy: little to copy at first, but a
  0.5B model's greedy story falls into repeating itself, which the guesses then copy.
- chat-sampled: the same at the API's default temperature 1.0 (seeded): little to copy.
- batch16 / batch64: 16 or 64 concurrent edit and chat requests (half each), generated tok/s over the job.
Greedy (temperature 0) but chat-sampled (seeded): the tokens must be the same, and the script checks they are. Prints each
workload's median tok/s with and without, the median of each round's ratio (the two runs of a
round are neighbours in time: this machine's speed drifts between minutes), and the acceptance rate.

    .venv/bin/python bench/speculative.py [--model qwen2.5-coder-0.5b-instruct] [--rounds 3] [--k 4]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvserve import LLM, SamplingParams  # noqa: E402


def edit_prompt() -> str:
    import json.decoder

    source = re.sub(r'\n\s*""".*?"""', "", inspect.getsource(json.decoder.py_scanstring), flags=re.S)
    return f"Add a docstring to this Python function. Return the whole function, unchanged otherwise.\n\n```python\n{source}```"


CHAT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def decode_tps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Generated tokens per second: one stream's from its first token to its last; a batch's over the whole job."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.token_ids for o in outs]
    if len(outs) == 1:
        m = outs[0].metrics
        return (len(tokens[0]) - 1) / (m["last_token_time"] - m["first_token_time"]), tokens
    return sum(map(len, tokens)) / elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=1024, help="one stream's (the edit answer ends before: about 620 tokens)")
    parser.add_argument("--batch-max-tokens", type=int, default=128, help="each request's in batch16 / batch64")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--disable-by-batch-size", type=int, default=None, help="speculative_config's (0: null, always guess; default: ours)")
    parser.add_argument("--workloads", nargs="+", default=["edit", "chat", "chat-sampled", "batch16", "batch64"])
    args = parser.parse_args()
    common = dict(kv_cache_memory=2.0, threads=args.threads)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = None if args.disable_by_batch_size == 0 else args.disable_by_batch_size
    engines = {"plain": LLM(args.model, **common), "ngram": LLM(args.model, speculative_config=spec, **common)}
    tok = engines["plain"].tokenizer
    template = lambda text: tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)  # noqa: E731
    edit, chat = template(edit_prompt()), template(CHAT_PROMPT)
    workloads = {"edit": [edit], "chat": [chat], "chat-sampled": [chat], "batch16": [edit, chat] * 8, "batch64": [edit, chat] * 32}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    batch_params = SamplingParams(max_tokens=args.batch_max_tokens, temperature=0)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1)
    print(f"model {args.model}, ngram k={args.k}, edit prompt {len(edit)} tokens, chat prompt {len(chat)} tokens, "
          f"max_tokens {args.max_tokens} (one stream) / {args.batch_max_tokens} (batches), {args.rounds} rounds, "
          f"disable_by_batch_size {engines['ngram'].engine.speculator.config.disable_by_batch_size}")  # fmt: skip
    rows = []
    for name in args.workloads:
        prompts = workloads[name]
        speeds: dict[str, list[float]] = {"plain": [], "ngram": []}
        outputs: dict[str, list] = {}
        stats = engines["ngram"].engine.speculator.stats
        drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
        for r in range(args.rounds):
            for which in (("plain", "ngram") if r % 2 == 0 else ("ngram", "plain")):
                sp = sampled if name == "chat-sampled" else params if len(prompts) == 1 else batch_params
                tps, tokens = decode_tps(engines[which], prompts, sp)
                speeds[which].append(tps)
                outputs[which] = tokens
        same = outputs["plain"] == outputs["ngram"]
        plain, ngram = statistics.median(speeds["plain"]), statistics.median(speeds["ngram"])
        # the machine's speed drifts by 30% between minutes: each round's two runs are neighbours, so the ratio is their median ratio
        paired = statistics.median(n / p for p, n in zip(speeds["plain"], speeds["ngram"]))
        rate = (stats.num_accepted_tokens - accepted) / max(1, stats.num_draft_tokens - drafted)
        gen = sum(map(len, outputs["plain"])) // len(prompts)
        rows.append({"workload": name, "requests": len(prompts), "mean_generated": gen, "plain_tok_s": plain, "ngram_tok_s": ngram,
                     "ratio": paired, "acceptance": rate, "same_tokens": same})  # fmt: skip
        print("  per round:", {k: [round(x, 1) for x in v] for k, v in speeds.items()}, flush=True)
        print(f"{name:8s} {len(prompts):3d} req, {gen:4d} tokens each: plain {plain:7.1f} tok/s, ngram {ngram:7.1f} tok/s, "
              f"ratio {paired:5.2f}x (median of rounds), acceptance {rate:.2f}, same tokens: {same}", flush=True)  # fmt: skip
        if not same:
            print("  the tokens differ: speculation must not change greedy output", file=sys.stderr)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
