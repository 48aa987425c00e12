"""Structured outputs: constrained against unconstrained throughput, and grammar compile time.

64 requests constrained by a JSON schema (a list of 6 to 10 records: a name, a year, a genre from an
enum, a rating, tags) against the same 64 prompts unconstrained (ignore_eos, so every request runs to
max_tokens), greedy and at temperature 1.0 (the API's default), 128 new tokens, on Gemma 3 270M and
Qwen2.5-Coder-0.5B-Instruct. Prints generated tok/s and the ratio constrained / unconstrained; then
the compile time of 50 random schemas (tests/json_schemas.py) with each model's vocabulary, p50/p99.

    .venv/bin/python bench/structured_outputs.py                 # both models (~10 min on 2 cores)
    .venv/bin/python bench/structured_outputs.py --models gemma-3-270m --requests 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from json_schemas import random_schemas  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.structured.spec import StructuredOutputs  # noqa: E402

RECORDS = {"type": "array", "minItems": 6, "maxItems": 10, "items": {"type": "object", "additionalProperties": False,
           "required": ["name", "year", "genre", "rating", "tags"], "properties": {
               "name": {"type": "string", "maxLength": 24}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
               "genre": {"enum": ["fiction", "science", "history", "poetry"]}, "rating": {"type": "number", "minimum": 0, "maximum": 5},
               "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}}}}  # fmt: skip
TOPICS = ["books", "films", "albums", "papers", "plays", "novels", "poems", "essays"]


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma-3-270m", "qwen2.5-coder-0.5b-instruct"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    spec = StructuredOutputs(json=RECORDS)
    prompts = [f"A JSON list of {6 + i % 5} {TOPICS[i % len(TOPICS)]} with name, year, genre, rating and tags, number {i}:\n"
               for i in range(args.requests)]  # fmt: skip
    for model in args.models:
        llm = LLM(model, max_num_seqs=args.requests, kv_cache_memory=2.0)
        print(f"\n{model}: {args.requests} requests, {args.max_tokens} new tokens")
        for name, sampling in [("greedy", dict(temperature=0)), ("temperature 1.0", dict(temperature=1.0))]:
            free = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i, **sampling) for i in range(args.requests)]
            bound = [SamplingParams(max_tokens=args.max_tokens, seed=i, structured_outputs=spec, **sampling) for i in range(args.requests)]
            run(llm, prompts[:4], bound[:4])  # compiles the schema, warms up
            free_rate, free_tokens = run(llm, prompts, free)
            bound_rate, bound_tokens = run(llm, prompts, bound)
            print(f"  {name:16s} unconstrained {free_rate:7.1f} tok/s ({free_tokens} tokens)   "
                  f"JSON schema {bound_rate:7.1f} tok/s ({bound_tokens} tokens)   ratio {bound_rate / free_rate:.2f}")
        grammars = llm.engine.grammars
        grammars.tokenizer_info  # noqa: B018 - the vocabulary's table is built once per engine, not per schema
        times = []
        for schema in random_schemas(50, seed=1):
            start = time.perf_counter()
            grammars.compile(StructuredOutputs(json=json.loads(json.dumps(schema))))
            times.append(time.perf_counter() - start)
        times.sort()
        print(f"  compile, 50 random schemas: p50 {statistics.median(times) * 1e3:.1f} ms, p99 {times[int(0.99 * len(times))] * 1e3:.1f} ms, "
              f"max {times[-1] * 1e3:.1f} ms")
        del llm


if __name__ == "__main__":
    main()
