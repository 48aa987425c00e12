"""KV cache formats side by side on one model: bytes per token (scales included), token capacity at
one --kv-cache-memory (from LLM.stats()), and decode speed at long contexts relative to the model's
16-bit KV cache, every format in the same process.

    .venv/bin/python bench/kv_formats.py --model smollm2-135m-instruct --contexts 2048,8000
    .venv/bin/python bench/kv_formats.py --model gemma-3-270m --contexts 2048,8192 --rounds 2

Decode time is the wall time of the steps after every sequence has its first token (prefill
excluded), per generated token. Formats run in turn, `--rounds` times, and each keeps its best round.
"capacity" is LLM.stats()'s token capacity; "cap@64seq" the tokens the same pool holds while 64
long sequences run (the default --max-num-seqs): int4 and int2 keep each one's recent tokens and
sink block in full-precision blocks taken from the pool, which the quantized tokens cannot use.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from common import make_prompts  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402

FORMATS = ("auto", "fp8_e4m3", "int8", "int4", "int2")


def decode_ms(llm: LLM, length: int, seqs: int, new_tokens: int) -> float:
    """Milliseconds per decode step of `seqs` sequences at `length` tokens of context."""
    engine = llm.engine
    prompts = make_prompts(llm.tokenizer, seqs, length, length, seed=3, bos=engine.model_config.bos_token_id)
    requests = [engine.add_request(p, SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True),
                                   cache_salt=f"bench-{time.perf_counter_ns()}") for p in prompts]  # fmt: skip
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return 1000 * (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="--kv-cache-dtype values, the first the baseline; FORMAT/rot stores it Hadamard-rotated (--kv-hadamard), "
                        "FORMAT/plain not (--no-kv-hadamard), FORMAT alone as the engine's default does")
    parser.add_argument("--contexts", default="2048,8000", help="context lengths of the decode runs")
    parser.add_argument("--seqs", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB: the budget capacity is reported at")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    formats = args.formats.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    best: dict[tuple[str, int], float] = {}
    stats: dict[str, dict] = {}
    for _ in range(args.rounds):
        for fmt in formats:
            dtype, _, variant = fmt.partition("/")
            llm = LLM(args.model, kv_cache_dtype=dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.seqs, 1),
                      enable_prefix_caching=False, kv_hadamard={"rot": True, "plain": False}.get(variant))  # fmt: skip
            stats[fmt] = llm.stats()
            spec = llm.engine.kv_spec
            apart = 64 * max(spec.residual_units - 1, 0) * spec.residual_blocks_held(max(contexts))
            stats[fmt]["capacity_64"] = (llm.engine.kv.num_blocks - apart) * spec.block_size // len(spec.groups)
            for length in contexts:
                ms = decode_ms(llm, length, args.seqs, args.new_tokens)
                best[fmt, length] = min(best.get((fmt, length), ms), ms)
            del llm
            gc.collect()
    base = formats[0]
    print(f"{args.model}: --kv-cache-memory {args.kv_cache_memory:g} GiB, {args.seqs} sequence(s) decoding "
          f"{args.new_tokens} tokens, best of {args.rounds} rounds")  # fmt: skip
    head = f"{'kv dtype':14} {'B/token':>8} {'capacity':>9} {'x':>5} {'cap@64seq':>9} {'x':>5}" + "".join(f" {f'ms@{n}':>9} {'x':>5}" for n in contexts)
    print(head + "\n" + "─" * len(head))
    for fmt in formats:
        s = stats[fmt]
        name = s["kv_cache_dtype"] + (" rot" if s["kv_hadamard"] else "")
        row = f"{name:14} {s['bytes_per_token']:8,} {s['token_capacity']:9,} {s['token_capacity'] / stats[base]['token_capacity']:5.2f}"
        row += f" {s['capacity_64']:9,} {s['capacity_64'] / stats[base]['capacity_64']:5.2f}"
        row += "".join(f" {best[fmt, n]:9.2f} {best[fmt, n] / best[base, n]:5.2f}" for n in contexts)
        print(row)


if __name__ == "__main__":
    main()
