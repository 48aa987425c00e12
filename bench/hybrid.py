"""KV cache groups on Gemma 3 270M: sliding-window layers holding only their window, against every
layer holding every block (--disable-hybrid-kv-cache-manager), at one --kv-cache-memory.

For each: KV bytes one 8,192-token sequence holds, the most 8,192-token sequences that run at
once (the engine's own scheduler and block manager admit them, with no model: `LLMEngine.simulated`),
and decode tok/s of a few sequences at 8K context on the real model.

    .venv/bin/python bench/hybrid.py                      # 1 GiB, 8,192 tokens, 4 sequences decoding
    .venv/bin/python bench/hybrid.py --decode-seqs 0      # capacity only (seconds)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from common import make_prompts  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.engine import LLMEngine  # noqa: E402
from kvserve.plan.cli import load_model_config  # noqa: E402


def max_concurrent(config: EngineConfig, model_config, length: int) -> tuple[int, int, int]:
    """(most sequences of `length` tokens held at once, KV bytes one holds, blocks in the pool): the
    engine's block manager admits them one by one under its own rule (the peak of a prefill chunk
    must fit) and prefills each in chunks, freeing what its windows leave behind."""
    engine = LLMEngine.simulated(config, model_config)
    kv, chunk = engine.kv, config.max_num_batched_tokens
    count = 0
    while kv.can_admit(f"seq-{count}", length, chunk):
        rid = f"seq-{count}"
        for start in range(0, length, chunk):
            assert kv.allocate_slots(rid, start, min(start + chunk, length))
            kv.free_unreachable(rid, min(start + chunk, length))
        count += 1
    held = sum(kv.num_held_blocks("seq-0", g) for g in range(len(kv.groups))) * engine.kv_spec.bytes_per_block
    return count, held, kv.num_blocks


def decode_speed(model: str, memory: float, hybrid: bool, length: int, count: int, new_tokens: int) -> float:
    """Generated tok/s of `count` sequences decoding together at `length` tokens of context (prefill excluded)."""
    llm = LLM(model, kv_cache_memory=memory, max_num_seqs=count, disable_hybrid_kv_cache_manager=not hybrid)
    engine = llm.engine
    prompts = make_prompts(llm.tokenizer, count, length, length, seed=3, bos=engine.model_config.bos_token_id)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True)) for p in prompts]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    start, before = time.perf_counter(), engine.generation_tokens_total
    while engine.has_unfinished_requests():
        engine.step()
    return (engine.generation_tokens_total - before) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB")
    parser.add_argument("--length", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--decode-seqs", type=int, default=4, help="sequences decoding together at --length (0: skip)")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    model_config = load_model_config(args.model)
    rows = {}
    for hybrid in (True, False):
        config = EngineConfig(model=args.model, dtype="bfloat16", kv_cache_memory=args.kv_cache_memory, max_num_seqs=256,
                              disable_hybrid_kv_cache_manager=not hybrid)  # fmt: skip
        peak, held, blocks = max_concurrent(config, model_config, args.length)
        speed = decode_speed(args.model, args.kv_cache_memory, hybrid, args.length, args.decode_seqs, args.new_tokens) if args.decode_seqs else None
        rows[hybrid] = (peak, held, blocks, speed)
        print(f"{'hybrid' if hybrid else 'full'}: {blocks} blocks, {held / 2**20:.1f} MiB per sequence, {peak} concurrent"
              + (f", decode {speed:.1f} tok/s" if speed else ""), flush=True)
    print(f"\n| Gemma 3 270M, {args.kv_cache_memory:g} GiB of KV, {args.length:,}-token sequences | KV per sequence | "
          f"concurrent sequences | decode tok/s ({args.decode_seqs} seqs) |")
    print("|---|---:|---:|---:|")
    for hybrid, name in ((False, "every layer holds every block"), (True, "hybrid: sliding layers hold their window")):
        peak, held, _, speed = rows[hybrid]
        print(f"| {name} | {held / 2**20:.1f} MiB | {peak} | {f'{speed:.1f}' if speed else '-'} |")
    ratio = rows[True][0] / rows[False][0]
    print(f"| hybrid / full | {rows[False][1] / rows[True][1]:.2f}x less | {ratio:.2f}x | "
          + (f"{rows[True][3] / rows[False][3]:.2f}x |" if rows[True][3] else "- |"))


if __name__ == "__main__":
    main()
