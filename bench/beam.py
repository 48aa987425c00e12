"""Beam search (width W) against W independent sequences of the same prompt: KV blocks at peak and speed.

Per prompt length and output length: one beam search of width W (LLM.beam_search, ignore_eos so
every beam runs to max_tokens) and W independent greedy requests of the same prompt (prefix caching
off, so nothing is shared: what W separate sequences cost), each on a fresh engine. Prints the
peak blocks in use of each and their ratio, and the beams' computed tokens per second (W rows a
step) beside the W sequences' generated tokens per second.

    .venv/bin/python bench/beam.py [--model gemma-3-270m] [--width 4] [--prompt-len 512] [--max-tokens 64 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from common import make_prompts  # noqa: E402
from kvserve import LLM, BeamSearchParams, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    settings = dict(kv_cache_memory=1.0, enable_prefix_caching=False, threads=args.threads)
    rows = []
    for max_tokens in args.max_tokens:
        llm = LLM(args.model, **settings)
        prompt = make_prompts(llm.tokenizer, 1, args.prompt_len, args.prompt_len, seed=3)[0]
        start = time.perf_counter()
        out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=args.width, max_tokens=max_tokens, ignore_eos=True))
        beam_seconds = time.perf_counter() - start
        beam_peak = llm.engine.peak_num_blocks_used
        assert all(s.num_output_tokens == max_tokens for s in out[0].sequences)
        del llm
        llm = LLM(args.model, **settings)
        start = time.perf_counter()
        outs = llm.generate([prompt] * args.width, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
        plain_seconds = time.perf_counter() - start
        plain_peak = llm.engine.peak_num_blocks_used
        del llm
        generated = sum(len(o.token_ids) for o in outs)
        row = {"prompt_len": len(prompt), "max_tokens": max_tokens, "width": args.width, "beam_peak_blocks": beam_peak,
               "independent_peak_blocks": plain_peak, "blocks_ratio": beam_peak / plain_peak, "beam_seconds": beam_seconds,
               "independent_seconds": plain_seconds, "beam_tok_s": args.width * max_tokens / beam_seconds,
               "independent_tok_s": generated / plain_seconds}  # fmt: skip
        rows.append(row)
        print(f"prompt {len(prompt)}, {max_tokens} new tokens, width {args.width}: peak blocks beam {beam_peak} / independent {plain_peak} "
              f"= {row['blocks_ratio']:.2f}x; beam {row['beam_tok_s']:.1f} tok/s ({beam_seconds:.1f} s), independent "
              f"{row['independent_tok_s']:.1f} tok/s ({plain_seconds:.1f} s)", flush=True)  # fmt: skip
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
