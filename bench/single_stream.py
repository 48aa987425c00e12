"""Single-stream decode under each sampling setting, against greedy, rounds interleaved.

One request at a time (a 128-token prompt of real prose, 128 new tokens with ignore_eos), each
setting once per round, `--rounds` rounds; prints each setting's median decode tok/s (first token
to last) and its ratio to greedy's median. One stream's step on this machine moves 20-40% from
run to run, so the settings take turns within a round rather than running one after another.

    .venv/bin/python bench/single_stream.py [--model gemma-3-270m] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from common import make_prompts  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from throughput import SETTINGS  # noqa: E402


def decode_tps(llm: LLM, prompt: list[int], params: SamplingParams) -> float:
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    m = out.metrics
    return (len(out.token_ids) - 1) / (m["last_token_time"] - m["first_token_time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_memory=0.5, enable_prefix_caching=False)
    prompt = make_prompts(llm.tokenizer, 1, 128, 128, seed=0)[0]
    print(f"{args.model}: {args.rounds} rounds of {args.new_tokens} tokens", flush=True)
    samples: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, sampling in SETTINGS.items():
            params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, seed=1, **sampling)
            samples[name].append(decode_tps(llm, prompt, params))
    greedy = statistics.median(samples["greedy"])
    print("\n| sampling | single-stream decode tok/s (median; min-max) | vs greedy |")
    print("|---|---:|---:|")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} ({min(values):.1f}-{max(values):.1f}) | {median / greedy:.2f}x |")


if __name__ == "__main__":
    main()
