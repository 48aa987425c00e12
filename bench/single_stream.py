"""Single-stream decode under each sampling setting and weight format, rounds interleaved.

One request at a time (a 128-token prompt of real prose, 128 new tokens with ignore_eos), each
setting on each engine once per round, `--rounds` rounds; prints each one's median decode tok/s
(first token to last) and its ratio to the first engine's greedy median. One stream's step on
this machine moves 20-40% from run to run, so everything takes turns within a round rather than
running one after another. `--weight-dtypes gguf auto-dtype` puts the GGUF blocks beside the
weights dequantized into --dtype auto (two engines, one process).

    .venv/bin/python bench/single_stream.py [--model gemma-3-270m] [--rounds 7] [--weight-dtypes gguf auto-dtype]

`--against CHECKOUT` compares two versions of the code instead: each pair of runs starts this
script once on CHECKOUT's kvserve (PYTHONPATH; its default weights, or --against-weight-dtype) and
once on this one's (the first --weight-dtypes entry), in alternating order, each a fresh process
that reports the median of --repeats decodes greedy and at temperature 1.0; it prints every pair's
ratio and the median ratio. A worktree of an older commit serves as CHECKOUT:

    git worktree add --detach /tmp/before <commit>
    .venv/bin/python bench/single_stream.py --against /tmp/before --pairs 8 --weight-dtypes gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from common import make_prompts  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from throughput import SETTINGS  # noqa: E402


def decode_tps(llm: LLM, prompt: list[int], params: SamplingParams) -> float:
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    m = out.metrics
    return (len(out.token_ids) - 1) / (m["last_token_time"] - m["first_token_time"])


PAIRED = {"greedy": SETTINGS["greedy"], "temperature 1.0": SETTINGS["temperature 1.0"]}


def one_run(model: str, weight_dtype: str, new_tokens: int, repeats: int) -> dict[str, float]:
    """One engine (weight_dtype "default": the checkout's own default, for code that predates the
    flag): the median decode tok/s of `repeats` requests per setting of PAIRED."""
    settings = {} if weight_dtype == "default" else {"weight_dtype": weight_dtype}
    llm = LLM(model, kv_cache_memory=0.5, enable_prefix_caching=False, **settings)
    prompt = make_prompts(llm.tokenizer, 1, 128, 128, seed=0)[0]
    return {name: statistics.median(decode_tps(llm, prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=1, **sampling))
                                    for _ in range(repeats))
            for name, sampling in PAIRED.items()}  # fmt: skip


def against(args: argparse.Namespace) -> None:
    """Pairs of fresh processes, this checkout's code against args.against's, in alternating order."""
    checkout = Path(args.against).resolve()
    if not (checkout / "kvserve" / "__init__.py").is_file():
        sys.exit(f"--against {checkout}: not a kvserve checkout (no kvserve/__init__.py)")
    here = Path(__file__).resolve().parents[1]
    sides = {"before": (checkout, args.against_weight_dtype), "now": (here, args.weight_dtypes[0])}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "now": []}
    for pair in range(args.pairs):
        for side in ("before", "now") if pair % 2 == 0 else ("now", "before"):
            root, weight_dtype = sides[side]
            command = [sys.executable, __file__, "--one-run", "--model", args.model, "--weight-dtypes", weight_dtype,
                       "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(root)}
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"pair {pair + 1} {side}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[side][-1].items()), flush=True)
    print(f"\n{args.model}: {sides['now'][1]} weights here against {checkout} ({sides['before'][1]} weights), "
          f"{args.pairs} pairs, median of {args.repeats} decodes of {args.new_tokens} tokens per run")  # fmt: skip
    print("| sampling | before tok/s (median of runs) | now tok/s | ratio of medians | median pair ratio (min-max) |")
    print("|---|---:|---:|---:|---:|")
    for name in PAIRED:
        before = [r[name] for r in runs["before"]]
        now = [r[name] for r in runs["now"]]
        ratios = [n / b for n, b in zip(now, before)]
        print(f"| {name} | {statistics.median(before):.1f} | {statistics.median(now):.1f} | {statistics.median(now) / statistics.median(before):.2f}x "
              f"| {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--weight-dtypes", nargs="+", default=["auto"],
                        help="engines to compare: auto, gguf, float32, bfloat16, or auto-dtype (--dtype auto's own dtype)")
    parser.add_argument("--against", metavar="CHECKOUT", help="compare this code with another checkout's (pairs of processes)")
    parser.add_argument("--against-weight-dtype", default="default",
                        help="the weights CHECKOUT's engine takes (default: its own default; it may predate --weight-dtype)")
    parser.add_argument("--pairs", type=int, default=8, help="with --against: pairs of runs")
    parser.add_argument("--repeats", type=int, default=5, help="with --against: decodes per setting in one run (their median)")
    parser.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        print(json.dumps(one_run(args.model, args.weight_dtypes[0], args.new_tokens, args.repeats)))
        return
    if args.against:
        against(args)
        return
    engines = {}
    for weight_dtype in args.weight_dtypes:
        if weight_dtype == "auto-dtype":
            from kvserve.config import EngineConfig

            weight_dtype = EngineConfig(model=args.model).dtype
        engines[weight_dtype] = LLM(args.model, kv_cache_memory=0.5, enable_prefix_caching=False, weight_dtype=weight_dtype)
    first = next(iter(engines.values()))
    prompt = make_prompts(first.tokenizer, 1, 128, 128, seed=0)[0]
    print(f"{args.model}: {args.rounds} rounds of {args.new_tokens} tokens", flush=True)
    samples: dict[tuple[str, str], list[float]] = {(w, name): [] for w in engines for name in SETTINGS}
    for _ in range(args.rounds):
        for name, sampling in SETTINGS.items():
            for weight_dtype, llm in engines.items():
                params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, seed=1, **sampling)
                samples[weight_dtype, name].append(decode_tps(llm, prompt, params))
    baseline = statistics.median(samples[next(iter(engines)), "greedy"])
    print(f"\n| weights | sampling | single-stream decode tok/s (median; min-max) | vs {next(iter(engines))} greedy |")
    print("|---|---|---:|---:|")
    for (weight_dtype, name), values in samples.items():
        median = statistics.median(values)
        print(f"| {weight_dtype} | {name} | {median:.1f} ({min(values):.1f}-{max(values):.1f}) | {median / baseline:.2f}x |")


if __name__ == "__main__":
    main()
