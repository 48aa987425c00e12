"""GET /v1/loads: SGLang's load report, which routers poll to balance load and shed it.

smg (the router `kvserve cluster` runs) asks every worker for
`/v1/loads?include=core,disagg,queues,memory` every `--load-monitor-interval` seconds and reads
`loads[].num_waiting_reqs` and `token_usage` (overload protection), `num_used_tokens` and
`max_total_num_tokens` (its token-aware policies) and the rest for `/get_loads` and its gauges.
One engine is one data-parallel rank. Token counts are in tokens of every layer the pool holds.
"""

from __future__ import annotations

import collections
import time
from datetime import datetime, timezone

SECTIONS = ("core", "memory", "queues", "disagg")
_GIB = 2**30
_DISAGG_MODES = {"both": "null", "producer": "prefill", "consumer": "decode"}


def parse_include(include: str | None) -> frozenset[str]:
    """`include=core,memory,...` (or `all`, the default): the sections asked for; core always comes."""
    if include is None or include.strip() in ("", "all"):
        return frozenset(SECTIONS)
    names = [name.strip() for name in include.split(",")]
    unknown = [name for name in names if name not in SECTIONS and name != "all"]
    if unknown:
        raise ValueError(f"include: unknown section {unknown[0][:40]!r}; the sections are all, {', '.join(SECTIONS)}")
    return frozenset(SECTIONS) if "all" in names else frozenset(["core", *names])


class GenerationRate:
    """Generated tokens per second over the last `window` seconds, from the engine's running total
    (sampled at most once a second, on the engine thread)."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def observe(self, generated_total: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._samples and now - self._samples[-1][0] < 1.0:
            return
        self._samples.append((now, generated_total))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()

    def rate(self, generated_total: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if not self._samples:
            return 0.0
        since, base = self._samples[0]
        return (generated_total - base) / (now - since) if now - since > 0 else 0.0


def load_report(stats: dict, sections: frozenset[str], version: str, admitting: int = 0, gen_throughput: float = 0.0) -> dict:
    """The report from an engine stats() snapshot; `admitting`: requests accepted and not yet in the engine."""
    capacity = stats["token_capacity"]
    usage = stats["kv_cache_usage"]
    used = round(usage * capacity)
    running = stats["num_running"]
    waiting = stats["num_waiting"] + admitting
    queries = stats["prefix_cache_queries_total"]
    rank = {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_waiting_uncached_tokens": stats["num_waiting_tokens"],
        "num_total_reqs": running + waiting,
        "num_used_tokens": used,
        "num_total_tokens": used + stats["num_waiting_tokens"],
        "max_total_num_tokens": capacity,
        "max_running_requests": stats["max_num_seqs"],
        "token_usage": round(usage, 4),
        "gen_throughput": round(gen_throughput, 2),
        "cache_hit_rate": round(stats["prefix_cache_hits_total"] / queries, 4) if queries else 0.0,
        "utilization": round(running / stats["max_num_seqs"], 4),
    }
    if "memory" in sections:
        rank["memory"] = {
            "kv_cache_gb": round(stats["kv_cache_bytes"] / _GIB, 6),
            "token_capacity": capacity,
            "bytes_per_token": stats["bytes_per_token"],
            "num_blocks": stats["num_blocks"],
            "num_free_blocks": stats["num_free_blocks"],
            "block_size": stats["block_size"],
        }
    if "queues" in sections:
        rank["queues"] = {"waiting": stats["num_waiting"], "admitting": admitting, "preemptions_total": stats["num_preemptions"]}
    if "disagg" in sections:
        rank["disagg_mode"] = _DISAGG_MODES[stats["kv_role"]]
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": version,
        "dp_rank_count": 1,
        "loads": [rank],
        "aggregate": {
            "total_running_reqs": running,
            "total_waiting_reqs": waiting,
            "total_reqs": running + waiting,
            "total_used_tokens": used,
            "total_max_tokens": capacity,
            "avg_token_usage": rank["token_usage"],
            "avg_throughput": rank["gen_throughput"],
            "avg_utilization": rank["utilization"],
        },
    }
