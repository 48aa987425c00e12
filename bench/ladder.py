"""The KV cost ladder: one seeded mixed workload, climbing from `transformers` generate through
kvserve's KV features one rung at a time, with throughput, TTFT, KV bytes per request, the most
concurrent requests at a fixed KV budget, and each rung's quality against the first kvserve rung.

The workload (real prose and code on this machine; the same token ids for every rung) runs in
rounds, every request of a round arriving at its start, as a chat service's traffic would:
  - chat turns: short questions under one of three shared system prompts (license texts);
  - multi-turn conversations: each round adds a user message to every conversation, after the
    previous turns and fixed assistant replies (so every rung sees the same prompts);
  - documents: long Python standard-library sources, each asked a new question every round.
Every request generates 32 greedy tokens (4 with --quick; EOS ignored).

The rungs, each adding one thing to the one before (kvserve at a fixed --kv-cache-memory, so a
rung that stores less KV runs more requests at once):
  transformers generate (left-padded batches of --hf-batch) -> paged, 16-bit KV, no prefix cache ->
  + int8 KV -> + prefix cache (hash) -> + radix -> + hybrid window groups (models with sliding
  windows) -> + host and disk tiers -> + SnapKV 0.5.
Every kvserve rung also runs a second workload, "revisit": two groups of documents asked about in
turn, so a document comes back after more KV than the pool holds (where a tier pays).
SnapKV compresses what is each request's own, its last turn (for a document, the document and its
question), and leaves the system prompt and earlier turns whole and shared (kv_compress_from), as
kvserve's chat endpoints do.
The kvserve rungs climb --repeats times (3), every rung in turn, so a slow spell of a shared
machine falls on the neighbouring rungs alike; each rung shows its median run by tok/s, and its
ratios to the rung below are the medians of the climbs' ratios (every run's rate and TTFT are in
ladder.json); every run of a tier starts with an empty disk tier.
Per rung: generated tok/s over the whole workload and its ratio to the rung below, TTFT p50 (and
its ratio to the rung below) and p99 from
the round's start, the prompt tokens served from the cache (pool or tiers), KV bytes
per running request (held blocks x block bytes / running requests, averaged over engine steps;
transformers: its cache tensors per row), the most requests running at once, and `kvserve eval`'s
perplexity change, mean KL and greedy agreement against the first kvserve rung. Quality depends
only on the KV format and compression (prefix hits, the radix tree, window groups and tiers are
bit-exact, tested), so rungs that change neither share the evaluation of the rung before.

It writes OUT/ladder.md (the tables, the command, the date and machine), OUT/ladder.json, a
figure per model (OUT/<model>.png) and OUT/headline.png (throughput per rung against transformers).

    .venv/bin/python bench/ladder.py                       # Gemma 3 270M and Qwen2.5-Coder-0.5B (~40 min on 2 AVX2 cores)
    .venv/bin/python bench/ladder.py --models gemma-3-270m --llama-cpp PATH/llama-batched-bench
    .venv/bin/python bench/ladder.py --quick --models TINY_HF_DIR     # a minute on a tiny model, a few on a real one: the test's run (into a temporary folder)
    .venv/bin/python bench/ladder.py --from-json docs/ladder/ladder.json   # the page and plots again from recorded runs, running nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import math
import os
import platform
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from batched_bench import LlamaCppError, executable_file, llama_cpp_rates  # noqa: E402
from common import percentile  # noqa: E402
from throughput import load_hf  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.eval.harness import EvalPlan, Evaluation  # noqa: E402
from kvserve.eval.text import default_text_path, read_text  # noqa: E402
from kvserve.model.registry import resolve_model_path  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
SYSTEM_TEXTS = ("GPL-3", "Apache-2.0", "MPL-2.0")
CHAT_TEXT = "GFDL-1.3"
DOCUMENT_MODULES = ("textwrap", "argparse", "inspect", "random", "json.decoder", "shlex")
REVISIT_MODULES = ("textwrap", "argparse", "inspect", "random", "json.decoder", "shlex", "difflib", "calendar", "csv", "tarfile",
                   "logging", "pathlib", "ftplib", "gzip", "smtplib", "imaplib")  # fmt: skip
KVSERVE_RUNGS_START = 1  # RUNGS[0] is transformers


@dataclass(frozen=True)
class Rung:
    name: str
    engine: dict  # engine arguments added to the rung before's
    needs_windows: bool = False  # only for models with sliding-window layers


RUNGS = (
    Rung("transformers generate", {}),
    Rung("paged, 16-bit KV", dict(kv_cache_dtype="bfloat16", enable_prefix_caching=False, disable_hybrid_kv_cache_manager=True)),
    Rung("+ int8 KV", dict(kv_cache_dtype="int8")),
    Rung("+ prefix cache (hash)", dict(enable_prefix_caching=True, prefix_cache="hash")),
    Rung("+ radix", dict(prefix_cache="radix")),
    Rung("+ hybrid window groups", dict(disable_hybrid_kv_cache_manager=False), needs_windows=True),
    Rung("+ host and disk tiers", dict(kv_offload_host_gib=None, kv_offload_disk_dir=None)),  # filled in by --tier-gib
    Rung("+ SnapKV 0.5", dict(kv_compression="snapkv", kv_keep_ratio=0.5)),
)
WORKLOAD_TEXT = {"mixed": "Chat turns under shared system prompts, multi-turn conversations and documents asked about every round:",
                 "revisit": "Documents asked about again after a group of others that holds more KV than the pool (a tier's workload):"}
QUALITY_KEYS = ("kv_cache_dtype", "kv_compression", "kv_keep_ratio")  # what a rung's quality depends on


@dataclass(frozen=True)
class Scale:
    rounds: int = 3
    system_tokens: int = 256
    chats_per_round: int = 4
    conversations: int = 4
    user_tokens: tuple[int, int] = (16, 32)
    reply_tokens: tuple[int, int] = (32, 64)
    documents: int = 2
    document_tokens: int = 768
    new_tokens: int = 32
    revisit_documents: int = 8  # the revisit workload: two groups of this many documents, asked about in turn
    revisit_rounds: int = 4
    eval_plan: EvalPlan = EvalPlan(context=1024, score_from=512, max_windows=2, greedy_prompts=8, greedy_prompt_len=128,
                                   greedy_tokens=32, needle_lengths=())  # fmt: skip


QUICK = Scale(rounds=2, system_tokens=24, chats_per_round=2, conversations=2, user_tokens=(4, 8), reply_tokens=(4, 8), documents=1,
              document_tokens=48, new_tokens=4, revisit_documents=2, revisit_rounds=4,
              eval_plan=EvalPlan(context=48, score_from=24, max_windows=1, greedy_prompts=2, greedy_prompt_len=12, greedy_tokens=4,
                                 needle_lengths=()))  # fmt: skip


# ---------------------------------------------------------------------- the workload
def workload(tokenizer, scale: Scale, seed: int, bos: int | None) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Rounds of prompts (token ids), the same for every rung, and for each prompt the tokens before
    its last user turn (a system prompt, earlier turns: what compression leaves whole, kv_compress_from)."""
    rng = random.Random(seed)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    head = [bos] if bos is not None else []
    systems = [head + encode((LICENSES / name).read_text())[: scale.system_tokens] for name in SYSTEM_TEXTS]
    prose = encode((LICENSES / CHAT_TEXT).read_text())

    def span(bounds: tuple[int, int]) -> list[int]:
        n = rng.randint(*bounds)
        start = rng.randrange(len(prose) - n)
        return prose[start : start + n]

    documents = []
    for name in DOCUMENT_MODULES[: scale.documents]:
        source = textwrap.dedent(inspect.getsource(__import__(name, fromlist=["_"])))
        documents.append(head + encode(source)[: scale.document_tokens])
    conversations = [[*systems[i % len(systems)]] for i in range(scale.conversations)]
    rounds, shared = [], []
    for _ in range(scale.rounds):
        chats = [rng.choice(systems) for _ in range(scale.chats_per_round)]
        prompts = [(system + span(scale.user_tokens), len(system)) for system in chats]
        for history in conversations:
            earlier = len(history)
            history += span(scale.user_tokens)
            prompts.append((list(history), earlier))
            history += span(scale.reply_tokens)  # the assistant's reply, fixed so every rung reads the same next turn
        prompts += [(doc + span(scale.user_tokens), len(head)) for doc in documents]  # a document is its question's turn
        rng.shuffle(prompts)
        rounds.append([p for p, _ in prompts])
        shared.append([n for _, n in prompts])
    return rounds, shared


