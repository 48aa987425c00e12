"""Prometheus metrics with vLLM's names under the `kvserve:` prefix.

Only request ids ever reach logs; no prompt text, token ids or salts are exported.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvserve:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvserve:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"kvserve:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1)")
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch")
        self.conversation_pinned_blocks = gauge("kv_conversation_pinned_blocks", "KV blocks stored conversations keep pinned "
                                                "for their next turn (counted in kv_cache_usage_perc)")  # fmt: skip
        self._lora_info = Gauge("kvserve:lora_requests_info", "LoRA adapters of the running and waiting requests (labels), "
                                "the time of the last update (value), as vLLM's", ["max_lora", "running_lora_adapters",
                                "waiting_lora_adapters"], registry=r)  # fmt: skip
        self._lora_labels: tuple[str, str, str] | None = None
        self._lora_served: dict[str, int] = {}  # adapter name -> its lora_int_id while served
        self._lora_requests = Counter("kvserve:lora_requests", "Requests finished per LoRA adapter", labels + ["lora_name"], registry=r)
        self._lora_queries = Counter("kvserve:lora_prefix_cache_queries", "Prompt tokens of finished requests per LoRA adapter",
                                     labels + ["lora_name"], registry=r)  # fmt: skip
        self._lora_hits = Counter("kvserve:lora_prefix_cache_hits", "Of those, prompt tokens served from the prefix cache (cached under "
                                  "that adapter)", labels + ["lora_name"], registry=r)  # fmt: skip
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_blocks_total = gauge("kv_cache_blocks_total", "KV blocks in the pool")
        self.kv_cache_blocks_free = gauge("kv_cache_blocks_free", "KV blocks free")
        self.kv_cache_bytes_per_token = gauge("kv_cache_bytes_per_token", "KV bytes one token occupies across all layers")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted by recompute")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prefix_cache_eligible = counter(
            "prefix_cache_eligible_tokens", "Prompt tokens a prefix cache could serve at most (all but each prompt's last)"
        )
        self.prefix_cache_requests = counter("prefix_cache_requests", "Requests looked up in the prefix cache")
        self.prefix_cache_requests_hit = counter("prefix_cache_requests_hit", "Requests that reused at least a block's worth of cached tokens")
        self.prefix_cache_evictions = counter("prefix_cache_evictions", "Cached blocks evicted to make room")
        self.kv_evicted_tokens = counter("kv_evicted_tokens", "Cached tokens dropped by --kv-compression (their slots freed)")
        self.kv_compactions = counter("kv_compactions", "Sequences' caches compacted by --kv-compression")
        self.kv_probe_tokens = counter("kv_probe_tokens", "Tokens of --snapkv-query generic's question, computed to score prompts and dropped")
        self._misses = Counter("kvserve:prefix_cache_misses", "Lookups that reused nothing, by reason",
                               ["model_name", "reason"], registry=r)  # fmt: skip
        self._model_name = model_name
        self._success = Counter("kvserve:request_success", "Requests that finished, by finished_reason (stop or length)",
                                ["model_name", "finished_reason"], registry=r)  # fmt: skip
        for reason in ("stop", "length"):
            self._success.labels(model_name, reason)  # both series exist from the start, at 0
        self._rejected = Counter("kvserve:request_rejected", "HTTP requests answered with an error before admission, by reason",
                                 ["model_name", "reason"], registry=r)  # fmt: skip
        self._aborted = Counter("kvserve:request_aborted", "HTTP requests aborted after admission, by reason",
                                ["model_name", "reason"], registry=r)  # fmt: skip
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token", _LATENCY_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Mean time between output tokens", _TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled", _LATENCY_BUCKETS)
        self._last_totals: dict[str, float] = {}
        # the KV tiers under the pool (kv/tiers/), labelled by tier and direction (in: loads, out: offloads)
        tier = ["model_name", "tier"]
        self._tier_usage = Gauge("kvserve:kv_tier_usage_bytes", "Bytes a KV tier holds (records and their index)", tier, registry=r)
        self._tier_capacity = Gauge("kvserve:kv_tier_capacity_bytes", "A KV tier's budget", tier, registry=r)
        self._offload_bytes = Counter("kvserve:kv_offload_bytes", "Bytes of KV records moved between the pool and a tier",
                                      [*tier, "direction"], registry=r)  # fmt: skip
        self._offload_seconds = Counter("kvserve:kv_offload_seconds", "Seconds spent moving KV records, by tier and direction",
                                        [*tier, "direction"], registry=r)  # fmt: skip
        self._tier_hits = Counter("kvserve:kv_tier_hit_tokens", "Prompt tokens requests took from KV blocks loaded from a tier instead of recomputed", tier, registry=r)
        self._tier_corrupt = Counter("kvserve:kv_tier_corrupt_records", "Unusable KV records found (damaged, truncated, foreign): "
                                     "recomputed", tier, registry=r)  # fmt: skip
        self._tier_rejected = Counter("kvserve:kv_tier_records_rejected", "KV records refused when read, by reason: damaged, "
                                      "foreign (another cache or block), unsigned or bad_signature (with --kv-remote-key-file): "
                                      "recomputed, never served", [*tier, "reason"], registry=r)  # fmt: skip
        self._tier_write_failures = Counter("kvserve:kv_tier_write_failures", "KV records a tier's medium refused to store (a full "
                                            "or vanished disk, a server error): recomputed when needed", tier, registry=r)  # fmt: skip
        self._tier_queries = counter("kv_tier_query_tokens", "Prompt tokens past the pool's prefix hit looked up in the KV tiers")
        self._offload_dropped = counter("kv_offload_dropped_blocks", "Blocks that left the pool while the tiers' writer was "
                                        "256 MiB behind: not stored (recomputed when needed)")
        self._writer_waits = counter("kv_offload_writer_waits", "Computed blocks (write-through, the shared tier) that waited for "
                                     "the tiers' writer to fall below 256 MiB behind")
        self._loads_cut = counter("kv_offload_loads_cut", "Loads from a KV tier cut for running past 3x their estimate: "
                                  "their requests took the prefix loaded so far and recomputed the rest")
        self._offload_decisions = Counter("kvserve:kv_offload_decisions", "Per request with a tier hit: loaded or recomputed "
                                          "(measured rates)", ["model_name", "decision"], registry=r)  # fmt: skip
        self._tier_requests = Counter("kvserve:kv_tier_requests_served", "Requests whose prefix a load from a KV tier served "
                                      "(the remote tier on a --kv-role consumer: hand-overs received)", tier, registry=r)  # fmt: skip
        # exported only with a remote tier: a 0 must mean an outage an alert can fire on, never "no tier"
        self._remote_up = Gauge("kvserve:kv_remote_up", "1 while the remote KV tier (--kv-remote-url) answers, 0 during an outage",
                                ["model_name"], registry=r)  # fmt: skip
        self._remote_timeouts = counter("kv_remote_timeouts", "Calls to the remote KV tier past --kv-remote-timeout-ms")
        self._remote_outages = counter("kv_remote_outages", "Times the remote KV tier went down (each logged once)")
        self._handovers = counter("kv_handovers_published", "Requests a --kv-role producer answered once their blocks were in the remote tier")
        self._migrations = Counter("kvserve:kv_migrations", "Running requests moved between servers (POST /v1/kv/migrate): "
                                   "out, in, failed (they finished at the source), and records_rejected (migrated KV records "
                                   "that failed their checks: recomputed)", ["model_name", "event"], registry=r)  # fmt: skip
        # as vLLM's cache_config_info: the cache's settings as labels of a constant 1, set at the first update
        self._config_labels = ["model_name", "kv_cache_dtype", "block_size", "kv_hadamard", "kv_key_centering", "kv_quant_sink_block",
                               "prefix_cache", "kv_compression"]  # fmt: skip
        self._cache_config = Gauge("kvserve:cache_config_info", "The KV cache's configuration (labels; value 1)",
                                   self._config_labels, registry=r)  # fmt: skip
        self._cache_config_set = False
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Speculative decoding: sequences that guessed tokens in a step")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: tokens guessed")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative decoding: guessed tokens kept")
        self._accepted_per_pos = Counter("kvserve:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: guessed tokens "
                                         "kept, by their position in the guess (0: the first)", labels + ["position"], registry=r)  # fmt: skip
        self.grammar_compiles_pending = gauge("grammar_compiles_pending", "Grammar compiles (structured outputs, tools) queued or running")
        self._grammar_compiles = Counter("kvserve:grammar_compiles", "Grammar compiles ended, by outcome: compiled, refused (a 400), "
                                         "timeout, out_of_memory, dropped (its clients left), rejected (the client's queue was full: "
                                         "a 429)", labels + ["outcome"], registry=r)  # fmt: skip

    def _update_lora(self, lora: dict | None) -> None:
        """vLLM's lora_requests_info: one series, the adapters running and waiting as labels, the time as its value."""
        if lora is None:
            return
        labels = (str(lora["max_lora"]), ",".join(lora["running"]), ",".join(lora["waiting"]))
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self._lora_info.remove(*self._lora_labels)
            self._lora_labels = labels
        self._lora_info.labels(*labels).set(time.time())

    def update_from_stats(self, stats: dict) -> None:
        """Refresh gauges and move counters by what the engine counted since the last call."""
        if not self._cache_config_set:
            values = {**stats, "model_name": self._model_name}
            label = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731  (true/false, as Prometheus writes them)
            self._cache_config.labels(*[label(values[name]) for name in self._config_labels]).set(1)
            self._cache_config_set = True
        self.kv_cache_usage_perc.set(stats["kv_cache_usage"])
        self.conversation_pinned_blocks.set(stats.get("kv_conversation_pinned_blocks", 0))
        self.num_requests_running.set(stats["num_running"])
        self._update_lora(stats.get("lora"))
        self.num_requests_waiting.set(stats["num_waiting"])
        self.kv_cache_blocks_total.set(stats["num_blocks"])
        self.kv_cache_blocks_free.set(stats["num_free_blocks"])
        self.kv_cache_bytes_per_token.set(stats["bytes_per_token"])
        for key, counter in (
            ("num_preemptions", self.num_preemptions),
            ("prompt_tokens_total", self.prompt_tokens),
            ("generation_tokens_total", self.generation_tokens),
            ("prefix_cache_queries_total", self.prefix_cache_queries),
            ("prefix_cache_hits_total", self.prefix_cache_hits),
            ("prefix_cache_eligible_tokens_total", self.prefix_cache_eligible),
            ("prefix_cache_requests_total", self.prefix_cache_requests),
            ("prefix_cache_requests_hit_total", self.prefix_cache_requests_hit),
            ("prefix_cache_evictions_total", self.prefix_cache_evictions),
            ("kv_evicted_tokens_total", self.kv_evicted_tokens),
            ("kv_compactions_total", self.kv_compactions),
            ("kv_probe_tokens_total", self.kv_probe_tokens),
            ("spec_decode_num_drafts_total", self.spec_decode_num_drafts),
            ("spec_decode_num_draft_tokens_total", self.spec_decode_num_draft_tokens),
            ("spec_decode_num_accepted_tokens_total", self.spec_decode_num_accepted_tokens),
        ):
            self._advance(key, stats[key], counter)
        for position, total in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            self._advance(f"spec_pos:{position}", total, self._accepted_per_pos.labels(self._model_name, str(position)))
        for reason, total in stats["prefix_cache_misses_total"].items():
            self._advance(f"miss:{reason}", total, self._misses.labels(self._model_name, reason))
        self._update_tiers(stats)

    def update_grammar_compiles(self, pending: int, outcomes: dict[str, int]) -> None:
        self.grammar_compiles_pending.set(pending)
        for outcome, total in outcomes.items():
            self._advance(f"grammar:{outcome}", total, self._grammar_compiles.labels(self._model_name, outcome))

    def _update_tiers(self, stats: dict) -> None:
        name = self._model_name
        for tier, t in stats.get("kv_tiers", {}).items():
            self._tier_usage.labels(name, tier).set(t["usage_bytes"])
            self._tier_capacity.labels(name, tier).set(t["capacity_bytes"])
            for direction, field in (("out", "written"), ("in", "read")):
                self._advance(f"bytes:{tier}:{direction}", t[f"bytes_{field}"], self._offload_bytes.labels(name, tier, direction))
                self._advance(f"seconds:{tier}:{direction}", t[f"seconds_{field}"], self._offload_seconds.labels(name, tier, direction))
            self._advance(f"tier_hits:{tier}", t["hit_tokens"], self._tier_hits.labels(name, tier))
            self._advance(f"tier_corrupt:{tier}", t["corrupt_records"], self._tier_corrupt.labels(name, tier))
            for reason, total in t["records_rejected"].items():
                self._advance(f"tier_rejected:{tier}:{reason}", total, self._tier_rejected.labels(name, tier, reason))
            self._advance(f"tier_write_failures:{tier}", t["write_failures"], self._tier_write_failures.labels(name, tier))
            self._advance(f"tier_requests:{tier}", t["requests_served"], self._tier_requests.labels(name, tier))
            if tier == "remote":
                self._remote_up.labels(name).set(1 if t["up"] else 0)
                self._advance("remote_timeouts", t["timeouts"], self._remote_timeouts)
                self._advance("remote_outages", t["outages"], self._remote_outages)
        self._advance("handovers", stats.get("kv_handovers_published_total", 0), self._handovers)
        for event, total in stats.get("kv_migrations_total", {}).items():
            if event != "hit_tokens":
                self._advance(f"migrations:{event}", total, self._migrations.labels(name, event))
        if "kv_tier_query_tokens_total" in stats:
            self._advance("kv_tier_query_tokens", stats["kv_tier_query_tokens_total"], self._tier_queries)
            self._advance("kv_offload_dropped", stats["kv_offload_dropped_blocks_total"], self._offload_dropped)
            self._advance("kv_offload_writer_waits", stats["kv_offload_writer_waits_total"], self._writer_waits)
            self._advance("kv_offload_loads_cut", stats["kv_offload_loads_cut_total"], self._loads_cut)
            for decision, total in stats["kv_offload_decisions_total"].items():
                self._advance(f"decision:{decision}", total, self._offload_decisions.labels(name, decision))

    def _advance(self, key: str, total: float, counter) -> None:
        delta = total - self._last_totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._last_totals[key] = total

    def serve_lora(self, request) -> None:
        """An adapter named by the server: the requests of this LoRARequest are counted under its name."""
        self._lora_served[request.lora_name] = request.lora_int_id

    def forget_lora(self, name: str) -> None:
        """An unloaded adapter's series go (runtime loads must not grow the series without end); its
        requests still running are not counted (they would bring the series back, or count under a
        name another adapter takes next)."""
        self._lora_served.pop(name, None)
        for counter in (self._lora_requests, self._lora_queries, self._lora_hits):
            try:
                counter.remove(self._model_name, name)
            except KeyError:
                pass

    def observe_finished(self, out: RequestOutput, lora=None) -> None:
        m = out.metrics
        lora_name = lora.lora_name if lora is not None and self._lora_served.get(lora.lora_name) == lora.lora_int_id else None
        if lora_name is not None:
            self._lora_requests.labels(self._model_name, lora_name).inc()
            self._lora_queries.labels(self._model_name, lora_name).inc(len(out.prompt_token_ids))
            self._lora_hits.labels(self._model_name, lora_name).inc(out.num_cached_tokens)
        arrival = m["arrival_time"]
        if "first_scheduled_time" in m:
            self.queue_time.observe(m["first_scheduled_time"] - arrival)
        if "first_token_time" in m:
            self.ttft.observe(m["first_token_time"] - arrival)
            if out.num_output_tokens > 1 and "last_token_time" in m:
                self.tpot.observe((m["last_token_time"] - m["first_token_time"]) / (out.num_output_tokens - 1))
        if "finished_time" in m:
            self.e2e.observe(m["finished_time"] - arrival)
        if out.finish_reason in ("stop", "length"):
            self._success.labels(self._model_name, out.finish_reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self._model_name, reason).inc()

    def aborted(self, reason: str) -> None:
        self._aborted.labels(self._model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
