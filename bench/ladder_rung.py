"""One rung of the KV cost ladder (bench/ladder.py) against the rung below it, on one workload.

The two engines are the ladder's own (its stack of engine arguments up to each rung, its seeded
workloads, its run_kvserve), run in turns --repeats times in this process, so a slow spell of a
shared machine falls on both alike. Prints every run, each rung's median by tok/s, and the
ladder's two targets: the rung's generated tok/s over the rung below's (>= 0.97x) and its TTFT p50
over the rung below's (<= 1.1x). A minute or two per repeat on 2 cores; the whole page is
bench/ladder.py's (most of an hour).

    .venv/bin/python bench/ladder_rung.py --model qwen2.5-coder-0.5b-instruct --rung "+ SnapKV 0.5"
    .venv/bin/python bench/ladder_rung.py --model gemma-3-270m --rung "+ SnapKV 0.5" --workload revisit
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ladder  # noqa: E402

from kvserve import LLM  # noqa: E402

WORKLOADS = {"mixed": ladder.workload, "revisit": ladder.revisit_workload}


def rung_pair(plan: list, model: str, rung: str) -> list[tuple[str, dict]]:
    """(rung name, engine arguments) of `rung` and of the rung below it in the model's plan (ladder.rung_plan)."""
    names = [r.name for r, _ in plan]
    if rung not in names:
        sys.exit(f"--rung {rung!r}: {model} climbs {', '.join(names)}")
    at = names.index(rung)
    if at == 0:
        sys.exit(f"--rung {rung!r} is the first kvserve rung: it has no rung below it to compare with")
    return [(r.name, args) for r, args in plan[at - 1 : at + 1]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="an alias, a GGUF file or an HF directory")
    parser.add_argument("--rung", default="+ SnapKV 0.5", help="the rung to compare with the one below it (bench/ladder.py's names)")
    parser.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS), help="bench/ladder.py's workload")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each rung, in turns")
    parser.add_argument("--kv-cache-memory", type=float, default=0.03, help="GiB of KV each rung gets (bench/ladder.py's default)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="the most requests a rung runs at once")
    parser.add_argument("--dtype", default="auto", help="model dtype")
    parser.add_argument("--tier-gib", type=float, default=1.0, help="the host and disk tiers' budgets (the tier rung and above)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument("--quick", action="store_true", help="bench/ladder.py's tiny workload (a smoke test, not a measurement)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    for name in ("kv_cache_memory", "tier_gib"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive number of GiB, got {getattr(args, name)}")
    scale = ladder.QUICK if args.quick else ladder.Scale()
    base = dict(max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype)
    with tempfile.TemporaryDirectory(prefix="kvserve-ladder-rung-") as tmp:
        probe = LLM(args.model, **{**base, "kv_cache_memory": 0.01, "max_num_seqs": 1})
        windows = any(g.window is not None for g in probe.engine.kv.groups)
        rounds, shared = WORKLOADS[args.workload](probe.tokenizer, scale, args.seed, probe.engine.model_config.bos_token_id)
        del probe
        gc.collect()
        pair = rung_pair(ladder.rung_plan(base, windows, args.tier_gib, Path(tmp) / "tiers"), args.model, args.rung)
        runs: dict[str, list[ladder.RungResult]] = {name: [] for name, _ in pair}
        for repeat in range(args.repeats):
            for name, engine_args in pair:
                run_args = dict(engine_args)
                if run_args.get("kv_offload_disk_dir"):  # every run starts with an empty disk tier
                    run_args["kv_offload_disk_dir"] = str(Path(run_args["kv_offload_disk_dir"]) / f"{repeat}-{len(runs[name])}-{name}")
                result = ladder.run_kvserve(args.model, run_args, rounds, shared, scale.new_tokens)
                runs[name].append(result)
                print(f"{name} (run {repeat + 1}): {result.tokens_per_second:.1f} tok/s, TTFT p50 {result.ttft_p50:.3f} s, "
                      f"p99 {result.ttft_p99:.3f} s, {result.extra['prefix_hit_tokens']:,} prompt tokens cached, "
                      f"{result.kv_bytes_per_request / 1024:,.0f} KiB KV / request, {result.max_concurrent} at most at once", flush=True)  # fmt: skip
                if run_args.get("kv_offload_disk_dir"):
                    shutil.rmtree(run_args["kv_offload_disk_dir"], ignore_errors=True)
    below, rung = runs
    rate = {name: statistics.median(r.tokens_per_second for r in results) for name, results in runs.items()}
    ttft = {name: statistics.median(r.ttft_p50 for r in results) for name, results in runs.items()}
    print(f"\n{args.model}, {args.workload} workload, medians of {args.repeats}:")
    for name in (below, rung):
        print(f"  {name}: {rate[name]:.1f} tok/s, TTFT p50 {ttft[name]:.3f} s")
    # each repeat runs the two rungs back to back: their ratio, repeat by repeat, cancels a slow spell shared by both
    rate_ratio = ladder.paired_ratios([r.tokens_per_second for r in runs[rung]], [r.tokens_per_second for r in runs[below]])
    ttft_ratio = ladder.paired_ratios([r.ttft_p50 for r in runs[rung]], [r.ttft_p50 for r in runs[below]])
    print(f"  {rung} / {below}, the median of the repeats' ratios: tok/s {rate_ratio:.2f}x (target >= 0.97x), "
          f"TTFT p50 {ttft_ratio:.2f}x (target <= 1.1x)")  # fmt: skip


if __name__ == "__main__":
    main()
