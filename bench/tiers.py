"""KV tiers: a long prefix's time to first token when it is in the pool, in the host tier, in the
disk tier, in the remote tier (a redis-server on loopback, started here), and nowhere (recomputed);
and a multi-tenant workload whose shared prefixes are 4x the pool, with tiers against without.

The prefix is real prose (GPL-3, GFDL-1.3, then the stdlib's source); each request adds a short question and asks
for one token, one request at a time, so TTFT is the request's own prefill or load. The pool's copy is
dropped with reset_prefix_cache (the tiers keep theirs); every tier-hit row asserts the tokens came
from that tier. Page cache: before a disk-tier request the bench asks Linux to drop clean caches
(/proc/sys/vm/drop_caches, root only) and says whether it could.

    .venv/bin/python bench/tiers.py                                   # Gemma 3 and SmolLM2, 4K and 16K (~6 min)
    .venv/bin/python bench/tiers.py --models gemma-3-270m --lengths 4096 --skip-tenants
    .venv/bin/python bench/tiers.py --skip-ttft                       # the multi-tenant workload only
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from common import prose_token_ids  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.plan.cli import load_model_config  # noqa: E402
from redis_server import RedisServer  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0)


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def long_prose(tokenizer, length: int) -> list[int]:
    """Real prose, then the standard library's source, until there are length + 2,000 tokens."""
    import inspect
    import argparse as a, collections, email.message as e, json.decoder as j, logging as lg, pathlib as pl, typing as ty  # noqa: E401

    ids = prose_token_ids(tokenizer)
    for module in (a, collections, e, j, lg, pl, ty):
        if len(ids) >= length + 2000:
            break
        ids += tokenizer.encode(inspect.getsource(module), add_special_tokens=False)
    return ids


