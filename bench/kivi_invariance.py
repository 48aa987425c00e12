"""int4 / int2 KV on a real model: the same tokens and logprobs after a prefix hit, in chunks and
after preemptions as computed alone (docs/prefix-caching.md#int4-and-int2, docs/kv-quantization.md).

    .venv/bin/python bench/kivi_invariance.py [--model smollm2-135m-instruct] [--kv-cache-dtype int4]

Prints, for each way, how many outputs equal the reference bit for bit (tokens and logprobs). Not
a timing: run it anywhere.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvserve import LLM, SamplingParams  # noqa: E402

TEXT = Path("/usr/share/common-licenses/GPL-3")


def trace(output) -> tuple:
    return tuple(output.token_ids), tuple(lp.logprob for lp in output.logprobs or ())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model path or alias (default: %(default)s)")
    parser.add_argument("--kv-cache-dtype", default="int4", choices=["int4", "int2"], help="the KIVI format (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=100, help="greedy tokens per request (default: %(default)s)")
    args = parser.parse_args()
    kv = dict(kv_cache_dtype=args.kv_cache_dtype)
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, logprobs=1)

    llm = LLM(args.model, kv_cache_memory=0.5, **kv)
    ids = llm.tokenizer.encode(TEXT.read_text())
    shared, tails = ids[:1000], [ids[2000 + 100 * i : 2024 + 100 * i] for i in range(8)]
    cold = [llm.generate([shared + t], greedy, use_tqdm=False, cache_salt=f"cold-{i}")[0] for i, t in enumerate(tails)]
    llm.generate([shared + [13]], SamplingParams(max_tokens=1), use_tqdm=False, cache_salt="warm")
    hits = [llm.generate([shared + t], greedy, use_tqdm=False, cache_salt="warm")[0] for t in tails]
    same = sum(trace(a) == trace(b) for a, b in zip(cold, hits))
    print(f"prefix hit ({[h.num_cached_tokens for h in hits]} tokens cached): {same}/8 identical to the cold runs")

    prompt = ids[:1200]
    alone = trace(llm.generate([prompt], greedy, use_tqdm=False, cache_salt="alone")[0])
    del llm
    for chunk in (16, 17, 256):
        chunked = LLM(args.model, kv_cache_memory=0.5, max_num_batched_tokens=chunk, enable_prefix_caching=False, **kv)
        got = trace(chunked.generate([prompt], greedy, use_tqdm=False)[0])
        print(f"prefill in chunks of {chunk}: {'identical to' if got == alone else 'different from'} one chunk")
        del chunked

    n6 = SamplingParams(n=6, max_tokens=250, temperature=0, ignore_eos=True, logprobs=1)
    prompt = ids[:540]
    roomy = [trace(o) for o in LLM(args.model, kv_cache_memory=0.5, max_num_batched_tokens=64, **kv).generate([prompt], n6, use_tqdm=False)]
    tight = LLM(args.model, kv_cache_memory=0.01, max_num_batched_tokens=64, **kv)
    got = [trace(o) for o in tight.generate([prompt], n6, use_tqdm=False)]
    print(f"n=6 in 0.01 GiB ({tight.stats()['num_preemptions']} preemptions): {sum(a == b for a, b in zip(got, roomy))}/6 identical "
          f"to 0.5 GiB ({len(set(got))} distinct outputs)")


if __name__ == "__main__":
    main()
