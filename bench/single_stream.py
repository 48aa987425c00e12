"""Single-stream decode under each sampling setting and weight format, rounds interleaved.

One request at a time (a 128-token prompt of real prose, 128 new tokens with ignore_eos), each
setting on each engine once per round, `--rounds` rounds; prints each one's median decode tok/s
(first token to last) and its ratio to the first engine's greedy median. One stream's step on
this machine moves 20-40% from run to run, so everything takes turns within a round rather than
running one after another. `--weight-dtypes gguf auto-dtype` puts the GGUF blocks beside the
weights dequantized into --dtype auto (two engines, one process).

    .venv/bin/python bench/single_stream.py [--model gemma-3-270m] [--rounds 7] [--weight-dtypes gguf auto-dtype]
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
    parser.add_argument("--weight-dtypes", nargs="+", default=["auto"],
                        help="engines to compare: auto, gguf, float32, bfloat16, or auto-dtype (--dtype auto's own dtype)")
    args = parser.parse_args()
    engines = {}
    for weight_dtype in args.weight_dtypes:
        if weight_dtype == "auto-dtype":
            from kvserve.config import EngineConfig

            weight_dtype = EngineConfig(model=args.model).dtype
        engines[weight_dtype] = LLM(args.model, kv_cache_memory=0.5, enable_prefix_caching=False, weight_dtype=weight_dtype)
    first = next(iter(engines.values()))
    prompt = make_prompts(first.tokenizer, 1, 128, 128, seed=0)[0]
    print(f"{args.model}: {args.rounds} rounds of {args.new_tokens} tokens", flush=True)
    samples: dict[tuple[str, str], list[float]] = {(w, name): [] for w in engines for name in SETTINGS}
    for _ in range(args.rounds):
        for name, sampling in SETTINGS.items():
            for weight_dtype, llm in engines.items():
                params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, seed=1, **sampling)
                samples[weight_dtype, name].append(decode_tps(llm, prompt, params))
    baseline = statistics.median(samples[next(iter(engines)), "greedy"])
    print(f"\n| weights | sampling | single-stream decode tok/s (median; min-max) | vs {next(iter(engines))} greedy |")
    print("|---|---|---:|---:|")
    for (weight_dtype, name), values in samples.items():
        median = statistics.median(values)
        print(f"| {weight_dtype} | {name} | {median:.1f} ({min(values):.1f}-{max(values):.1f}) | {median / baseline:.2f}x |")


if __name__ == "__main__":
    main()
