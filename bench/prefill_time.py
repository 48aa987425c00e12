"""Time to prefill one long prompt: random-token prompts of each length, one greedy token each,
best of `--repeat` (a fresh prompt every time, prefix caching off). Run it in two checkouts in
turns to compare two versions of the engine on the same machine.

    .venv/bin/python bench/prefill_time.py [--model gemma-3-270m] [--lengths 2048,8192] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--lengths", default="2048,8192", help="prompt lengths in tokens")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    llm = LLM(model=args.model, enable_prefix_caching=False, max_model_len=max(lengths) + 16)
    vocab = llm.engine.model.config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0)
    print(f"{args.model}, {llm.engine.config.dtype}, best of {args.repeat}")
    print("| prompt tokens | prefill (s) | tok/s |")
    print("|---:|---:|---:|")
    for n in lengths:
        best = float("inf")
        for _ in range(args.repeat):
            prompt = [rng.randrange(100, vocab - 100) for _ in range(n)]
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        print(f"| {n} | {best:.2f} | {n / best:.0f} |")


if __name__ == "__main__":
    main()
