"""How many 4K-token sequences run at once in a fixed KV budget, with and without KV eviction.

Every configuration gets the same --kv-cache-memory and more 4,096-token prompts than could fit;
each generates --max-tokens tokens. "concurrent" is the most sequences running (all prompt
blocks allocated or compressed) in any one step, counted by the engine's scheduler, not computed
from a formula; "kept" is the KV a compressed sequence holds after its prompt, in blocks and
bytes, read from the block manager. A new prompt is admitted only when its whole uncompressed
prompt has blocks (it is compressed when its prefill ends), so one 4K prompt's worth of blocks
stays in reserve.

    .venv/bin/python bench/eviction_capacity.py --model smollm2-135m-instruct --kv-cache-memory 0.2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvserve import LLM, SamplingParams  # noqa: E402


def run(args: argparse.Namespace, method: str, ratio: float | None) -> dict:
    flags = {} if method == "none" else {"kv_compression": method, "kv_keep_ratio": ratio}
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=1024, **flags)
    engine = llm.engine
    stats = llm.stats()
    kept = args.prompt_len if ratio is None else engine.config.eviction.tokens_kept(args.prompt_len)
    # a few more than can fit: one prompt's blocks in reserve, the rest held compressed and growing
    count = max(stats["token_capacity"] - args.prompt_len, 0) // (kept + args.max_tokens) + 3
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(torch.randint(1000, vocab, (args.prompt_len,), generator=g).tolist(), params) for _ in range(count)]
    peak = 0
    held_blocks = None
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        peak = max(peak, len(running))
        if held_blocks is None and seqs[0].num_output_tokens >= 1:
            held_blocks = sum(engine.kv.num_held_blocks(seqs[0].request_id, g) for g in range(len(engine.kv.groups)))
    after = llm.stats()
    return {
        "method": method, "ratio": ratio, "kept_tokens": kept, "held_blocks": held_blocks,
        "held_bytes": held_blocks * engine.kv_spec.bytes_per_block, "token_capacity": stats["token_capacity"],
        "submitted": count, "concurrent": peak, "preemptions": after["num_preemptions"], "seconds": time.perf_counter() - start,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--kv-cache-memory", type=float, default=0.2, help="GiB of KV cache, the same for every configuration")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=64, help="generated per sequence (long enough to overlap them all)")
    parser.add_argument("--methods", default="snapkv,streaming", help="comma-separated --kv-compression methods")
    parser.add_argument("--ratios", default="0.5,0.25,0.1", help="comma-separated --kv-keep-ratio values")
    args = parser.parse_args()
    configs = [("none", None)] + [(m, float(r)) for m in args.methods.split(",") for r in args.ratios.split(",")]
    rows = []
    for method, ratio in configs:
        rows.append(run(args, method, ratio))
        r = rows[-1]
        print(f"  {method} {ratio}: {r['concurrent']} concurrent, {r['preemptions']} preemptions, {r['seconds']:.0f} s", flush=True)
    base = rows[0]["concurrent"]
    print(f"\n{args.model}, --kv-cache-memory {args.kv_cache_memory} GiB ({rows[0]['token_capacity']:,} tokens), "
          f"{args.prompt_len}-token prompts, {args.max_tokens} generated each")
    print("| method | keep ratio | kept per sequence | KV kept per sequence | concurrent sequences | vs none | preemptions |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:g}"
        print(f"| {r['method']} | {ratio} | {r['kept_tokens']:,} tokens, {r['held_blocks']} blocks | "
              f"{r['held_bytes'] / 2**20:.1f} MiB | {r['concurrent']} | {r['concurrent'] / base:.1f}x | {r['preemptions']} |")


if __name__ == "__main__":
    main()