def timed(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate([prompt], ONE, use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def prefix_ttft(model: str, length: int, repeat: int) -> list[tuple[str, float, int]]:
    """(where, TTFT seconds (median of repeat), cached tokens) for pool, host, disk, remote and nowhere."""
    rows = []
    with tempfile.TemporaryDirectory() as disk_dir, RedisServer(maxmemory="8gb") as redis_server:
        settings = dict(max_model_len=length + 64, kv_cache_memory=1.0, kv_offload_policy="write_through")
        plain = LLM(model, max_model_len=length + 64, kv_cache_memory=1.0)  # recompute, as an engine without tiers does it
        tiers = {
            "host": LLM(model, kv_offload_host_gib=1.0, **settings),
            "disk": LLM(model, kv_offload_disk_dir=disk_dir, kv_offload_disk_gib=2.0, **settings),
            "remote": LLM(model, kv_remote_url=redis_server.url, **settings),
        }
        ids = long_prose(tiers["host"].tokenizer, length)
        for llm in (plain, *tiers.values()):  # first-request costs (the pool's pages, the kernels' first calls) left out
            llm.generate([ids[-100:]], ONE, use_tqdm=False)
        rng = random.Random(length)
        results: dict[str, list[tuple[float, int]]] = {"nowhere": [], "pool": [], "host": [], "disk": [], "remote": []}
        dropped = True
        for r in range(repeat):
            start = rng.randrange(0, len(ids) - length - 32)
            prefix = ids[start : start + length]
            question = lambda i: ids[i * 97 % len(ids) :][:16]  # noqa: E731
            results["nowhere"].append(timed(plain, prefix + question(3 * r)))
            plain.reset_prefix_cache()
            for name, llm in tiers.items():
                timed(llm, prefix + question(3 * r))  # computed, and copied down (write-through)
                llm.engine.kv.offloader.drain()
                if name == "host":
                    results["pool"].append(timed(llm, prefix + question(3 * r + 1)))
                llm.reset_prefix_cache()
                if name == "disk":
                    dropped &= drop_page_cache()
                results[name].append(timed(llm, prefix + question(3 * r + 2)))
                hits = llm.stats()["kv_tiers"][name]["hit_tokens"]
                assert hits > 0, f"{name}: the prefix did not come from the tier ({llm.stats()['kv_offload_decisions_total']})"
        for where in ("pool", "host", "disk", "remote", "nowhere"):
            rows.append((where, statistics.median(t for t, _ in results[where]), min(c for _, c in results[where])))
        for llm in tiers.values():
            llm.engine.kv.offloader.close()
    print(f"  (page cache dropped before disk reads: {'yes' if dropped else 'no (not permitted here): disk reads may come from the page cache'})")
    return rows


def write_cost(model: str, length: int, repeat: int) -> list[tuple[str, float]]:
    """A cold prefill's time (median of repeat, each a new prefix) without tiers, with every computed
    block copied to the host tier (write-through), and to a remote tier (as every block always is)."""
    rows = []
    with RedisServer(maxmemory="8gb") as redis_server:
        engines = {
            "no tiers": LLM(model, max_model_len=length + 64, kv_cache_memory=1.0),
            "host tier, write-through": LLM(model, max_model_len=length + 64, kv_cache_memory=1.0, kv_offload_host_gib=2.0,
                                            kv_offload_policy="write_through"),
            "remote tier (Redis)": LLM(model, max_model_len=length + 64, kv_cache_memory=1.0, kv_remote_url=redis_server.url),
        }  # fmt: skip
        ids = long_prose(engines["no tiers"].tokenizer, length)
        rng = random.Random(1)
        starts = [rng.randrange(0, len(ids) - length - 32) for _ in range(repeat)]
        for label, llm in engines.items():
            llm.generate([ids[-100:]], ONE, use_tqdm=False)
            times = []
            for start in starts:
                times.append(timed(llm, ids[start : start + length])[0])
                if llm.engine.kv.offloader is not None:
                    llm.engine.kv.offloader.drain()
                llm.reset_prefix_cache()
            rows.append((label, statistics.median(times)))
            if llm.engine.kv.offloader is not None:
                llm.engine.kv.offloader.close()
    return rows


def tenants(model: str, prefix_len: int, tenants_count: int, rounds: int) -> list[tuple[str, float, int]]:
    """Tenants' shared prefixes, together 4x the pool, each followed by short questions in turns:
    generated tok/s and prompt tokens recomputed, with a host tier (room for every prefix) and without."""
    probe = LLM(model, max_model_len=prefix_len + 64, num_kv_blocks=1024)
    pool_gib = tenants_count * prefix_len * probe.stats()["bytes_per_token"] / 4 / 2**30
    del probe
    rows = []
    for label, extra in (("pool only", {}), ("pool + host tier", {"kv_offload_host_gib": 4 * pool_gib + 0.05})):
        llm = LLM(model, max_model_len=prefix_len + 64, kv_cache_memory=pool_gib, **extra)
        ids = prose_token_ids(llm.tokenizer)
        rng = random.Random(7)
        prefixes = [ids[s : s + prefix_len] for s in (rng.randrange(0, len(ids) - prefix_len) for _ in range(tenants_count))]
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        generated = 0
        for r in range(rounds):
            for t, prefix in enumerate(prefixes):
                prompt = prefix + ids[(t * 31 + r * 7) % 1000 :][:16]
                generated += len(llm.generate([prompt], params, use_tqdm=False)[0].token_ids)
        seconds = time.perf_counter() - start
        stats = llm.stats()
        rows.append((label, generated / seconds, stats["prompt_tokens_total"] - stats["prefix_cache_hits_total"]))
        if llm.engine.kv.offloader is not None:
            llm.engine.kv.offloader.close()
    return rows


def streaming_gaps(model: str, prefix_len: int, rounds: int = 5) -> tuple[float, float, int]:
    """A streaming request's inter-token gap p99 (seconds) alone, and while another request's
    prefix_len-token prefix loads from the disk tier (page cache dropped); and the tokens it got
    while the loads were in flight. `rounds` of each, in turns, their gaps pooled (64 tokens a round)."""
    with tempfile.TemporaryDirectory() as disk_dir:
        llm = LLM(model, max_model_len=prefix_len + 256, kv_cache_memory=1.0, kv_offload_disk_dir=disk_dir, kv_offload_disk_gib=2.0,
                  kv_offload_policy="write_through")  # fmt: skip
        ids = long_prose(llm.tokenizer, prefix_len)
        llm.generate([ids[-100:]], ONE, use_tqdm=False)
        prefix = ids[:prefix_len]
        llm.generate([prefix], ONE, use_tqdm=False)
        engine = llm.engine
        gaps: dict[str, list[float]] = {"alone": [], "beside a load": []}
        during = 0
        for r in range(rounds):
            for label in gaps:
                engine.kv.offloader.drain()
                llm.reset_prefix_cache()
                drop_page_cache()
                stream = engine.add_request(ids[1000 + r:1200 + r], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), stream=True)
                loaded = None
                times = []
                while engine.has_unfinished_requests():
                    if label != "alone" and loaded is None and len(times) == 8:
                        loaded = engine.add_request(prefix + ids[5000 + r : 5016 + r], ONE)
                    loading = loaded is not None and loaded.request_id in engine.scheduler.loading
                    for out in engine.step():
                        if out.request_id == stream.request_id and out.token_ids:
                            times.append(time.perf_counter())
                            during += loading
                gaps[label] += [b - a for a, b in zip(times, times[1:])]
                if loaded is not None:
                    assert loaded.num_cached_tokens >= prefix_len - 16, "the prefix did not come from the disk tier"
        engine.kv.offloader.close()
    p99 = lambda g: sorted(g)[min(len(g) - 1, int(0.99 * len(g)))]  # noqa: E731
    return p99(gaps["alone"]), p99(gaps["beside a load"]), during


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma-3-270m,smollm2-135m-instruct")
    parser.add_argument("--lengths", default="4096,16384", help="prefix lengths in tokens")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-tenants", action="store_true")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-gaps", action="store_true", help="leave out the streaming gap beside a disk load")
    parser.add_argument("--gap-rounds", type=int, default=5, help="streams alone and beside a load, in turns, gaps pooled")
    parser.add_argument("--write-cost", action="store_true", help="also: a cold prefill's time with blocks written to the tiers")
    args = parser.parse_args()
    if not args.skip_ttft:
        print("| model | prefix tokens | where the prefix is | TTFT (s) | vs recompute | cached tokens |")
        print("|---|---:|---|---:|---:|---:|")
    for model in args.models.split(",") if not args.skip_ttft else ():
        context = load_model_config(model).max_position_embeddings
        for length in (int(n) for n in args.lengths.split(",")):
            if length + 64 > context:
                print(f"  ({model}: {length:,} tokens is past its context of {context:,}; {context - 64:,} instead)")
                length = context - 64
            rows = prefix_ttft(model, length, args.repeat)
            recompute = dict((w, t) for w, t, _ in rows)["nowhere"]
            for where, seconds, cached in rows:
                print(f"| {model} | {length:,} | {where} | {seconds:.3f} | {seconds / recompute:.1%} | {cached:,} |", flush=True)
    if args.write_cost:
        print()
        print("| model | prefix tokens | cold prefill | TTFT (s) | vs no tiers |")
        print("|---|---:|---|---:|---:|")
        for model in args.models.split(","):
            for length in (int(n) for n in args.lengths.split(",")):
                length = min(length, load_model_config(model).max_position_embeddings - 64)
                rows = write_cost(model, length, args.repeat)
                for label, seconds in rows:
                    print(f"| {model} | {length:,} | {label} | {seconds:.3f} | {seconds / rows[0][1]:.2f}x |", flush=True)
    if not args.skip_gaps:
        print()
        print("| model | prefix loading beside the stream | stream's gap p99 alone (ms) | beside the load (ms) | ratio | tokens during the load |")
        print("|---|---:|---:|---:|---:|---:|")
        for model in args.models.split(","):
            alone, beside, during = streaming_gaps(model, 4096, args.gap_rounds)
            print(f"| {model} | 4,096 from disk | {alone * 1000:.1f} | {beside * 1000:.1f} | {beside / alone:.2f}x | {during} |", flush=True)
    if not args.skip_tenants:
        print()
        print("| model | tenants x prefix | engine | generated tok/s | prompt tokens recomputed |")
        print("|---|---|---|---:|---:|")
        for model in args.models.split(","):
            for label, rate, recomputed in tenants(model, 2048, 8, 3):
                print(f"| {model} | 8 x 2,048 | {label} | {rate:.1f} | {recomputed:,} |", flush=True)


if __name__ == "__main__":
    main()
