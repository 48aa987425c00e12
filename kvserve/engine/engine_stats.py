"""What the engine reports about itself (LLM.stats(), the server's metrics and /v1/loads): the
prefix cache's counters and the engine's. LLMEngine binds these as its methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.engine.speculative import SpecDecodeStats

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine


def prefix_cache_stats(engine: LLMEngine) -> dict:
    """The prefix cache's counters: lookups, hits, misses by cause, evictions."""
    p = engine.kv.prefix_stats
    return {
        "prefix_cache": engine.kv.prefix_cache.name if engine.kv.prefix_cache is not None else None,
        "prefix_cache_queries_total": p.queries,
        "prefix_cache_hits_total": p.hits,
        "prefix_cache_eligible_tokens_total": p.eligible,
        "prefix_cache_requests_total": p.requests,
        "prefix_cache_requests_hit_total": p.requests_hit,
        "prefix_cache_request_hit_rate": p.requests_hit / p.requests if p.requests else 0.0,
        "prefix_cache_reused_token_ratio": p.hits / p.eligible if p.eligible else 0.0,
        "prefix_cache_misses_total": dict(p.misses),
        "prefix_cache_evictions_total": engine.kv.pool.num_evictions,
    }


def lora_stats(engine: LLMEngine) -> dict | None:
    """The adapters of the running and waiting requests (vLLM's lora_requests_info), and the bytes resident."""
    if engine.lora is None:
        return None
    names = lambda seqs: sorted({s.lora.request.lora_name for s in seqs if s.lora is not None})  # noqa: E731
    return {"max_lora": engine.lora.max_loras, "running": names(engine.scheduler.running), "waiting": names(engine.scheduler.waiting),
            "resident_bytes": engine.lora.resident_bytes, "max_resident_bytes": engine.lora.max_resident_bytes, "reuse": adapter_reuse(engine)}  # fmt: skip


def adapter_reuse(engine: LLMEngine) -> list[dict]:
    """The prefix cache's reuse per LoRA adapter (by the weights' identity; names: those held now)."""
    rows = []
    for identity, r in engine.kv.prefix_stats.adapters.items():
        rows.append({"adapter": identity[:16], "lora_names": engine.lora.names(identity) if engine.lora is not None else [],
                     "requests": r.requests, "queried_tokens": r.queries, "hit_tokens": r.hits,
                     "hit_rate_tokens": r.hits / max(r.queries, 1)})  # fmt: skip
    return rows


def stats(engine: LLMEngine) -> dict:
    """The engine's counters and settings, the prefix cache's and the KV tiers' among them (the server takes one each step)."""
    return {
        "model": engine.config.model,
        "dtype": engine.config.dtype,
        "weight_dtype": engine.weight_dtype,
        "weight_bytes": engine.weight_bytes,
        "num_blocks": engine.kv.num_blocks,
        "num_free_blocks": engine.kv.num_free_blocks,
        "kv_cache_groups": [
            {"layers": list(group.layers), "attention": group.attention, "num_blocks": engine.kv.num_blocks,
             "num_free_blocks": engine.kv.num_free_blocks, "num_used_blocks": used}
            for group, used in zip(engine.kv.groups, engine.kv.num_used_blocks)
        ],  # fmt: skip
        "block_size": engine.kv_spec.block_size,
        "bytes_per_token": engine.kv_spec.bytes_per_token,
        "scale_bytes_per_token": engine.kv_spec.scale_bytes_per_token,
        # tokens of every layer the pool holds (a sliding-window model holds longer sequences: max_model_len)
        "token_capacity": engine.kv.num_blocks * engine.kv_spec.block_size // len(engine.kv.groups),
        "kv_cache_bytes": engine.kv.num_blocks * engine.kv_spec.bytes_per_block,
        "kv_cache_dtype": engine.kv_spec.kv_dtype,
        # int4 / int2: the full-precision blocks the pool could hold at once (they share its bytes)
        "kv_quant_residual_blocks": engine.kv.residual_pool.num_blocks if engine.kv.residual_pool is not None else 0,
        "kv_key_centering": engine.config.centers_keys,
        "kv_hadamard": engine.rotates_kv,
        "kv_quant_sink_block": bool(engine.kv_spec.quant_sink_blocks),
        "kv_quant_residual_free_blocks": engine.kv.residual_pool.num_free_blocks if engine.kv.residual_pool is not None else 0,
        "kv_cache_usage": engine.kv.usage,
        # stored conversations' blocks pinned between turns (kv/conversation_pins.py): counted in kv_cache_usage too
        "kv_conversation_pinned_blocks": engine.kv.pins.num_blocks if engine.kv.pins is not None else 0,
        "kv_conversations_pinned": len(engine.kv.pins) if engine.kv.pins is not None else 0,
        "lora": lora_stats(engine),
        "num_preemptions": engine.scheduler.num_preemptions,
        "kv_compression": engine.config.kv_compression,
        "snapkv_query": engine.config.snapkv_query,
        "snapkv_question_weight": engine.config.snapkv_question_weight,
        "kv_evicted_tokens_total": engine.num_evicted_tokens,
        "kv_compactions_total": engine.num_compactions,
        "kv_probe_tokens_total": engine.num_probe_tokens,
        "num_steps": engine.num_steps,
        "peak_num_blocks_used": engine.peak_num_blocks_used,
        "kv_cache_usage_peak": engine.peak_num_blocks_used / engine.kv.num_blocks,
        "num_running": engine.num_running,
        "num_waiting": engine.num_waiting,
        # prompt (and, after a preemption, output) tokens the waiting sequences still have to compute, before prefix hits
        "num_waiting_tokens": sum(len(seq.token_ids) - seq.num_computed_tokens for seq in engine.scheduler.waiting),
        "max_num_seqs": engine.config.max_num_seqs,
        "max_model_len": engine.max_model_len,
        "prompt_tokens_total": engine.prompt_tokens_total,
        "generation_tokens_total": engine.generation_tokens_total,
        **prefix_cache_stats(engine),
        **(engine.kv.offloader.stats() if engine.kv.offloader is not None else {"kv_tiers": {}}),
        "kv_role": engine.config.kv_role,
        "kv_handovers_published_total": engine.handovers_published,
        "kv_migrations_total": dict(engine.migrations, hit_tokens=engine.scheduler.migrated_hit_tokens),
        "speculative_method": engine.speculator.config.method if engine.speculator is not None else None,
        **(engine.speculator.stats if engine.speculator is not None else SpecDecodeStats()).as_dict(),
    }
