"""`kvserve top URL`: a live view of a server's KV metrics, with advice."""

from __future__ import annotations

import argparse
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text


def scrape(url: str) -> dict[str, float]:
    """Metric samples by name (labels dropped; histograms keep their _sum/_count samples)."""
    response = httpx.get(url.rstrip("/") + "/metrics", timeout=5.0)
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.startswith("kvserve:") and "le" not in sample.labels:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
                if "tier" in sample.labels:  # the KV tiers' figures, also per tier
                    key = f"{sample.name}|{sample.labels['tier']}"
                    values[key] = values.get(key, 0.0) + sample.value
    return values


def tier_rows(m: dict[str, float]) -> list[tuple[str, str]]:
    """One row per KV tier: what it holds of its budget, and the prompt tokens loaded from it."""
    order = {"host": 0, "disk": 1}  # from the pool down
    tiers = sorted({key.split("|")[1] for key in m if key.startswith("kvserve:kv_tier_capacity_bytes|")}, key=lambda t: (order.get(t, 2), t))
    rows = []
    for tier in tiers:
        used, capacity = m.get(f"kvserve:kv_tier_usage_bytes|{tier}", 0.0), m[f"kvserve:kv_tier_capacity_bytes|{tier}"]
        hits = m.get(f"kvserve:kv_tier_hit_tokens_total|{tier}", 0.0)
        budget = f"{capacity / 2**20:,.1f} MiB" if capacity else "no maxmemory"
        state = ""
        if tier == "remote" and m.get("kvserve:kv_remote_up") == 0:
            state = ", DOWN: requests recompute"
        rows.append((f"KV tier {tier}", f"{used / 2**20:,.1f} / {budget}, {int(hits):,} tokens loaded{state}"))
    return rows


def advice(m: dict[str, float]) -> list[str]:
    usage = m.get("kvserve:kv_cache_usage_perc", 0.0)
    waiting = m.get("kvserve:num_requests_waiting", 0.0)
    tips = []
    if usage > 0.9:
        tips.append("KV usage above 90%: lower --max-num-seqs or give the cache more memory (--kv-cache-memory)")
    if usage < 0.5 and waiting > 0:
        tips.append("KV usage below 50% with requests waiting: raise concurrency (--max-num-seqs, --max-num-batched-tokens)")
    if waiting > 10:
        tips.append(f"{int(waiting)} requests waiting: the server is saturated; add capacity or shed load")
    queries = m.get("kvserve:prefix_cache_queries_total", 0.0)
    if queries > 0 and m.get("kvserve:prefix_cache_hits_total", 0.0) == 0 and m.get("kvserve:prefix_cache_requests_total", 0.0) >= 10:
        tips.append("no prefix cache hits in 10+ requests: prompts share no prefix of a whole block; put the shared part "
                    "(system prompt, document) first, or try --prefix-cache radix for shorter shared runs")
    return tips


def rates_between(previous: dict[str, float], current: dict[str, float], seconds: float) -> dict[str, float]:
    """Tokens per second between two samples of the counters."""
    dt = max(seconds, 1e-6)
    return {
        key: (current.get(f"kvserve:{name}", 0.0) - previous.get(f"kvserve:{name}", 0.0)) / dt
        for key, name in (("gen", "generation_tokens_total"), ("prompt", "prompt_tokens_total"))
    }


def _mean(m: dict[str, float], name: str) -> str:
    count = m.get(f"kvserve:{name}_count", 0.0)
    return f"{m.get(f'kvserve:{name}_sum', 0.0) / count * 1000:.1f} ms" if count else "-"


def render(url: str, m: dict[str, float], rates: dict[str, float]) -> Group:
    table = Table(title=f"kvserve top — {url}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    usage = m.get("kvserve:kv_cache_usage_perc", 0.0)
    total = m.get("kvserve:kv_cache_blocks_total", 0.0)
    free = m.get("kvserve:kv_cache_blocks_free", 0.0)
    rows = [
        ("KV cache usage", f"{usage * 100:.1f}%  ({int(total - free)}/{int(total)} blocks)"),
        ("KV bytes per token", f"{int(m.get('kvserve:kv_cache_bytes_per_token', 0))}"),
        ("requests running", f"{int(m.get('kvserve:num_requests_running', 0))}"),
        ("requests waiting", f"{int(m.get('kvserve:num_requests_waiting', 0))}"),
        ("preemptions", f"{int(m.get('kvserve:num_preemptions_total', 0))}"),
        ("generation tokens/s", f"{rates['gen']:.1f}" if "gen" in rates else "- (needs two samples)"),
        ("prompt tokens/s", f"{rates['prompt']:.1f}" if "prompt" in rates else "- (needs two samples)"),
        ("prefix cache hit rate (tokens)", _ratio(m, "prefix_cache_hits_total", "prefix_cache_queries_total")),
        ("prefix cache hit rate (requests)", _ratio(m, "prefix_cache_requests_hit_total", "prefix_cache_requests_total")),
        ("prefix cache reused / reusable", _ratio(m, "prefix_cache_hits_total", "prefix_cache_eligible_tokens_total")),
        ("speculative acceptance (guessed tokens kept)", _ratio(m, "spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total")),
        ("mean TTFT", _mean(m, "time_to_first_token_seconds")),
        ("mean TPOT", _mean(m, "request_time_per_output_token_seconds")),
        *tier_rows(m),
    ]
    for name, value in rows:
        table.add_row(name, value)
    tips = advice(m)
    if tips:
        return Group(table, *(Text("• " + t, style="yellow") for t in tips))
    if m.get("kvserve:num_requests_running", 0.0) == 0 and m.get("kvserve:num_requests_waiting", 0.0) == 0:
        return Group(table, Text("idle: no request running or waiting; advice appears under load (KV usage, queue, prefix hits)",
                                 style="green"))
    return Group(table, Text("no advice: KV usage and the queue are healthy", style="green"))


def _ratio(m: dict[str, float], part: str, whole: str) -> str:
    total = m.get(f"kvserve:{whole}", 0.0)
    return f"{m.get(f'kvserve:{part}', 0.0) / total * 100:.1f}%" if total else "-"


def run_top(args: argparse.Namespace) -> int:
    console = Console()
    try:
        previous, last_time = scrape(args.url), time.monotonic()
    except httpx.HTTPError as exc:
        console.print(f"[red]cannot read {args.url}/metrics: {exc}[/red]")
        return 1
    if args.once:  # two samples --interval apart, so the rates are measured rather than shown as 0
        time.sleep(args.interval)
        try:
            current = scrape(args.url)
        except httpx.HTTPError as exc:
            console.print(f"[red]cannot read {args.url}/metrics: {exc}[/red]")
            return 1
        console.print(render(args.url, current, rates_between(previous, current, time.monotonic() - last_time)))
        return 0
    with Live(render(args.url, previous, {}), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(args.interval)
            try:
                current = scrape(args.url)
            except httpx.HTTPError as exc:
                live.update(Text(f"cannot read {args.url}/metrics: {exc}", style="red"))
                continue
            now = time.monotonic()
            live.update(render(args.url, current, rates_between(previous, current, now - last_time)))
            previous, last_time = current, now
