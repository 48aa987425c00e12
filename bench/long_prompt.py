"""Long prompts: N prompts of 4,000 random tokens, 64 greedy tokens each (llama-batched-bench's
long-context workload), the whole job's seconds and its time to first token, in turns against
the torch_sdpa attention backend (torch's flash SDPA for prefill chunks, oneDNN's AMX tiles where
the CPU has them) in the same process.

    .venv/bin/python bench/long_prompt.py [--model gemma-3-270m] [--seqs 1,8] [--prompt-len 4000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvserve import LLM, SamplingParams  # noqa: E402


def run_job(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """The job's seconds and its mean time to first token."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ttft = statistics.mean(out.metrics["first_token_time"] - out.metrics["arrival_time"] for out in outputs)
    return seconds, ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--seqs", default="1,8", help="concurrent prompts per job")
    parser.add_argument("--prompt-len", type=int, default=4000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="each setting runs once per round, in turns")
    args = parser.parse_args()
    engines = {
        backend: LLM(model=args.model, max_model_len=args.prompt_len + args.new_tokens + 16, enable_prefix_caching=False,
                     attention_backend=backend)
        for backend in ("cpu_paged", "torch_sdpa")
    }  # fmt: skip
    vocab = engines["cpu_paged"].engine.model.config.vocab_size
    rng = random.Random(0)
    for llm in engines.values():
        run_job(llm, [[rng.randrange(100, vocab - 100) for _ in range(512)]], 4)  # warm-up
    dtype = engines["cpu_paged"].engine.config.dtype
    print(f"{args.model}, {dtype}, prompts of {args.prompt_len} random tokens, {args.new_tokens} greedy tokens each")
    print("| prompts | setting | job (s) | TTFT mean (s) | generated tok/s |")
    print("|---:|---|---:|---:|---:|")
    for n in (int(s) for s in args.seqs.split(",")):
        prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(n)]
        results: dict[str, list[tuple[float, float]]] = {backend: [] for backend in engines}
        for _ in range(args.rounds):
            for backend, llm in engines.items():
                results[backend].append(run_job(llm, prompts, args.new_tokens))
        for setting, runs in results.items():
            seconds = statistics.median(s for s, _ in runs)
            ttft = statistics.median(t for _, t in runs)
            print(f"| {n} | {setting} | {seconds:.2f} | {ttft:.2f} | {n * args.new_tokens / seconds:.1f} |")
        base = statistics.median(s for s, _ in results["torch_sdpa"])
        print(f"| {n} | cpu_paged speed-up | {base / statistics.median(s for s, _ in results['cpu_paged']):.2f}x | | |")


if __name__ == "__main__":
    main()
