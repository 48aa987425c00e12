"""Prefix caching on Gemma 3 270M: four workloads, cached against uncached, hash against radix.

1. system prompt: a fixed 2,048-token system prompt, then short questions;
2. RAG: a 5,120-token document reused with varying questions;
3. multi-turn: a 10-turn conversation, ~200 new tokens a turn (the user's message and the answer);
4. code completion: an unchanged file is 80% of each prompt, a changing tail the rest.

Requests run one at a time on the offline engine (so TTFT is the request's own prefill, not a
queue); each engine is warmed with one unrelated request, and the first request of a scenario
(the one that fills the cache) is left out of the TTFT figures. Reports TTFT p50 cached and
uncached and their ratio, generated tok/s over the scenario, and the reused-token ratio (tokens
served from the cache / tokens a cache could serve at most).

    .venv/bin/python bench/prefix.py                 # every scenario (~5 min on 2 cores)
    .venv/bin/python bench/prefix.py --scenarios system
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from common import prose_token_ids  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402


def scenario_prompts(name: str, tok, bos: int | None) -> tuple[list[list[int]] | None, int]:
    """The scenario's prompts (None for multi-turn, built from the model's answers) and max tokens."""
    prose = prose_token_ids(tok)
    head = [bos] if bos is not None else []
    if name == "system":
        system = head + prose[:2047]
        return [system + tok.encode(f"\nQuestion {i}: what does section {i} of this license say?\nAnswer:", add_special_tokens=False)
                for i in range(12)], 16  # fmt: skip
    if name == "rag":
        document = head + prose[5000 : 5000 + 5119]
        questions = ["Who may copy it?", "What is a covered work?", "Can I charge a fee?", "What about patents?",
                     "Does it cover source code?", "What must a notice say?", "Is there a warranty?", "What if I break it?"]  # fmt: skip
        return [document + tok.encode(f"\n\nQuestion: {q}\nAnswer:", add_special_tokens=False) for q in questions], 24
    if name == "code":
        import asyncio.base_events as module

        source = tok.encode(inspect.getsource(module), add_special_tokens=False)
        unchanged = head + source[:1600]
        return [unchanged + source[1600 + 37 * i : 1600 + 37 * i + 400] for i in range(10)], 16
    if name == "multiturn":
        return None, 48
    raise ValueError(name)


def run(llm: LLM, name: str, prompts: list[list[int]] | None, max_tokens: int, prose: list[int]) -> dict:
    """Requests one at a time: TTFT of each (the first excluded), generated tok/s over all, reuse."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    before = engine.prefix_cache_stats()
    ttfts, generated = [], 0
    start = time.perf_counter()
    history = prose[:1] if prompts is None else None
    for i in range(10 if prompts is None else len(prompts)):
        if prompts is None:  # multi-turn: the history so far plus ~150 tokens of the user's next message
            history = history + prose[20000 + 150 * i : 20000 + 150 * (i + 1)]
            prompt = history
        else:
            prompt = prompts[i]
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        if prompts is None:
            history = history + out.token_ids
        generated += len(out.token_ids)
        if i:
            ttfts.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
    elapsed = time.perf_counter() - start
    after = engine.prefix_cache_stats()
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    eligible = after["prefix_cache_eligible_tokens_total"] - before["prefix_cache_eligible_tokens_total"]
    return {"ttft_p50": statistics.median(ttfts), "tok_s": generated / elapsed, "reuse": hits / eligible if eligible else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--scenarios", default="system,rag,multiturn,code")
    args = parser.parse_args()

    configs = {"uncached": dict(enable_prefix_caching=False), "hash": dict(prefix_cache="hash"), "radix": dict(prefix_cache="radix")}
    rows: dict[tuple[str, str], dict] = {}
    for config, kw in configs.items():
        llm = LLM(args.model, max_model_len=8192, **kw)
        tok, bos = llm.tokenizer, llm.engine.model_config.bos_token_id
        prose = prose_token_ids(tok)
        llm.generate([prose[-300:]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up, shares nothing
        for name in args.scenarios.split(","):
            if config == "radix" and name not in ("rag", "multiturn"):
                continue
            prompts, max_tokens = scenario_prompts(name, tok, bos)
            rows[name, config] = run(llm, name, prompts, max_tokens, prose)
            r = rows[name, config]
            print(f"{name} / {config}: TTFT p50 {r['ttft_p50'] * 1000:.0f} ms, {r['tok_s']:.1f} generated tok/s, "
                  f"reused {r['reuse'] * 100:.1f}% of what a cache could serve", flush=True)
        del llm
        gc.collect()

    print("\n| scenario | cache | TTFT p50 | vs uncached | generated tok/s | reused-token ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.scenarios.split(","):
        base = rows[name, "uncached"]["ttft_p50"]
        for config in configs:
            if (name, config) in rows:
                r = rows[name, config]
                print(f"| {name} | {config} | {r['ttft_p50'] * 1000:.0f} ms | {r['ttft_p50'] / base * 100:.1f}% | "
                      f"{r['tok_s']:.1f} | {r['reuse'] * 100:.1f}% |")


if __name__ == "__main__":
    main()
