"""Sampling from the int8-screened lm_head against the full bf16 product, on real hidden states.

Captures the final hidden states of a few greedy generations (Gemma 3 270M by default), then per
sampling setting draws each row many times (a seed per draw) with `sampling.screened_sample` and
with the full product + `sampling.sample`, and prints: the share of draws the screen decides (the
rest take the full product), that every decided draw equals the full draw, the median tiles
recomputed exactly (of the lm_head's 16-token tiles), and the median time per row of the screened
draw, the greedy screen (`sampling.screened_argmax`) and the full product + draw, taken in turns.

    .venv/bin/python bench/screened_sampling.py [--model gemma-3-270m] [--seeds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.kernels import sampling  # noqa: E402

SETTINGS = {
    "temperature 1.0": dict(temperature=1.0),
    "temperature 0.8, top-p 0.95": dict(temperature=0.8, top_p=0.95),
    "temperature 0.7, top-k 40, top-p 0.9, repetition 1.1": dict(temperature=0.7, top_k=40, top_p=0.9, repetition=1.1),
    "temperature 1.0, min-p 0.05": dict(temperature=1.0, min_p=0.05),
    "temperature 1.0, top-p 0.5": dict(temperature=1.0, top_p=0.5),
}
PROMPTS = ["The history of the Roman empire is long and", "def fibonacci(n):\n", "Once upon a time, in a small village,"]


def sampler_rows(count: int, seed: int, position: int, penalties: int, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                 repetition=1.0) -> np.ndarray:  # fmt: skip
    rows = np.zeros(count, dtype=sampling.SAMPLER_ROW_DTYPE)
    rows["temperature"], rows["top_p"], rows["top_k"], rows["min_p"], rows["repetition_penalty"] = temperature, top_p, top_k, min_p, repetition
    rows["num_logprobs"], rows["seed"], rows["position"] = -1, seed, position
    rows["penalty_begin"], rows["penalty_end"] = 0, penalties
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--seeds", type=int, default=20, help="draws per row and setting")
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens per prompt whose hidden states are kept")
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_memory=0.5, enable_prefix_caching=False)
    model = llm.engine.model
    if model.screened_lm_head is None:
        raise SystemExit("no int8 screen here (it needs AVX512-VNNI and BF16, and a bf16 lm_head)")
    captured: list[torch.Tensor] = []
    greedy_tokens = model.greedy_tokens

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(hidden.clone())
        return greedy_tokens(hidden)

    model.greedy_tokens = capture
    llm.generate(PROMPTS, SamplingParams(max_tokens=args.tokens, temperature=0), use_tqdm=False)
    model.greedy_tokens = greedy_tokens
    normed = model.norm(torch.cat(captured)).contiguous()
    n = model.screened_lm_head.bf16.n
    tiles = -(-n // 16)
    scratch = torch.empty(1, 2 * tiles * 16)
    logits_out = torch.empty(1, n)
    # the output so far, as a penalized request sees it: the prompt-like ids of a 200-token text
    rng = np.random.default_rng(0)
    penalty_ids = np.unique(rng.integers(0, n, 200)).astype(np.int64)
    penalty_counts = rng.integers(0, 3, len(penalty_ids)).astype(np.int32)
    none = (np.empty(0, np.int64), np.empty(0, np.int32))
    print(f"{args.model}: {normed.shape[0]} hidden rows x {args.seeds} seeds per setting; lm_head {n} x {normed.shape[1]} ({tiles} tiles)\n")
    print("| sampling | decided by the screen | decided = full draw | tiles recomputed (median) | screened ms | greedy screen ms | full product + draw ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, setting in SETTINGS.items():
        penalties = (penalty_ids, penalty_counts) if setting.get("repetition", 1.0) != 1.0 else none
        decided = equal = total = 0
        rescored: list[int] = []
        times: dict[str, list[float]] = {"screened": [], "argmax": [], "full": []}
        for seed in range(args.seeds):
            for r in range(normed.shape[0]):
                x = normed[r : r + 1]
                rows = sampler_rows(1, seed, 100 * seed + r, len(penalties[0]), **setting)
                start = time.perf_counter()
                token, tiles_done = sampling.screened_sample(x, model.screened_lm_head, rows, *penalties, scratch)
                times["screened"].append(time.perf_counter() - start)
                start = time.perf_counter()
                sampling.screened_argmax(x, model.screened_lm_head)
                times["argmax"].append(time.perf_counter() - start)
                start = time.perf_counter()
                logits = model._bf16_lm_head(x, out_dtype=torch.float32, out=logits_out)[0]
                full = sampling.sample(logits, rows, *penalties).tokens
                times["full"].append(time.perf_counter() - start)
                total += 1
                rescored.append(int(tiles_done[0]))
                if int(token[0]) >= 0:
                    decided += 1
                    equal += int(token[0]) == int(full[0])
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"| {name} | {decided / total:.1%} | {equal}/{decided} | {statistics.median(rescored):.0f} | {ms['screened']:.2f} | "
              f"{ms['argmax']:.2f} | {ms['full']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
