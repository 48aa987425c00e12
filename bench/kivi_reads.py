"""What int4 / int2 KV costs on the paths their reads change: one long prompt's prefill, and 16
requests of 256 prompt tokens generating 128 (whole job, generated tok/s), twice: the second run
finds the prompts in the prefix cache when it is on. Run it at two commits, alternating, on a quiet
machine (docs/kv-quantization.md, "Same bits every way"):

    .venv/bin/python bench/kivi_reads.py [--model gemma-3-270m] [--kv-cache-dtype int4] [--no-prefix-caching]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvserve import LLM, SamplingParams  # noqa: E402

TEXT = Path("/usr/share/common-licenses/GPL-3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m", help="model path or alias (default: %(default)s)")
    parser.add_argument("--kv-cache-dtype", default="int4", help="KV format (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="the long prompt's tokens (default: %(default)s)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="run without the prefix cache")
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=not args.no_prefix_caching, kv_cache_memory=1.0)
    ids = llm.tokenizer.encode(TEXT.read_text())
    if len(ids) < max(args.prompt_tokens, 16 * 300):
        parser.error(f"{TEXT} has {len(ids)} tokens: too few for --prompt-tokens {args.prompt_tokens}")
    long_prompt = ids[: args.prompt_tokens]
    prompts = [ids[i * 300 : i * 300 + 256] for i in range(16)]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    decode = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate([ids[-600:]], one, use_tqdm=False)  # warm-up
    for run in ("first", "again"):
        started = time.perf_counter()
        llm.generate([long_prompt], one, use_tqdm=False)
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        llm.generate(prompts, decode, use_tqdm=False)
        rate = 16 * 128 / (time.perf_counter() - started)
        print(f"{args.kv_cache_dtype} {run}: {args.prompt_tokens}-token prefill {prefill:.2f} s; 16 x 256 -> 128: {rate:.1f} generated tok/s", flush=True)


if __name__ == "__main__":
    main()