def revisit_workload(tokenizer, scale: Scale, seed: int, bos: int | None) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Rounds of questions about documents, two groups of them asked about in turn (A, B, A, B...): a
    document comes back after a whole group of others, more KV than the pool holds, so its prefix is
    found again only in a tier. Each document is its question's turn (nothing is shared before it)."""
    rng = random.Random(seed + 1)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    head = [bos] if bos is not None else []
    prose = encode((LICENSES / CHAT_TEXT).read_text())
    documents = []
    for name in REVISIT_MODULES[: 2 * scale.revisit_documents]:
        source = textwrap.dedent(inspect.getsource(__import__(name, fromlist=["_"])))
        documents.append(head + encode(source)[: scale.document_tokens])
    rounds = []
    for r in range(scale.revisit_rounds):
        group = documents[(r % 2) * scale.revisit_documents : (r % 2 + 1) * scale.revisit_documents]
        prompts = []
        for doc in group:
            n = rng.randint(*scale.user_tokens)
            start = rng.randrange(len(prose) - n)
            prompts.append(doc + prose[start : start + n])
        rng.shuffle(prompts)
        rounds.append(prompts)
    return rounds, [[len(head)] * len(r) for r in rounds]


# ---------------------------------------------------------------------- one rung
@dataclass
class RungResult:
    rung: str
    tokens_per_second: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    kv_bytes_per_request: float | None = None
    max_concurrent: int | None = None
    concurrency_note: str = ""
    generated_tokens: int = 0
    seconds: float = 0.0
    perplexity_delta_pct: float | None = None
    mean_kl: float | None = None
    greedy_agreement: float | None = None
    quality_from: str = ""  # the rung whose evaluation this one shares
    skipped: str = ""
    extra: dict = field(default_factory=dict)


def run_kvserve(model: str, engine_args: dict, rounds: list[list[list[int]]], shared: list[list[int]], new_tokens: int) -> RungResult:
    llm = LLM(model, **engine_args)
    engine, kv = llm.engine, llm.engine.kv
    stats = engine.stats()
    block_bytes = stats["kv_cache_bytes"] / stats["num_blocks"]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    warm = [p[:32] for p in rounds[0][:4]]  # a small batch through prefill, chunked decode and the sampler
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    result = RungResult("")
    ttfts, per_request, peak = [], [], 0
    started = time.perf_counter()
    compressing = engine.config.eviction.active
    for prompts, earlier in zip(rounds, shared):
        pending = {engine.add_request(p, dataclasses.replace(params, kv_compress_from=n) if compressing else params).request_id
                   for p, n in zip(prompts, earlier)}  # fmt: skip
        while pending:
            for out in engine.step():
                if out.finished:
                    pending.discard(out.request_id)
                    ttfts.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
                    result.generated_tokens += len(out.token_ids)
            running = engine.num_running
            if running:
                per_request.append((kv.num_blocks - kv.num_free_blocks) * block_bytes / running)
                peak = max(peak, running)
    result.seconds = time.perf_counter() - started
    result.tokens_per_second = result.generated_tokens / result.seconds
    result.ttft_p50, result.ttft_p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    result.kv_bytes_per_request = sum(per_request) / len(per_request)
    result.max_concurrent = peak
    final = engine.stats()
    prefix = engine.prefix_cache_stats()
    result.extra = {"num_blocks": final["num_blocks"], "bytes_per_token": final["bytes_per_token"], "preemptions": final["num_preemptions"],
                    "prefix_hit_tokens": prefix["prefix_cache_hits_total"], "prompt_tokens": final["prompt_tokens_total"],
                    "tier_hit_tokens": {name: t["hit_tokens"] for name, t in final.get("kv_tiers", {}).items()}}  # fmt: skip
    del llm
    gc.collect()
    return result


def median_run(runs: list[RungResult]) -> RungResult:
    """The run of median throughput (the lower middle of an even count), with every run's rates kept."""
    chosen = sorted(runs, key=lambda r: r.tokens_per_second)[(len(runs) - 1) // 2]
    if len(runs) > 1:
        chosen.extra["runs_tokens_per_second"] = [round(r.tokens_per_second, 2) for r in runs]
        chosen.extra["runs_ttft_p50"] = [round(r.ttft_p50, 3) for r in runs]
    return chosen


def cache_bytes(cache) -> int:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return sum(t.nbytes for layer in layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))
    return sum(t.nbytes for t in [*cache.key_cache, *cache.value_cache])


def run_transformers(path: Path, dtype: str, rounds: list[list[list[int]]], new_tokens: int, batch: int, pad_id: int,
                     kv_budget: float) -> RungResult:  # fmt: skip
    """Left-padded batches of `batch` prompts, in arrival order; a request's TTFT is its batch's first logits."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstLogits(LogitsProcessor):
        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids, scores):
            if self.at is None:
                self.at = time.monotonic()
            return scores

    model = load_hf(path, getattr(torch, dtype))
    result = RungResult("")
    ttfts, per_request = [], []
    started = time.perf_counter()
    for prompts in rounds:
        arrived = time.monotonic()
        for at in range(0, len(prompts), batch):
            rows = prompts[at : at + batch]
            width = max(map(len, rows))
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(rows):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            first = FirstLogits()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                     pad_token_id=pad_id, logits_processor=LogitsProcessorList([first]), return_dict_in_generate=True)  # fmt: skip
            ttfts += [first.at - arrived] * len(rows)
            result.generated_tokens += (out.sequences.shape[1] - width) * len(rows)
            per_request.append(cache_bytes(out["cache"] if "cache" in out else out["past_key_values"]) / len(rows))
    result.seconds = time.perf_counter() - started
    result.tokens_per_second = result.generated_tokens / result.seconds
    result.ttft_p50, result.ttft_p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    result.kv_bytes_per_request = sum(per_request) / len(per_request)
    result.max_concurrent = int(kv_budget * 2**30 // result.kv_bytes_per_request)
    result.concurrency_note = f"computed: the budget / its cache per row; it ran batches of {batch}"
    del model
    gc.collect()
    return result


# ---------------------------------------------------------------------- the ladder of one model
def rung_plan(base: dict, windows: bool, tier_gib: float, tier_dir: Path) -> list[tuple[Rung, dict]]:
    """The kvserve rungs a model climbs (the window rung only with sliding windows), each with its engine
    arguments: `base` and every rung's additions up to it (the tier rung's host and disk tiers of tier_gib)."""
    engine_args, plan = dict(base), []
    for rung in RUNGS[KVSERVE_RUNGS_START:]:
        if rung.needs_windows and not windows:
            continue
        added = dict(rung.engine)
        if "kv_offload_host_gib" in added:
            added = dict(kv_offload_host_gib=tier_gib, kv_offload_disk_dir=str(tier_dir), kv_offload_disk_gib=tier_gib)
        engine_args.update(added)
        plan.append((rung, dict(engine_args)))
    return plan


def climb(model: str, args: argparse.Namespace, scale: Scale, bar: tqdm, tier_dir: Path) -> dict[str, tuple[list[RungResult], dict]]:
    """Every rung on both workloads; by workload, the rungs' results and the workload's description
    (transformers runs the mixed workload only)."""
    base = dict(max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype)
    probe = LLM(model, **{**base, "kv_cache_memory": 0.01, "max_num_seqs": 1})
    tokenizer, dtype = probe.tokenizer, probe.engine.config.dtype
    bos = probe.engine.model_config.bos_token_id
    windows = any(g.window is not None for g in probe.engine.kv.groups)
    pad = probe.tokenizer.hf_tokenizer.pad_token_id
    pad = pad if pad is not None else (probe.engine.model_config.eos_token_id or 0)
    del probe
    gc.collect()
    workloads = {"mixed": workload(tokenizer, scale, args.seed, bos), "revisit": revisit_workload(tokenizer, scale, args.seed, bos)}
    metas = {name: {"model": model, "dtype": dtype, "workload": name, "requests": sum(map(len, rounds)), "rounds": len(rounds),
                    "prompt_tokens": sum(len(p) for r in rounds for p in r), "new_tokens": scale.new_tokens,
                    "kv_cache_memory_gib": args.kv_cache_memory, "max_num_seqs": args.max_num_seqs}
             for name, (rounds, _) in workloads.items()}  # fmt: skip
    results: dict[str, list[RungResult]] = {name: [] for name in workloads}
    evaluation = Evaluation(scale.eval_plan, read_text(default_text_path()), progress=False)
    evaluated: dict[tuple, RungResult] = {}
    plan = rung_plan(base, windows, args.tier_gib, tier_dir / Path(model).name)
    # every repeat climbs the whole ladder, so a slow spell of a shared machine falls on every rung alike; a rung shows
    # its median run by tokens per second
    runs: dict[tuple[str, str], list[RungResult]] = {}
    for repeat in range(args.repeats):
        for rung, rung_args in plan:
            bar.set_description(f"{Path(model).name}: {rung.name}" + (f" ({repeat + 1}/{args.repeats})" if args.repeats > 1 else ""))
            for name, (rounds, shared) in workloads.items():
                run_args = dict(rung_args)
                if run_args.get("kv_offload_disk_dir"):  # an empty disk tier for every run: an engine reads what an earlier one left
                    run_args["kv_offload_disk_dir"] = str(Path(run_args["kv_offload_disk_dir"]) / f"{rung.name}-{name}-{repeat}")
                result = run_kvserve(model, run_args, rounds, shared, scale.new_tokens)
                result.rung = rung.name
                runs.setdefault((rung.name, name), []).append(result)
                if run_args.get("kv_offload_disk_dir"):
                    shutil.rmtree(run_args["kv_offload_disk_dir"], ignore_errors=True)
    try:
        for rung in RUNGS:
            bar.set_description(f"{Path(model).name}: {rung.name}")
            if rung is RUNGS[0]:
                if args.skip_hf:
                    results["mixed"].append(RungResult(rung.name, skipped="--skip-hf"))
                else:
                    rounds, _ = workloads["mixed"]
                    result = run_transformers(resolve_model_path(model), dtype, rounds, scale.new_tokens, args.hf_batch, pad, args.kv_cache_memory)
                    result.rung = rung.name
                    results["mixed"].append(result)
                results["revisit"].append(RungResult(rung.name, skipped="run on the mixed workload only"))
                bar.update(1)
                continue
            if rung.needs_windows and not windows:
                for name in workloads:
                    results[name].append(RungResult(rung.name, skipped="no sliding-window layers"))
                bar.update(1)
                continue
            rung_args = next(a for r, a in plan if r is rung)
            for name in workloads:
                results[name].append(median_run(runs[rung.name, name]))
            key = tuple(rung_args.get(k) for k in QUALITY_KEYS)
            rung_results = [results[name][-1] for name in workloads]
            if key in evaluated:
                source = evaluated[key]
                for result in rung_results:
                    result.perplexity_delta_pct, result.mean_kl, result.greedy_agreement = source.perplexity_delta_pct, source.mean_kl, source.greedy_agreement
                    result.quality_from = source.quality_from or source.rung
            else:
                quality = {k: v for k, v in rung_args.items() if k in QUALITY_KEYS or k in ("dtype", "disable_hybrid_kv_cache_manager")}
                scored = evaluation.run(rung.name, " ".join(f"{k}={v}" for k, v in quality.items()),
                                        EngineConfig(model=model, kv_cache_memory=max(args.kv_cache_memory, 0.25), **quality))  # fmt: skip
                for result in rung_results:
                    if evaluated:
                        result.perplexity_delta_pct, result.mean_kl, result.greedy_agreement = scored.perplexity_delta_pct, scored.mean_kl, scored.greedy_agreement
                    else:
                        result.perplexity_delta_pct, result.mean_kl, result.greedy_agreement = 0.0, 0.0, 1.0
                metas["mixed"].setdefault("perplexity", {})[rung.name] = scored.perplexity
                evaluated[key] = rung_results[0]
            bar.update(1)
    finally:
        evaluation.close()
    if args.llama_cpp:
        bar.set_description(f"{Path(model).name}: llama.cpp")
        try:
            metas["mixed"]["llama_cpp"] = llama_cpp_row(args, model, metas["mixed"])
        except LlamaCppError as error:
            print(f"{Path(model).name}: llama.cpp's row is left out: {error}", file=sys.stderr)
            metas["mixed"]["llama_cpp"] = {"error": str(error).splitlines()[0]}
    return {name: (results[name], metas[name]) for name in workloads}


def llama_cpp_row(args: argparse.Namespace, model: str, meta: dict) -> dict:
    """llama-batched-bench on the same GGUF: uniform prompts of the workload's mean length, min(requests,
    --llama-cpp-parallel) in parallel (it has no prefix cache, so this is its best case for the same token counts)."""
    prompt_len = round(meta["prompt_tokens"] / meta["requests"])
    parallel = [min(meta["requests"], args.llama_cpp_parallel)]
    rates = llama_cpp_rates(args.llama_cpp, str(resolve_model_path(model)), parallel, prompt_len, meta["new_tokens"], args.threads)
    return {"parallel": parallel[0], "prompt_len": prompt_len, "tokens_per_second": rates[parallel[0]]}


# ---------------------------------------------------------------------- reporting
def paired_ratios(rung: list[float], below: list[float]) -> float:
    """A rung's value over the rung below's: the median of the climbs' ratios, each climb's two runs
    taken minutes apart (a slow spell of the machine falls on both), where both kept every climb's
    value; else the ratio of the two values given (one each)."""
    if len(rung) != len(below) or not rung:
        raise ValueError(f"paired_ratios: {len(rung)} runs against {len(below)}")
    return statistics.median(r / b for r, b in zip(rung, below))


def climb_values(result: RungResult) -> tuple[list[float], list[float]]:
    """Every climb's tok/s and TTFT p50 of a rung (its one run's, when it ran once)."""
    return (result.extra.get("runs_tokens_per_second", [result.tokens_per_second]),
            result.extra.get("runs_ttft_p50", [result.ttft_p50]))  # fmt: skip


def step_ratios(result: RungResult, below: RungResult) -> tuple[float, float]:
    """(tok/s, TTFT p50) of a rung over the rung below, paired climb by climb (paired_ratios)."""
    (rate, ttft), (rate_below, ttft_below) = climb_values(result), climb_values(below)
    return paired_ratios(rate, rate_below), paired_ratios(ttft, ttft_below)


def fmt(value, spec: str, empty: str = "–") -> str:
    return empty if value is None else format(value, spec)


def table(results: list[RungResult], meta: dict) -> str:
    hf = results[0].tokens_per_second
    lines = ["| rung | generated tok/s | vs transformers | vs the rung below | TTFT p50 s | TTFT p50 vs the rung below | TTFT p99 s | "
             "prompt tokens cached | KV KiB / request | most running at once | perplexity Δ | mean KL | greedy agreement |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    below = None
    for r in results:
        if r.skipped:
            lines.append(f"| {r.rung} | skipped: {r.skipped} ||||||||||||")
            continue
        ratio = f"{r.tokens_per_second / hf:.2f}x" if hf else "–"
        step = step_ttft = "–"
        if below is not None and r.rung != RUNGS[0].name:
            rate, ttft = step_ratios(r, below)
            step, step_ttft = f"{rate:.2f}x", f"{ttft:.2f}x"
        if r.rung != RUNGS[0].name:
            below = r
        running = f"≈{r.max_concurrent} ({r.concurrency_note})" if r.concurrency_note else f"{r.max_concurrent}"
        shared = f" (as {r.quality_from})" if r.quality_from else ""
        quality = ("–", "–", "–") if r.rung == RUNGS[0].name else (
            f"{r.perplexity_delta_pct:+.2f}%{shared}", f"{r.mean_kl:.4f}", f"{100 * r.greedy_agreement:.1f}%")
        hits = r.extra.get("prefix_hit_tokens")
        cached = f"{hits:,} ({100 * hits / r.extra['prompt_tokens']:.0f}%)" if hits is not None and r.extra.get("prompt_tokens") else "–"
        lines.append(f"| {r.rung} | {r.tokens_per_second:.1f} | {ratio} | {step} | {r.ttft_p50:.2f} | {step_ttft} | {r.ttft_p99:.2f} | {cached} | "
                     f"{r.kv_bytes_per_request / 1024:,.0f} | {running} | {' | '.join(quality)} |")  # fmt: skip
    if "llama_cpp" in meta:
        row = meta["llama_cpp"]
        if "error" in row:
            lines.append(f"| llama.cpp `llama-batched-bench` | failed: {row['error']} ||||||||||||")
        else:
            ratio = f"{row['tokens_per_second'] / hf:.2f}x" if hf else "–"
            lines.append(f"| llama.cpp `llama-batched-bench` ({row['parallel']} x {row['prompt_len']}-token prompts, no prefix reuse) | "
                         f"{row['tokens_per_second']:.1f} | {ratio} |  |  |  |  |  |  |  |  |  |  |")  # fmt: skip
    return "\n".join(lines)


def label(rung: str) -> str:
    return textwrap.fill(rung, 12)


def plot_model(results: list[RungResult], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if not r.skipped]
    paged = [r for r in shown if r.rung != RUNGS[0].name]  # transformers has no pool to fill
    x = range(len(shown))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), constrained_layout=True)
    panels = [
        (axes[0][0], shown, [r.tokens_per_second for r in shown], "generated tokens/s (whole workload)", "#2563eb"),
        (axes[1][0], shown, [r.kv_bytes_per_request / 1024 for r in shown], "KV KiB per running request", "#d97706"),
        (axes[1][1], paged, [r.max_concurrent for r in paged], f"most requests running at once ({meta['kv_cache_memory_gib']} GiB of KV)", "#059669"),
    ]
    for ax, rungs, values, title, color in panels:
        bars = ax.bar(range(len(rungs)), values, color=color)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(rungs)), [label(r.rung) for r in rungs], fontsize=6.5)
    ax = axes[0][1]
    width = 0.4
    ax.bar([i - width / 2 for i in x], [r.ttft_p50 for r in shown], width, label="p50", color="#7c3aed")
    ax.bar([i + width / 2 for i in x], [r.ttft_p99 for r in shown], width, label="p99", color="#c4b5fd")
    ax.set_yscale("log")
    ax.set_title("TTFT seconds from the round's start (log)", fontsize=10)
    ax.legend(fontsize=8)
    ax.set_xticks(list(x), [label(r.rung) for r in shown], fontsize=6.5)
    fig.suptitle(f"{Path(meta['model']).name} ({meta['dtype']}): {meta['requests']} requests in {meta['rounds']} rounds, "
                 f"{meta['prompt_tokens']:,} prompt tokens, {meta['new_tokens']} generated each", fontsize=11)  # fmt: skip
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_headline(ladders: dict[str, tuple[list[RungResult], dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.6), constrained_layout=True)
    names = [r.name for r in RUNGS]
    width = 0.8 / max(1, len(ladders))
    baseline = RUNGS[0].name
    for k, (model, (results, _)) in enumerate(ladders.items()):
        first = next(r for r in results if r.tokens_per_second)
        base, baseline = first.tokens_per_second, first.rung
        xs = [i + (k - (len(ladders) - 1) / 2) * width for i, r in enumerate(results) if not r.skipped]
        ys = [r.tokens_per_second / base for r in results if not r.skipped]
        bars = ax.bar(xs, ys, width, label=Path(model).name)
        ax.bar_label(bars, fmt="%.1fx", fontsize=7)
    ax.set_xticks(range(len(names)), [label(n) for n in names], fontsize=8)
    ax.set_ylabel(f"generated tok/s, x {baseline}")
    ax.set_title("The KV cost ladder: one mixed chat / conversation / document workload, each rung adding one KV feature", fontsize=10)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def machine() -> str:
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{os.cpu_count()}-core {name}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every value a rung will use, checked before the first rung runs (a full run takes most of an hour)."""
    for name in ("kv_cache_memory", "tier_gib"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive number of GiB, got {getattr(args, name)}")
    if not hasattr(args, "repeats"):
        args.repeats = 1 if args.quick else 3
    for name in ("max_num_seqs", "hf_batch", "llama_cpp_parallel", "threads", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.model_list:
        parser.error("--models names no model")
    for model in args.model_list:
        try:
            resolve_model_path(model)
        except ValueError as exc:
            parser.error(f"--models: {exc}")
    if args.llama_cpp and not executable_file(args.llama_cpp):
        parser.error(f"--llama-cpp {args.llama_cpp}: not an executable file")
    if getattr(args, "out", None) is None:
        args.out = Path(tempfile.mkdtemp(prefix="kvserve-ladder-")) if args.quick else Path(__file__).resolve().parent.parent / "docs" / "ladder"
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: exists and is not a folder")


def write_page(out: Path, ladders: dict[str, dict[str, tuple[list[RungResult], dict]]], command: str, when: str, machine_name: str,
               quick: bool = False) -> None:
    """ladder.md, ladder.json and the plots in `out`, from every model's results by workload. The JSON
    (the runs) is written first; the page and plots are drawn in a temporary folder and moved in
    together, so a failure leaves the folder's page as it was."""
    record = {"command": command, "date": when, "machine": machine_name, "quick": quick, "ladders": {
        model: {"meta": by_workload["mixed"][1], "rungs": [dataclasses.asdict(r) for r in by_workload["mixed"][0]],
                **{name: {"meta": meta, "rungs": [dataclasses.asdict(r) for r in results]}
                   for name, (results, meta) in by_workload.items() if name != "mixed"}}
        for model, by_workload in ladders.items()}}  # fmt: skip
    (out / "ladder.json.tmp").write_text(json.dumps(record, indent=1))
    os.replace(out / "ladder.json.tmp", out / "ladder.json")
    with tempfile.TemporaryDirectory(dir=out, prefix=".ladder-") as drawn:
        draw_page(Path(drawn), ladders, command, when, machine_name, quick)
        for item in Path(drawn).iterdir():
            os.replace(item, out / item.name)
    print((out / "ladder.md").read_text())
    print(f"wrote {out}/ladder.md, ladder.json and the plots")


def draw_page(out: Path, ladders: dict[str, dict[str, tuple[list[RungResult], dict]]], command: str, when: str, machine_name: str,
              quick: bool) -> None:
    """ladder.md and the plots into `out`."""
    first = next(iter(next(iter(ladders.values())).values()))[1]
    parts = [f"<!-- written by bench/ladder.py: rerun it rather than editing -->\n# The KV cost ladder\n\n"
             f"Measured {when} on a {machine_name} with `{command}`. Every kvserve rung gets "
             f"{first['kv_cache_memory_gib']} GiB of KV and at most {first['max_num_seqs']} running requests; see bench/ladder.py for the "
             "workload. Every climb runs each rung in turn; a rung shows its median climb by tok/s, and its ratios to the rung "
             "below are the medians of the climbs' ratios (the two runs of a climb are minutes apart, so a slow spell of a shared "
             "machine falls on both).\n"
             + ("\n--quick: a smoke test of the script (10 requests of a few tokens each), not a measurement: a rung's rate is "
                "a few seconds of work and swings with the engine's first calls.\n" if quick else "")]  # fmt: skip
    for model, by_workload in ladders.items():
        slug = Path(model).name
        for name, (results, meta) in by_workload.items():
            picture = slug if name == "mixed" else f"{slug}-{name}"
            plot_model(results, meta, out / f"{picture}.png")
            what = WORKLOAD_TEXT[name]
            parts.append(f"## {slug} ({meta['dtype']}), {name} workload\n\n{what} {meta['requests']} requests in {meta['rounds']} rounds, "
                         f"{meta['prompt_tokens']:,} prompt tokens, {meta['new_tokens']} greedy tokens each.\n\n{table(results, meta)}\n\n"
                         f"![{picture}]({picture}.png)\n")  # fmt: skip
    plot_headline({model: by_workload["mixed"] for model, by_workload in ladders.items()}, out / "headline.png")
    (out / "ladder.md").write_text("\n".join(parts))


def recorded(path: Path, parser: argparse.ArgumentParser) -> tuple[dict[str, dict[str, tuple[list[RungResult], dict]]], str, str, str, bool]:
    """A ladder.json's results by model and workload, its command, date, machine and --quick (write_page's inputs)."""
    try:
        page = json.loads(path.read_text())
        ladders = {}
        for model, entry in page["ladders"].items():
            workloads = {"mixed": entry, **{name: entry[name] for name in WORKLOAD_TEXT if name != "mixed" and name in entry}}
            ladders[model] = {name: ([RungResult(**r) for r in w["rungs"]], w["meta"]) for name, w in workloads.items()}
        if not ladders:
            raise ValueError("no ladders in it")
        for by_workload in ladders.values():
            for results, meta in by_workload.values():
                check_recorded(results, meta)
                table(results, meta)  # every cell computes
        if not all(isinstance(page[k], str) for k in ("command", "date", "machine")):
            raise TypeError("command, date and machine must be strings")
        return ladders, page["command"], page["date"], page["machine"], bool(page.get("quick", False))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as error:
        parser.error(f"--from-json {path}: not a ladder.json this script wrote ({type(error).__name__}: {error})")


def check_recorded(results: list[RungResult], meta: dict) -> None:
    """A recorded workload's rungs as this script writes them: every figure a finite positive number,
    every kvserve rung's climbs as many as the others'."""
    if not results:
        raise ValueError(f"{meta.get('model')}: no rungs")
    for key in ("model", "dtype", "workload", "requests", "rounds", "prompt_tokens", "new_tokens", "kv_cache_memory_gib", "max_num_seqs"):
        if key not in meta:
            raise KeyError(f"meta has no {key!r}")
    climbs = set()
    for r in results:
        if not isinstance(r.rung, str) or not isinstance(r.extra, dict):
            raise TypeError(f"rung {r.rung!r}: a name and an extra dict")
        if r.skipped:
            continue
        values = [r.tokens_per_second, r.ttft_p50, r.ttft_p99, r.kv_bytes_per_request]
        if r.rung != RUNGS[0].name:
            rate, ttft = climb_values(r)
            if not isinstance(rate, list) or not isinstance(ttft, list) or not rate or len(rate) != len(ttft):
                raise ValueError(f"rung {r.rung!r}: its climbs' tok/s and TTFT lists differ or are empty")
            climbs.add(len(rate))
            values += rate + ttft
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"rung {r.rung!r}: every rate, time and size must be a finite positive number")
        if not isinstance(r.max_concurrent, int) or r.max_concurrent < 1:
            raise ValueError(f"rung {r.rung!r}: max_concurrent must be a positive integer")
    if len(climbs) > 1:
        raise ValueError(f"the rungs ran different numbers of climbs ({sorted(climbs)})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    parser.add_argument("--models", default="gemma-3-270m,qwen2.5-coder-0.5b-instruct", help="comma-separated aliases, GGUF files or HF directories")
    parser.add_argument("--out", type=Path, default=argparse.SUPPRESS,
                        help="folder for ladder.md, ladder.json and the plots (default: docs/ladder of this repository, "
                        "which the README shows; with --quick a new temporary folder)")
    parser.add_argument("--kv-cache-memory", type=float, default=0.03,
                        help="GiB of KV every kvserve rung gets (small: a round's requests do not all fit at 16 bits)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="the most requests a kvserve rung runs at once")
    parser.add_argument("--dtype", default="auto", help="model dtype (transformers runs in the same)")
    parser.add_argument("--tier-gib", type=float, default=1.0, help="the host tier's and the disk tier's budgets in the last rung")
    parser.add_argument("--hf-batch", type=int, default=8, help="transformers' batch size")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the transformers rung")
    parser.add_argument("--llama-cpp", default=None, metavar="PATH", help="llama.cpp's llama-batched-bench binary: adds its row (GGUF models)")
    parser.add_argument("--llama-cpp-parallel", type=int, default=16, help="llama-batched-bench's -npl")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's -t")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (which spans of text, in which order)")
    parser.add_argument("--repeats", type=int, default=argparse.SUPPRESS,
                        help="climbs of the kvserve rungs, each rung shown by its median run (a shared machine's swings fall on "
                        "every rung alike) (default: 3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a tiny workload and evaluation (for a tiny model: the test)")
    parser.add_argument("--from-json", type=Path, default=None, metavar="LADDER_JSON",
                        help="run nothing: write the page and plots again from a ladder.json this script wrote (its runs, "
                        "date, machine and command) into --out (docs/ladder of this repository unless given); the flags "
                        "that choose what runs are ignored")  # fmt: skip
    args = parser.parse_args(argv)
    if args.from_json is not None:
        if getattr(args, "out", None) is None:
            args.out = Path(__file__).resolve().parent.parent / "docs" / "ladder"
        if args.out.exists() and not args.out.is_dir():
            parser.error(f"--out {args.out}: exists and is not a folder")
        page = recorded(args.from_json, parser)
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            parser.error(f"--out {args.out}: {error}")
        write_page(args.out, *page)
        return
    check_args(parser, args)
    scale = QUICK if args.quick else Scale()
    models = args.model_list
    args.out.mkdir(parents=True, exist_ok=True)
    ladders: dict[str, dict[str, tuple[list[RungResult], dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-ladder-") as tier_dir:
        bar = tqdm(total=len(models) * len(RUNGS), unit="rung")
        for model in models:
            ladders[model] = climb(model, args, scale, bar, Path(tier_dir))
        bar.close()
    command = "python bench/ladder.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    write_page(args.out, ladders, command.strip(), time.strftime("%Y-%m-%d"), machine(), args.quick)


if __name__ == "__main__":
    main()
